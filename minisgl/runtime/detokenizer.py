"""Incremental, UTF-8 safe detokenization with stop strings and stop regexes, batched per
scheduler step.

Each request decodes a sliding window: `surr` tokens already shown plus the new ones. Text is
emitted only when the window's decoding does not end in U+FFFD (a multi-byte character split
across tokens), so a character is never sent half or twice. Stop strings are searched in the
cumulative text; while a request runs, the last (longest stop - 1) characters are held back
so that the text a client sees only ever grows.

Stop regexes (SGLang's `stop_regex`) are searched in the same text each step, from the first
position where a new match can still start (`stop_regex.StopRegex.reach`), with a timeout: this runs
on the server's one event loop. A match is kept in the text, which ends at the match's end
(SGLang keeps it too). As in SGLang, a pattern is searched in the text generated so far, so
`\\bthe\\b` matches a "the" at the end of it even if the next token would have made it
"there". Of a stop string and a regex match, the one that ends first in the text wins.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from minisgl.core import SamplingParams
from minisgl.stop_regex import StopRegex, compile_stop_regex

CONTEXT_TOKENS = 4  # prompt tokens decoded in front of the output, for leading spaces/merges
# Time all of one request's stop regexes may take in one step; past it the request is aborted.
STOP_REGEX_TIMEOUT_S = 0.05


@dataclass
class DecodeState:
    """One request's detokenization. Offsets index its tokens: `context`, then `output_ids`."""

    params: SamplingParams
    context: list[int]  # the prompt's last tokens, decoded in front of the output
    surr_offset: int = 0
    read_offset: int = 0
    text: str = ""  # all the text decoded so far
    # what ended the request: {"type": "stop", "matched": the stop string or regex}, or an
    # abort (a stop regex that took too long)
    finish_reason: dict[str, Any] | None = None
    visible_len: int = 0  # text[:visible_len] may be shown to the client
    output_ids: list[int] = field(default_factory=list)
    regexes: list[StopRegex] = field(default_factory=list)
    regex_searched: int = 0  # length of the text the regexes were last searched in

    @classmethod
    def start(cls, prompt_ids: list[int], params: SamplingParams) -> DecodeState:
        context = prompt_ids[-CONTEXT_TOKENS:]
        return cls(params=params, context=context, surr_offset=0, read_offset=len(context),
                   regexes=[compile_stop_regex(p) for p in params.stop_regexes])

    @property
    def num_tokens(self) -> int:
        return len(self.context) + len(self.output_ids)

    def tokens(self, start: int, end: int | None = None) -> list[int]:
        """Tokens [start, end) of context + output_ids."""
        skip = len(self.context)
        if start >= skip:
            return self.output_ids[start - skip: None if end is None else end - skip]
        return (self.context + self.output_ids)[start:end]

    @property
    def visible_text(self) -> str:
        return self.text[: self.visible_len]


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def step(self, updates: list[tuple[DecodeState, int | None, bool]]) -> list[DecodeState]:
        """Apply one step's new token (or None) to each state; `finished` flushes held-back
        text. Returns the states that a stop string or regex finished in this step."""
        pending: dict[int, DecodeState] = {}
        for state, token, _ in updates:
            if token is not None and state.finish_reason is None:
                state.output_ids.append(token)
                pending[id(state)] = state  # NOTE: once, though coalesced steps repeat it
        self._decode(list(pending.values()))
        stopped = []
        for state, _, finished in updates:
            if state.finish_reason is None and self._match_stop(state):
                stopped.append(state)
            elif state.finish_reason is None:
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
                [s.tokens(s.surr_offset, s.read_offset) for s in group], **kwargs)
            full = self.tokenizer.batch_decode([s.tokens(s.surr_offset) for s in group],
                                               **kwargs)
            for state, before, now in zip(group, surr, full):
                if now.endswith("\ufffd") or len(now) <= len(before):
                    continue  # an incomplete UTF-8 sequence: wait for the next token
                state.text += now[len(before):]
                state.surr_offset, state.read_offset = state.read_offset, state.num_tokens

    @staticmethod
    def _match_stop(state: DecodeState) -> bool:
        """Finds the first stop (by where it ends in the text) and cuts the text there."""
        best: tuple[int, int, str] | None = None  # (end, where the text ends, what matched)
        stops = state.params.stop_strings
        if stops:
            window_start = max(0, state.visible_len - max(len(s) for s in stops))
            for stop in stops:
                at = state.text.find(stop, window_start)
                if at >= 0:
                    end = at + len(stop)
                    cut = end if state.params.no_stop_trim else at
                    if best is None or (end, cut) < best[:2]:
                        best = (end, cut, stop)
        if state.regexes and len(state.text) > state.regex_searched:
            searched, state.regex_searched = state.regex_searched, len(state.text)
            deadline = time.perf_counter() + STOP_REGEX_TIMEOUT_S
            for stop in state.regexes:
                pos = 0 if stop.reach is None else max(0, searched - stop.reach)
                try:  # NOTE: search(text, pos), not text[pos:]: `^` and lookbehinds keep
                    # their meaning
                    match = stop.compiled.search(
                        state.text, pos, timeout=max(deadline - time.perf_counter(), 1e-3))
                except TimeoutError:
                    state.visible_len = len(state.text)
                    state.finish_reason = {
                        "type": "abort", "message": (
                            f"stop_regex {stop.pattern!r} took too long to search (over "
                            f"{STOP_REGEX_TIMEOUT_S * 1000:.0f} ms in one step); the request "
                            "was stopped")}
                    return True
                if match is not None and (best is None or match.end() < best[0]):
                    best = (match.end(), match.end(), stop.pattern)
        if best is None:
            return False
        _, cut, matched = best
        end = max(cut, state.visible_len)  # NOTE: the visible text only grows
        state.text = state.text[:end]
        state.visible_len = end
        state.finish_reason = {"type": "stop", "matched": matched}
        return True
