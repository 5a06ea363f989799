"""Incremental, UTF-8 safe detokenization with stop strings, batched per scheduler step.

Each request decodes a sliding window: `surr` tokens already shown plus the new ones. Text is
emitted only when the window's decoding does not end in U+FFFD (a multi-byte character split
across tokens), so a character is never sent half or twice. Stop strings are searched in the
cumulative text; while a request runs, the last (longest stop - 1) characters are held back
so that the text a client sees only ever grows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.core import SamplingParams

CONTEXT_TOKENS = 4  # prompt tokens decoded in front of the output, for leading spaces/merges


@dataclass
class DecodeState:
    params: SamplingParams
    ids: list[int]  # context tokens, then every output token
    surr_offset: int = 0
    read_offset: int = 0
    text: str = ""  # all the text decoded so far
    stop_hit: str | None = None  # the stop string that ended the request
    visible_len: int = 0  # text[:visible_len] may be shown to the client
    output_ids: list[int] = field(default_factory=list)

    @classmethod
    def start(cls, prompt_ids: list[int], params: SamplingParams) -> DecodeState:
        context = prompt_ids[-CONTEXT_TOKENS:]
        return cls(params=params, ids=list(context), surr_offset=0, read_offset=len(context))

    @property
    def visible_text(self) -> str:
        return self.text[: self.visible_len]


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def step(self, updates: list[tuple[DecodeState, int | None, bool]]) -> list[DecodeState]:
        """Apply one step's new token (or None) to each state; `finished` flushes held-back
        text. Returns the states whose stop string matched in this step."""
        pending = []
        for state, token, _ in updates:
            if token is not None and state.stop_hit is None:
                state.ids.append(token)
                state.output_ids.append(token)
                pending.append(state)
        self._decode(pending)
        stopped = []
        for state, _, finished in updates:
            if state.stop_hit is None and self._match_stop(state):
                stopped.append(state)
            elif state.stop_hit is None:
                hold = 0 if finished else max((len(s) for s in state.params.stop_strings),
                                              default=1) - 1
                state.visible_len = max(state.visible_len, len(state.text) - hold)
        return stopped

    def _decode(self, states: list[DecodeState]) -> None:
        if not states:
            return
        for skip in (True, False):
            group = [s for s in states if s.params.skip_special_tokens is skip]
            if not group:
                continue
            kwargs = {"skip_special_tokens": skip,
                      "spaces_between_special_tokens": group[0].params.spaces_between_special_tokens}
            surr = self.tokenizer.batch_decode(
                [s.ids[s.surr_offset:s.read_offset] for s in group], **kwargs)
            full = self.tokenizer.batch_decode([s.ids[s.surr_offset:] for s in group], **kwargs)
            for state, before, now in zip(group, surr, full):
                if now.endswith("\ufffd") or len(now) <= len(before):
                    continue  # an incomplete UTF-8 sequence: wait for the next token
                state.text += now[len(before):]
                state.surr_offset, state.read_offset = state.read_offset, len(state.ids)

    @staticmethod
    def _match_stop(state: DecodeState) -> bool:
        stops = state.params.stop_strings
        if not stops:
            return False
        window_start = max(0, state.visible_len - max(len(s) for s in stops))
        best: tuple[int, str] | None = None
        for stop in stops:
            at = state.text.find(stop, window_start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        end = at + len(stop) if state.params.no_stop_trim else at
        state.text = state.text[:end]
        state.visible_len = end
        state.stop_hit = stop
        return True
