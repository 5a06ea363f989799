"""SGLang's `stop_regex`, checked and measured once per pattern: compiled for the `regex`
package (searched with a timeout by runtime.tokenizer) and bounded in how far right of a
match's start matching can look, so that each step searches only where a new match can still
start."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

import regex

from minisgl.errors import InvalidRequest

try:  # Python's regex parser (`import sre_parse` warns from 3.11 on)
    from re import _parser as sre_parse
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse  # type: ignore[no-redef]


# The `regex` package unrolls counted repeats when it compiles (`(?:a{1000}){1000}` takes a
# second, on the event loop): a pattern may expand to at most this many items.
STOP_REGEX_MAX_EXPANSION = 4096


@dataclass(frozen=True)
class StopRegex:
    """A checked stop_regex. `reach`: the most characters right of a match's start that
    matching looks at (the match, lookaheads, and the one a `$` or `\\b` after it peeks at), or
    None; once a text of length N had no match, no match can start before N - reach."""

    pattern: str
    compiled: Any  # a regex.Pattern: searched with a timeout (runtime.tokenizer)
    reach: int | None


@functools.lru_cache(maxsize=256)
def compile_stop_regex(pattern: str) -> StopRegex:
    """Raises InvalidRequest naming stop_regex. The pattern must be valid for Python's `re`
    (SGLang searches with it); it is searched with the `regex` package (its default syntax is
    `re`'s) for the timeout `re` lacks."""
    try:
        re.compile(pattern)
        reach, size = _regex_measure(sre_parse.parse(pattern))
        compiled = regex.compile(pattern) if size <= STOP_REGEX_MAX_EXPANSION else None
    except (re.error, regex.error, RecursionError, OverflowError, ValueError) as exc:
        raise InvalidRequest(f"stop_regex {pattern!r} is not a valid regular expression: "
                             f"{exc}") from None
    if compiled is None:
        raise InvalidRequest(f"stop_regex {pattern!r}: its repetitions expand to {size} items; "
                             f"at most {STOP_REGEX_MAX_EXPANSION} are allowed")
    return StopRegex(pattern, compiled, None if reach is None else reach + 1)


def _regex_measure(items: Any) -> tuple[int | None, int]:
    """(characters a match can consume or look ahead at, None if unbounded; items with counted
    repeats unrolled). Over-estimates are safe; lookbehinds see before the search position."""
    reach: int | None = 0
    size = 0
    for op, value in items:
        if op in (sre_parse.SUBPATTERN, sre_parse.ASSERT, sre_parse.ASSERT_NOT, _ATOMIC):
            one, more = _regex_measure(value if op == _ATOMIC else value[-1])
            one = 0 if op in (sre_parse.ASSERT, sre_parse.ASSERT_NOT) and value[0] < 0 else one
        elif op in (sre_parse.BRANCH, sre_parse.GROUPREF_EXISTS):
            branches = value[1] if op == sre_parse.BRANCH else value[1:]
            parts = [_regex_measure(b) for b in branches if b is not None]
            reaches = [r for r, _ in parts]
            one = None if None in reaches else max(reaches, default=0)
            more = sum(n for _, n in parts)
        elif op in _REPEATS:
            (inner, unit), (low, high) = _regex_measure(value[2]), value[:2]
            unbounded = high == sre_parse.MAXREPEAT
            one = inner if inner == 0 else None if inner is None or unbounded else high * inner
            more = unit * max(low if unbounded else high, 1)
        else:  # a character (or a set), a position; a back reference (or else) is unbounded
            one, more = (0 if op == sre_parse.AT else 1 if op in _CHARS else None), 1
        reach = None if reach is None or one is None else reach + one
        size += more
    return reach, size


_ATOMIC = getattr(sre_parse, "ATOMIC_GROUP", object())  # Python 3.11+
_CHARS = (sre_parse.LITERAL, sre_parse.NOT_LITERAL, sre_parse.ANY, sre_parse.IN)
_REPEATS = tuple(getattr(sre_parse, name) for name in ("MAX_REPEAT", "MIN_REPEAT",
                                                       "POSSESSIVE_REPEAT")
                 if hasattr(sre_parse, name))
