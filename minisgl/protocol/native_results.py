"""SGLang's native results: per request, `{"text", "output_ids", "meta_info"}` (and
`prompt_token_ids` if asked); for a batch, a list; for a stream, one cumulative result per
chunk, with its `"index"` in a streamed batch.

Logprob entries are `[logprob, token_id, token_text_or_null]`, built once each, with their text
when the request asked for it (return_text_in_logprobs).
"""

from __future__ import annotations

import time
from typing import Any

from minisgl.protocol.native import GenerateRequest
from minisgl.protocol.token_texts import TokenTexts
from minisgl.runtime import ReqHandle

Pair = tuple[float, int]  # (logprob, token id), as the request handle keeps them


class ResultShaper:
    """Shapes one request's results. Kept across a stream's chunks, it converts only the
    logprob entries that are new since the last chunk and appends them to lists it keeps, so a
    chunk costs what is new while the JSON still carries SGLang's cumulative lists.

    NOTE: successive results share those lists: serialize a result before asking for the next.
    The prompt's logprobs arrive at most once and only grow, as the output's do."""

    def __init__(self, tokens: TokenTexts | None, prompt_ids_wanted: bool) -> None:
        self.tokens, self.prompt_ids_wanted = tokens, prompt_ids_wanted
        self.output_token_logprobs: list[list[Any]] = []
        self.output_top_logprobs: list[list[list[Any]]] = []
        self.input_token_logprobs: list[list[Any]] = []
        self.input_top_logprobs: list[list[list[Any]] | None] = []

    def result(self, h: ReqHandle) -> dict[str, Any]:
        result = {"text": h.text, "output_ids": list(h.output_ids), "meta_info": self.meta(h)}
        if self.prompt_ids_wanted:
            result["prompt_token_ids"] = list(h.prompt_ids)
        return result

    def meta(self, h: ReqHandle) -> dict[str, Any]:
        end = h.finished_at or time.perf_counter()
        meta: dict[str, Any] = {
            "id": h.rid,
            "finish_reason": h.finish_reason,
            "prompt_tokens": len(h.prompt_ids),
            "completion_tokens": len(h.output_ids),
            "cached_tokens": h.cached_tokens,
            "e2e_latency": end - h.created,
        }
        if h.spec is not None:  # SGLang's names; accept length: tokens per verify step
            verify_ct, drafted, accepted = h.spec
            meta.update(spec_verify_ct=verify_ct, spec_draft_token_num=drafted,
                        spec_accept_token_num=accepted,
                        spec_accept_rate=accepted / drafted if drafted else 0.0,
                        spec_accept_length=(len(h.output_ids) / verify_ct if verify_ct
                                            else 0.0))
        if h.logprob_num >= 0:
            self._add_new_logprobs(h)
            meta["output_token_logprobs"] = self.output_token_logprobs
            meta["output_top_logprobs"] = self.output_top_logprobs
            meta["input_token_logprobs"] = self.input_token_logprobs
            meta["input_top_logprobs"] = self.input_top_logprobs
        return meta

    def _add_new_logprobs(self, h: ReqHandle) -> None:
        self.output_token_logprobs += self._entries(
            h.token_logprobs[len(self.output_token_logprobs):])
        self.output_top_logprobs += self._steps(h.top_logprobs[len(self.output_top_logprobs):])
        if h.logprob_start_len < 0:  # -1 (the default) starts at the prompt's end: no entries
            return
        # SGLang's layout: the token at logprob_start_len gets None (nothing before it was
        # scored), each later prompt token its logprob given everything before it
        start, values = h.logprob_start_len, h.input_logprobs
        known = min(len(h.prompt_ids) - start, 1 + len(values))
        self.input_token_logprobs += self._entries(
            [(values[j - 1] if j else None, h.prompt_ids[start + j])
             for j in range(len(self.input_token_logprobs), known)])
        if not self.input_top_logprobs:
            self.input_top_logprobs.append(None)
        self.input_top_logprobs += self._steps(
            h.input_top_logprobs[len(self.input_top_logprobs) - 1:])

    def _texts(self, ids: list[int]) -> list[str | None]:
        return self.tokens.texts(ids) if self.tokens is not None else [None] * len(ids)

    def _entries(self, pairs: list[tuple[float | None, int]]) -> list[list[Any]]:
        texts = self._texts([t for _, t in pairs])
        return [[lp, t, text] for (lp, t), text in zip(pairs, texts)]

    def _steps(self, steps: list[list[Pair]]) -> list[list[list[Any]]]:
        texts = iter(self._texts([t for step in steps for _, t in step]))
        return [[[lp, t, next(texts)] for lp, t in step] for step in steps]


def _shaper(req: GenerateRequest, tokens: TokenTexts) -> ResultShaper:
    return ResultShaper(tokens if req.text_in_logprobs else None, req.prompt_ids_wanted)


def generate_results(req: GenerateRequest, handles: list[ReqHandle], tokens: TokenTexts
                     ) -> dict[str, Any] | list[dict[str, Any]]:
    """The answer to a finished `/generate`: one result, or a list (prompt i's n samples in a
    row)."""
    results = [_shaper(req, tokens).result(h) for h in handles]
    return results[0] if req.single else results


class GenerateStream:
    """The chunks of a streamed `/generate`: request i's cumulative result each time its
    tokens, text or state changed."""

    def __init__(self, req: GenerateRequest, tokens: TokenTexts) -> None:
        self.req, self.tokens = req, tokens
        self._shapers: dict[int, ResultShaper] = {}
        self._sent: dict[int, tuple[int, int, bool]] = {}

    def chunk(self, i: int, h: ReqHandle) -> dict[str, Any] | None:
        key = (len(h.output_ids), h.detok.visible_len, h.finished)  # no text copy
        if self._sent.get(i) == key:
            return None
        self._sent[i] = key
        if i not in self._shapers:
            self._shapers[i] = _shaper(self.req, self.tokens)
        result = self._shapers[i].result(h)
        if not self.req.single:
            result["index"] = i
        return result
