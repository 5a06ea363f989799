"""Logprobs in OpenAI's two layouts: completions (`tokens`, `token_logprobs`, `top_logprobs`,
`text_offset`; with echo the prompt's come first, the first prompt token unscored) and chat
(`content` entries with `bytes` and `top_logprobs`). Streams send each token once: a Cursor
remembers how far a choice has been sent."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minisgl.protocol.token_texts import TokenTexts
from minisgl.runtime import ReqHandle


@dataclass
class Cursor:
    """How much of one choice a client has been sent."""

    chars: int = 0  # of the text
    tokens: int = 0  # of the logprobs
    offset: int = 0  # text_offset of the next token (completions logprobs)
    prefix: str = ""  # echo text still to send
    prompt_logprobs: bool = False  # echo with logprobs: the prompt's still to send


def unsent(h: ReqHandle, cursor: Cursor
           ) -> tuple[list[tuple[float, int]], list[list[tuple[float, int]]]]:
    """The token and top logprobs not sent yet; advances the cursor past them."""
    new, tops = h.token_logprobs[cursor.tokens:], h.top_logprobs[cursor.tokens:]
    cursor.tokens += len(new)
    return new, tops


def completion_logprobs(tokens: TokenTexts, h: ReqHandle, cursor: Cursor) -> dict[str, Any]:
    new, tops = unsent(h, cursor)
    values: list[float | None] = [lp for lp, _ in new]
    ids = [t for _, t in new]
    steps: list[list[tuple[float, int]] | None] = list(tops)
    if cursor.prompt_logprobs:  # echo: the prompt's tokens first, the first one unscored
        cursor.prompt_logprobs = False
        scored = len(h.input_logprobs)
        values = [None, *h.input_logprobs, *values]
        ids = [*h.prompt_ids[: scored + 1], *ids]
        steps = [None, *h.input_top_logprobs, *steps]
    # NOTE: as OpenAI and vLLM: each top_logprobs dict holds the chosen token too (so up to
    # logprobs + 1 entries, and one with logprobs 0)
    steps = [None if step is None or value is None else [(value, token), *step]
             for value, token, step in zip(values, ids, steps)]
    texts = tokens.texts(ids)
    top_texts = tokens.texts([t for step in steps if step for _, t in step])
    offsets = []
    for text in texts:
        offsets.append(cursor.offset)
        cursor.offset += len(text)
    top_dicts: list[dict[str, float] | None] = []
    at = 0
    for step in steps:
        if step is None:
            top_dicts.append(None)
            continue
        top_dicts.append({top_texts[at + i]: lp for i, (lp, _) in enumerate(step)})
        at += len(step)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": top_dicts,
            "text_offset": offsets}


def chat_logprobs(tokens: TokenTexts, h: ReqHandle, cursor: Cursor) -> dict[str, Any]:
    new, tops = unsent(h, cursor)
    texts = tokens.text_and_bytes([t for _, t in new])
    top_texts = tokens.text_and_bytes([t for step in tops for _, t in step])
    content, at = [], 0
    for (lp, _), (text, raw), step in zip(new, texts, tops):
        alts = [{"token": top_texts[at + i][0], "logprob": alp,
                 "bytes": list(top_texts[at + i][1])} for i, (alp, _) in enumerate(step)]
        at += len(step)
        content.append({"token": text, "logprob": lp, "bytes": list(raw),
                        "top_logprobs": alts})
    return {"content": content}
