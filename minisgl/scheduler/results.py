"""A finished forward's results, request by request: the sampled token, whether it finishes
the request, and the logprobs asked for."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from minisgl.core import Req
from minisgl.engine import ForwardOutput
from minisgl.scheduler.batch_builder import ScheduledBatch

NEG_INF = float("-inf")


@dataclass
class ReqOutput:
    """One step's news for one request: a new token, a finish, or both."""

    req: Req
    token: int | None
    finished: bool
    logprob: float | None = None
    top_logprobs: list[tuple[float, int]] | None = None
    # with the first token, when input logprobs were asked for: Req.input_logprobs (and tops)
    input_logprobs: list[float] | None = None
    input_top_logprobs: list[list[tuple[float, int]]] | None = None


def finish_reason(req: Req, token: int) -> dict[str, Any] | None:
    """Why `token`, just appended to req.output_ids, ends the request (None: it goes on).
    NOTE: a stop token is checked before the length cap, as SGLang and vLLM do: an answer
    that ends exactly on its last allowed token is complete (`stop`), not cut (`length`)."""
    if token in req.stop_ids:
        return {"type": "stop", "matched": token}
    if req.matcher is not None:
        reason = grammar_finish(req, token)
        if reason is not None:
            return reason
    if len(req.output_ids) >= req.params.max_new_tokens:
        return {"type": "length", "length": len(req.output_ids)}
    return None


def grammar_finish(req: Req, token: int) -> dict[str, Any] | None:
    """The matcher takes the token; a grammar that has ended (its stop token) stops the
    request. A token the grammar refuses cannot come from a masked row: it is an error."""
    if not req.matcher.accept_token(token):
        return {"type": "abort", "message": f"token {token} does not follow the grammar"}
    if req.matcher.is_terminated():
        return {"type": "stop", "matched": token}
    return None


def collect_outputs(done: ScheduledBatch, out: ForwardOutput,
                    finish: Callable[[Req, dict[str, Any]], None]) -> list[ReqOutput]:
    """Append each row's token to its request and call `finish` for the requests it ends."""
    tokens = out.token_ids.tolist()
    logprobs = out.logprobs.tolist() if out.logprobs is not None else None
    tops = None
    if out.top_logprobs is not None:
        tops = list(zip(out.top_logprobs[0].tolist(), out.top_logprobs[1].tolist()))
    if out.input_logprobs is not None:
        store_input_logprobs(done, out)
    outputs: list[ReqOutput] = []
    for i, req in enumerate(done.reqs):
        if not done.last_chunk[i] or req.is_finished:
            continue  # NOTE: a request finished in an earlier batch gets no extra token
        if req.scores_only:  # prefilled for its input logprobs; the sample is unused
            finish(req, {"type": "length", "length": 0})
            output = ReqOutput(req, None, True)
        else:
            token = tokens[i]
            req.output_ids.append(token)
            reason = finish_reason(req, token)
            if reason is not None:
                finish(req, reason)
            output = ReqOutput(req, token, reason is not None)
        if req.logprob_num >= 0 and logprobs is not None and output.token is not None:
            output.logprob = logprobs[i]
            if req.logprob_num > 0 and tops is not None:
                values, ids = tops[i]
                # NOTE: tokens a grammar (or a -inf bias) masked are not alternatives: a row
                # lists fewer than logprob_num when fewer are allowed
                output.top_logprobs = [(v, t) for v, t in zip(values[: req.logprob_num],
                                                              ids[: req.logprob_num])
                                       if v != NEG_INF]
        if req.logprob_num >= 0 and not req.input_logprobs_sent:
            output.input_logprobs = req.input_logprobs
            output.input_top_logprobs = req.input_top_logprobs
            req.input_logprobs_sent = True
        outputs.append(output)
    return outputs


def store_input_logprobs(done: ScheduledBatch, out: ForwardOutput) -> None:
    """Append each request's scored rows of this prefill to Req.input_logprobs."""
    rows, scored = done.fwd.input_logprobs, out.input_logprobs
    assert rows is not None and scored is not None
    values = scored.values.tolist()
    top = scored.top
    top_values = top[0].tolist() if top is not None else None
    top_ids = top[1].tolist() if top is not None else None
    offset = 0
    for i, count in rows.spans:
        req = done.reqs[i]
        req.input_logprobs += values[offset:offset + count]
        if req.logprob_num > 0 and top_values is not None and top_ids is not None:
            k = req.logprob_num
            req.input_top_logprobs += [list(zip(v[:k], t[:k])) for v, t in zip(
                top_values[offset:offset + count], top_ids[offset:offset + count])]
        else:
            req.input_top_logprobs += [[] for _ in range(count)]
        offset += count
