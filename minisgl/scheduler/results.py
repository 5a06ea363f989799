"""A finished forward's results, request by request: the sampled token, whether it finishes
the request, and the logprobs asked for, as plain events.

What the scheduler tells the outside is plain values, never a live request: `add_requests`
answers each queued request with a `Queued`; every step then sends a list of `ReqEvent`s to the
sink, one per request with news (a token, a finish, or both); a verify step of speculative
decoding may give a request several, one per token, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from minisgl.core import Req, SamplingParams
from minisgl.engine import ForwardOutput
from minisgl.scheduler.batch_builder import ScheduledBatch


@dataclass(frozen=True, slots=True)
class Queued:
    """A request the scheduler accepted: its rid (made up when none was given) and its
    sampling parameters with max_new_tokens resolved."""

    rid: str
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class ReqEvent:
    """One step's news for one request."""

    rid: str
    token: int | None  # the new output token, or None (a finish without one)
    finish_reason: dict[str, Any] | None = None  # set once: the request's last event
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    tier_tokens: dict[str, int] | None = None  # of those, each lower tier's (Req.tier_tokens)
    logprob: float | None = None  # of `token`, when logprobs were asked for
    top_logprobs: list[tuple[float, int]] | None = None  # (logprob, token id), best first
    # with the first output, when logprobs were asked for: one per scored prompt position
    input_logprobs: list[float] | None = None
    input_top_logprobs: list[list[tuple[float, int]]] | None = None
    # a speculating request's running totals: (verify steps, drafted, accepted drafts)
    spec: tuple[int, int, int] | None = None
    # an embedding request's answer: [hidden] float32 on the host, L2-normalised
    embedding: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


NEG_INF = float("-inf")


def finished_event(req: Req) -> ReqEvent:
    """The event of a request finished without a new token."""
    return ReqEvent(req.rid, None, req.finish_reason, req.cached_tokens, req.tier_tokens,
                    spec=_spec_counts(req))


def finish_reason(req: Req, token: int) -> dict[str, Any] | None:
    """Why `token`, just appended to req.host_ids, ends the request (None: it goes on).
    NOTE: a stop token is checked before the length cap, as SGLang and vLLM do: an answer
    that ends exactly on its last allowed token is complete (`stop`), not cut (`length`)."""
    if token in req.stop_ids:
        return {"type": "stop", "matched": token}
    if req.matcher is not None:
        reason = grammar_finish(req, token)
        if reason is not None:
            return reason
    if req.num_outputs >= req.params.max_new_tokens:
        return {"type": "length", "length": req.num_outputs}
    return None


def grammar_finish(req: Req, token: int) -> dict[str, Any] | None:
    """The matcher takes the token; a grammar that has ended (its stop token) stops the
    request. A token the grammar refuses cannot come from a masked row: it is an error."""
    if not req.matcher.accept_token(token):
        return {"type": "abort", "message": f"token {token} does not follow the grammar"}
    if req.matcher.is_terminated():
        return {"type": "stop", "matched": token}
    return None


def collect_events(done: ScheduledBatch, out: ForwardOutput,
                   finish: Callable[[Req, dict[str, Any]], None],
                   release_surplus: Callable[[Req, int], None] | None) -> list[ReqEvent]:
    """Append each row's token (a verify step: tokens) to its request and call `finish` for the
    requests it ends; tokens past the one that ends a request are dropped. `release_surplus`
    (a verify step) gives back the KV slots a row reserved but did not fill."""
    tokens = out.token_ids.tolist()
    counts = out.counts.tolist() if out.counts is not None else None
    logprobs = out.logprobs.tolist() if out.logprobs is not None else None
    tops = None
    if out.top_logprobs is not None:
        tops = list(zip(out.top_logprobs[0].tolist(), out.top_logprobs[1].tolist()))
    if out.input_logprobs is not None:
        store_input_logprobs(done, out)
    drafted = out.drafted.tolist() if out.drafted is not None else None
    embeddings = ({} if out.embeddings is None
                  else dict(zip(done.embed_rows, out.embeddings.unbind(0))))
    events: list[ReqEvent] = []
    for i, req in enumerate(done.reqs):
        if not done.last_chunk[i] or req.is_finished:
            continue  # NOTE: a request finished in an earlier batch gets no extra token
        if counts is None:
            row_tokens = [tokens[i]]
            row_logprobs = None if logprobs is None else [logprobs[i]]
            row_tops = None if tops is None else [tops[i]]
        else:  # a verify step
            row_tokens = tokens[i][:counts[i]]
            row_logprobs = None if logprobs is None else logprobs[i]
            row_tops = None if tops is None else list(zip(*tops[i]))
            if req.spec is not None:
                assert done.reserved is not None and drafted is not None
                assert release_surplus is not None  # set whenever a request speculates
                release_surplus(req, done.reserved[i] - counts[i])
                req.spec.verify_ct += 1
                req.spec.drafted += drafted[i]
                req.spec.accepted += counts[i] - 1
        # NOTE: input logprobs go out with the request's first event, read before it appends
        wanted = req.logprobs.num if req.logprobs is not None else -1
        first = wanted >= 0 and req.num_outputs == 0
        if req.prefill_only:  # prefilled for its input logprobs or embedding; nothing sampled
            finish(req, {"type": "length", "length": 0})
            events.append(_event(req, None, None, None, first, embeddings.get(i)))
            continue
        for j, token in enumerate(row_tokens):
            req.host_ids.append(token)
            reason = finish_reason(req, token)
            if reason is not None:
                finish(req, reason)
            logprob, top = None, None
            if wanted >= 0 and row_logprobs is not None:
                logprob = row_logprobs[j]
                if wanted > 0 and row_tops is not None:
                    values, ids = row_tops[j]
                    # NOTE: tokens a grammar (or a -inf bias) masked are not alternatives: a
                    # row lists fewer than logprob_num when fewer are allowed
                    top = [(v, t) for v, t in zip(values[:wanted], ids[:wanted])
                           if v != NEG_INF]
            events.append(_event(req, token, logprob, top, first and j == 0))
            if req.is_finished:
                break
    return events


def _event(req: Req, token: int | None, logprob: float | None,
           top: list[tuple[float, int]] | None, first: bool,
           embedding: torch.Tensor | None = None) -> ReqEvent:
    scored = req.logprobs if first else None
    return ReqEvent(req.rid, token, req.finish_reason, req.cached_tokens, req.tier_tokens,
                    logprob, top,
                    None if scored is None else scored.input_logprobs,
                    None if scored is None else scored.input_top_logprobs,
                    spec=_spec_counts(req), embedding=embedding)


def _spec_counts(req: Req) -> tuple[int, int, int] | None:
    """(verify steps, drafted, accepted) of a speculating request, None otherwise."""
    spec = req.spec
    return None if spec is None else (spec.verify_ct, spec.drafted, spec.accepted)


def store_input_logprobs(done: ScheduledBatch, out: ForwardOutput) -> None:
    """Append each request's scored rows of this prefill to its LogprobState."""
    rows, scored = done.fwd.input_logprobs, out.input_logprobs
    assert rows is not None and scored is not None
    values = scored.values.tolist()
    top = scored.top
    top_values = top[0].tolist() if top is not None else None
    top_ids = top[1].tolist() if top is not None else None
    offset = 0
    for i, count in rows.spans:
        state = done.reqs[i].logprobs
        assert state is not None  # only requests asking for logprobs have scored rows
        state.input_logprobs += values[offset:offset + count]
        if state.num > 0 and top_values is not None and top_ids is not None:
            k = state.num
            state.input_top_logprobs += [list(zip(v[:k], t[:k])) for v, t in zip(
                top_values[offset:offset + count], top_ids[offset:offset + count])]
        else:
            state.input_top_logprobs += [[] for _ in range(count)]
        offset += count
