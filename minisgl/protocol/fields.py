"""The field policy every endpoint follows, the small checks its parsers share, and the prompt
shapes every endpoint takes (a string or a non-empty list of strings, token ids or a non-empty
list of such lists: `text_prompts`, `ids_prompts`).

- a field minisgl acts on is checked and used;
- a field that changes nothing a client sees (an endpoint's inert set) is accepted with any
  value;
- a field for a feature minisgl lacks (an endpoint's unsupported set) is accepted at its
  default (null, false, 0, empty) and refused with a 400 that names it otherwise;
- a field no SGLang release defines is ignored, and logged once at warning level
  (`UnknownFields`), as vLLM's and SGLang's OpenAI servers ignore unknown fields.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from minisgl.core import SamplingParams, asks_nothing
from minisgl.errors import InvalidRequest
from minisgl.runtime import Prompt

logger = logging.getLogger(__name__)


class UnknownFields:
    """Ignores fields no endpoint knows, logging each name once (no log flooding)."""

    def __init__(self) -> None:
        self._logged: set[tuple[str, str]] = set()

    def ignore(self, where: str, names: set[str] | list[str]) -> None:
        new = sorted(n for n in names if (where, n) not in self._logged)
        if new:
            self._logged.update((where, n) for n in new)
            logger.warning("%s: ignoring unknown field(s) %s (logged once)", where,
                           ", ".join(new))


def refuse_unsupported(body: dict[str, Any], names: frozenset[str] | set[str]) -> None:
    for name in sorted(names & set(body)):
        if not asks_nothing(body[name]):
            raise InvalidRequest(f"{name} is not supported by minisgl")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(is_int(t) for t in value)


def none_as(value: Any, default: Any) -> Any:
    """JSON null means the field's default."""
    return default if value is None else value


def check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}")
    return value


def check_int(value: Any, name: str, low: int, high: int | None = None) -> int:
    if not is_int(value) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise InvalidRequest(f"{name} must be an integer {bound}, got {value!r}")
    return value


def check_priority(value: Any) -> int | None:
    """A request's `priority` (used with --enable-priority-scheduling): an integer or null."""
    if value is not None and not is_int(value):
        raise InvalidRequest(f"priority must be an integer, got {value!r}")
    return value


def flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A boolean field: true, false, or absent / null (its default)."""
    return check_bool(none_as(body.get(name), default), name)


def per_item(value: Any, count: int, name: str, check: Callable[[Any], Any],
             single: bool) -> list[Any]:
    """A field that is one value for every prompt or (in a batch) a list with one per prompt."""
    if isinstance(value, list) and not single:
        if len(value) != count:
            raise InvalidRequest(f"{name} has {len(value)} elements for {count} prompts")
        return [check(v) for v in value]
    return [check(value)] * count


def batch_rids(rid: Any, count: int, single: bool) -> list[str | None]:
    """Each prompt's rid: one rid, a list with one per prompt, or (as SGLang) one rid naming a
    batch's items `{rid}_{i}`."""
    if not single and isinstance(rid, str):
        rid = [f"{rid}_{i}" for i in range(count)]
    return per_item(rid, count, "rid", _check_rid, single)


def _check_rid(rid: Any) -> str | None:
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise InvalidRequest(f"rid must be a non-empty string, got {rid!r}")
    return rid


def check_adapter_name(name: Any) -> str | None:
    """lora_path: a loaded adapter's name (or path), or null / "" for the base model."""
    if name is None or name == "":
        return None
    if not isinstance(name, str):
        raise InvalidRequest(f"lora_path must be an adapter name (a string) or null, got "
                             f"{name!r}")
    return name


def text_prompts(value: Any) -> tuple[bool, list[Prompt]] | None:
    """(one prompt rather than a list, the prompts) of text; None if `value` is not text."""
    if isinstance(value, str):
        return True, [Prompt([], SamplingParams(), text=value)]
    if isinstance(value, list) and value and all(isinstance(t, str) for t in value):
        return False, [Prompt([], SamplingParams(), text=t) for t in value]
    return None


def ids_prompts(value: Any) -> tuple[bool, list[Prompt]] | None:
    """(one prompt rather than a list, the prompts) of token ids; None if `value` is not."""
    if is_ids(value) and value:
        return True, [Prompt(list(value), SamplingParams())]
    if isinstance(value, list) and value and all(is_ids(x) for x in value):
        return False, [Prompt(list(ids), SamplingParams()) for ids in value]
    return None
