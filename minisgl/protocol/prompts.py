"""The prompt shapes every endpoint takes: a string or a non-empty list of strings, token ids
(a non-empty list) or a non-empty list of such lists. Each parser reads them with these two
functions, so the shapes are defined once."""

from __future__ import annotations

from typing import Any

from minisgl.core import SamplingParams
from minisgl.protocol.fields import is_ids
from minisgl.runtime import Prompt


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
