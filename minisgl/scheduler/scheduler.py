"""The scheduler task: continuous batching with the overlap loop.

Each iteration schedules batch N+1 and launches it on the engine stream *before* awaiting
batch N's results; batch N+1 gathers its input ids from the token pool on the device, where
batch N writes its sampled ids, so the host never waits for them to launch the next step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from minisgl.core import Batch, Req, ReqStatus
from minisgl.engine import (Engine, EngineFailed, ForwardInput, ForwardOutput, HostInputs,
                            InputLogprobRows)
from minisgl.engine.stream import Completion
from minisgl.kvcache import NaiveCache, RadixCache
from minisgl.scheduler.cache import CacheManager, locations_for, pages_spanned
from minisgl.scheduler.decode import DecodeManager
from minisgl.scheduler.intake import RequestLimits, RequestSpec, check_batch
from minisgl.scheduler.prefill import PrefillChunk, PrefillManager
from minisgl.scheduler.table import TableManager
from minisgl.server_args import ServerArgs

logger = logging.getLogger(__name__)


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


@dataclass
class InFlight:
    fwd: ForwardInput
    completion: Completion

    @property
    def batch(self) -> Batch:
        return self.fwd.batch


@dataclass
class SchedulerStats:
    tokens_generated: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    batches: int = 0
    retractions: int = 0
    integrity_error: str | None = None


OutputSink = Callable[[list[ReqOutput]], None]


class Scheduler:
    def __init__(self, engine: Engine, args: ServerArgs, sink: OutputSink) -> None:
        self.engine, self.args, self.sink = engine, args, sink
        ps = engine.page_size
        prefix_cache = NaiveCache(ps) if args.disable_radix_cache else RadixCache(ps)
        self.cache = CacheManager(engine.kv_pool.num_pages, ps, prefix_cache)
        self.tp = engine.tp.size > 1
        self.table = TableManager(engine.max_running, engine.page_table, engine.token_pool,
                                  mirror=self.tp)
        self.decode = DecodeManager()
        self.prefill = PrefillManager(self.cache, self.table, self.decode, args.schedule_policy)
        self.context_len = engine.context_len
        self.eos_ids = frozenset(engine.eos_token_ids)
        self.limits = RequestLimits(
            vocab_size=engine.arch.vocab_size, context_len=self.context_len,
            pool_pages=self.cache.num_pages, page_size=ps,
            max_sequences=args.max_sequences_per_request, max_stop_strings=args.max_stop_strings,
            max_stop_string_length=args.max_stop_string_length,
            max_queued=args.max_queued_requests)
        self.reqs: dict[str, Req] = {}  # live requests by rid
        self.to_release: list[Req] = []  # finished, still holding a slot and pages
        self.stats = SchedulerStats()
        self._inbox: deque[tuple[str, Any]] = deque()
        self._uids = itertools.count()
        self._wake: asyncio.Event | None = None
        self._stopping = False
        self._in_flight: InFlight | None = None
        self._failure: asyncio.Future | None = None  # tp > 1: completes when a rank dies

    # ---- requests in -------------------------------------------------------------------------

    def add_requests(self, specs: list[RequestSpec],
                     rid_taken: Callable[[str], bool] | None = None) -> list[Req]:
        """Validate the whole batch (`intake.check_batch`), then queue every request; raises
        InvalidRequest or QueueFull with nothing queued. Loop thread only. `rid_taken` adds
        rids the caller still considers live."""
        def taken(rid: str) -> bool:
            return rid in self.reqs or (rid_taken is not None and rid_taken(rid))

        check_batch(specs, self.limits, taken, len(self.prefill.waiting) + self._pending_new())
        return [self._queue(spec) for spec in specs]

    def _queue(self, spec: RequestSpec) -> Req:
        params, prompt_len = spec.params, len(spec.input_ids)
        uid = next(self._uids)
        rid = spec.rid if spec.rid is not None else uuid.uuid4().hex
        start = spec.logprob_start_len
        req = Req(uid=uid, rid=rid, prompt_ids=list(spec.input_ids), params=params,
                  max_device_len=prompt_len + params.max_new_tokens,
                  stop_ids=frozenset(params.stop_token_ids or ()) | (
                      frozenset() if params.ignore_eos else self.eos_ids),
                  logprob_num=spec.logprob_num,
                  logprob_start_len=-1 if spec.logprob_num < 0 else
                  (prompt_len - 1 if start < 0 else start))
        if params.sampling_seed is not None:
            req.generator = torch.Generator(self.engine.device).manual_seed(
                params.sampling_seed % 2**64)
        self.reqs[rid] = req
        self._post("new", req)
        return req

    def abort(self, rid: str, message: str = "aborted") -> None:
        self._post("finish", (rid, {"type": "abort", "message": message}))

    def abort_all(self, message: str = "aborted") -> None:
        for rid in list(self.reqs):
            self.abort(rid, message)

    def finish(self, rid: str, reason: dict[str, Any]) -> None:
        """Finish a request for a reason decided outside (e.g. a matched stop string)."""
        self._post("finish", (rid, reason))

    def _post(self, kind: str, payload: Any) -> None:
        self._inbox.append((kind, payload))
        if self._wake is not None:
            self._wake.set()

    def _pending_new(self) -> int:
        return sum(1 for kind, _ in self._inbox if kind == "new")

    def _drain_inbox(self) -> None:
        outputs: list[ReqOutput] = []
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "new":
                req: Req = payload
                if req.is_finished:
                    continue  # aborted before it was ever queued
                if req.params.max_new_tokens == 0 and not req.scores_only:
                    self._finish(req, {"type": "length", "length": 0})
                    outputs.append(ReqOutput(req, None, True))
                    continue
                self.stats.prompt_tokens += len(req.prompt_ids)
                self.prefill.add(req)
            else:
                rid, reason = payload
                req = self.reqs.get(rid)
                if req is not None and not req.is_finished:
                    self._finish(req, reason)
                    outputs.append(ReqOutput(req, None, True))
        if outputs:
            self._release_finished(self._in_flight)
            self.sink(outputs)

    # ---- the loop ----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._inbox) or self.prefill.runnable or len(self.decode) > 0

    async def run(self) -> None:
        self._wake = asyncio.Event()
        self._stopping = False
        last: InFlight | None = None
        overlap = not self.args.disable_overlap_schedule
        on_failure = self._watch_engine() if self.tp else None
        try:
            while not self._stopping or last is not None:
                if self._failure is not None and self._failure.done():
                    raise EngineFailed(self._failure.result())
                if last is None and not self.has_work():
                    self._on_idle()
                    self._wake.clear()
                    if not self.has_work() and not self._stopping:
                        await self._wake.wait()
                    continue
                self._drain_inbox()
                fwd, last = await self._schedule(last)
                ongoing = self._launch(fwd) if fwd is not None else None
                if last is not None:
                    self._process(last, await self._result(last), ongoing)
                last = ongoing
                if not overlap and last is not None:
                    self._process(last, await self._result(last), None)
                    last = None
                await asyncio.sleep(0)  # let handlers run between steps, even when saturated
        except EngineFailed as exc:
            last = None  # NOTE: never wait for a forward that may sit in a broken collective
            self._fail_all(str(exc))
            raise
        finally:
            self._in_flight = None
            if on_failure is not None:
                self.engine.remove_failure_listener(on_failure)
            if last is not None:
                last.completion.result()

    def stop(self) -> None:
        """End the loop: every live request is aborted."""
        self.abort_all("the server is shutting down")
        self._stopping = True
        if self._wake is not None:
            self._wake.set()

    def _launch(self, fwd: ForwardInput) -> InFlight:
        self.stats.batches += 1
        flight = InFlight(fwd, self.engine.launch(fwd))
        self._in_flight = flight
        return flight

    async def _result(self, flight: InFlight) -> ForwardOutput:
        if self._failure is None:
            return await flight.completion.wait()
        return await flight.completion.wait_unless(self._failure)

    async def _drain(self, last: InFlight) -> None:
        self._process(last, await self._result(last), None)

    # ---- tensor-parallel failure -------------------------------------------------------------

    def _watch_engine(self) -> Callable[[str], None]:
        """Complete `_failure` (and wake the loop) when a tensor-parallel rank dies."""
        loop = asyncio.get_running_loop()
        failure = self._failure = loop.create_future()
        wake = self._wake

        def settle(message: str) -> None:
            if not failure.done():
                failure.set_result(message)
            if wake is not None:
                wake.set()

        def on_failure(message: str) -> None:  # monitor thread
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle, message)

        self.engine.add_failure_listener(on_failure)
        return on_failure

    def _fail_all(self, message: str) -> None:
        """The engine is gone: end every live request with an abort. Slots and pages are left
        as they are; nothing can run on this engine any more."""
        reason = {"type": "abort", "message": message}
        outputs = []
        for req in list(self.reqs.values()):
            req.status, req.finish_reason = ReqStatus.FINISHED, reason
            outputs.append(ReqOutput(req, None, True))
        self.reqs.clear()
        self._inbox.clear()
        if outputs:
            self.sink(outputs)

    # ---- scheduling --------------------------------------------------------------------------

    async def _schedule(self, last: InFlight | None) -> tuple[ForwardInput | None, InFlight | None]:
        if self.prefill.runnable:
            chunks = self.prefill.schedule(self.args.chunked_prefill_size)
            if chunks:
                return self._prefill_input(chunks), last
        while True:
            reqs = self.decode.schedule()
            if not reqs:
                return None, last
            spans = [(r.cached_len, 1, r.tail_loc) for r in reqs]
            need = sum(pages_spanned(s, 1, self.cache.page_size) for s, _, _ in spans)
            pages = self.cache.allocate(need)
            if pages is not None:
                self.prefill.ratio.step()
                return self._decode_input(reqs, locations_for(spans, pages, self.cache.page_size)), last
            # Out of pages even after eviction: settle the batch in flight, then retract.
            if last is not None:
                await self._drain(last)
                last = None
                continue
            self._retract_one()

    def _retract_one(self) -> None:
        """Send the newest admitted request back to the waiting queue, keeping its tokens; its
        KV goes to the prefix cache so the re-prefill can reuse what is not evicted meanwhile."""
        candidates = list(self.decode.running)
        if self.prefill.chunked is not None:
            candidates.append(self.prefill.chunked)
        victim = max(candidates, key=lambda r: r.admitted_at)
        if len(candidates) == 1 and self.cache.available_pages == 0:
            logger.warning("request %s cannot make progress; retracting it", victim.rid)
        self.decode.remove(victim)
        if self.prefill.chunked is victim:
            self.prefill.chunked = None
        self._release(victim)
        victim.cached_len = victim.device_len = victim.prefix_len = 0
        if not victim.input_logprobs_sent:  # its prefill starts over, and scores again
            victim.input_logprobs.clear()
            victim.input_top_logprobs.clear()
        self.prefill.add(victim, front=True)
        self.prefill.ratio.after_retraction()
        self.stats.retractions += 1

    def _prefill_input(self, chunks: list[PrefillChunk]) -> ForwardInput:
        for chunk in chunks:
            if chunk.start == chunk.req.prefix_len:  # the first chunk of an admission
                chunk.req.cached_tokens = chunk.req.cached_tokens or chunk.start
                self.stats.cached_prompt_tokens += chunk.start
        return self._build(
            "prefill", [c.req for c in chunks], [c.start for c in chunks],
            [c.count for c in chunks], [c.is_last for c in chunks],
            torch.cat([c.locations for c in chunks]))

    def _decode_input(self, reqs: list[Req], locations: torch.Tensor) -> ForwardInput:
        return self._build("decode", reqs, [r.cached_len for r in reqs], [1] * len(reqs),
                           [True] * len(reqs), locations)

    def _build(self, phase: str, reqs: list[Req], starts: list[int], counts: list[int],
               last_chunk: list[bool], locations: torch.Tensor) -> ForwardInput:
        ctx = self.table.context_len
        device = self.engine.device
        rows = [r.table_idx for r in reqs]
        ends = [s + c for s, c in zip(starts, counts)]
        counts_t = torch.tensor(counts)
        if phase == "decode":
            positions = torch.tensor(starts)
            load = torch.tensor(rows) * ctx + positions
        else:
            begin = torch.repeat_interleave(torch.tensor(starts) - (counts_t.cumsum(0) - counts_t),
                                            counts_t)
            positions = torch.arange(len(locations)) + begin
            load = torch.repeat_interleave(torch.tensor(rows), counts_t) * ctx + positions
        self.table.write_locations(load, locations)
        dummy_write = self.table.dummy_row * ctx
        write = torch.tensor([r * ctx + e if last and not req.scores_only else dummy_write
                              for req, r, e, last in zip(reqs, rows, ends, last_chunk)])
        batch = Batch(reqs=reqs, phase=phase, padded_reqs=reqs, last_chunk=last_chunk,
                      input_positions=positions.to(device, non_blocking=True),
                      out_loc=locations.to(device, non_blocking=True),
                      seq_lens=ends, extend_lens=counts, cached_lens=starts, table_rows=rows)
        if self.engine.graph_runner is not None:  # NOTE: decode only; dummy rows, dummy page
            self.engine.graph_runner.pad_batch(batch)
        self.engine.attn_backend.prepare_metadata(batch)
        sample_args = self.engine.sampler.prepare(
            reqs, prompt_lens=[len(r.prompt_ids) for r in reqs],
            output_counts=[e - len(r.prompt_ids) for r, e in zip(reqs, ends)],
            table_rows=rows, seq_lens=ends, logprob_nums=[r.logprob_num for r in reqs])
        rows_host, scored = None, None  # prefill: each last token, then any scored rows
        if phase == "prefill":
            rows_host = counts_t.cumsum(0) - 1
            scored_rows = self._scored_rows(reqs, starts, counts)
            if scored_rows is not None:
                extra, scored = scored_rows
                rows_host = torch.cat([rows_host, extra])
        logit_rows = None if rows_host is None else rows_host.to(device, non_blocking=True)
        tails = locations[counts_t.cumsum(0) - 1].tolist() if self.cache.page_size > 1 else None
        for i, req in enumerate(reqs):
            req.cached_len = ends[i]
            if tails is not None:
                req.tail_loc = tails[i]
            if last_chunk[i] and not req.scores_only:
                req.device_len = ends[i] + 1
                if phase == "prefill":
                    self.decode.add(req)
        host = None
        if self.tp:  # what ranks 1..N-1 need: host copies and the table writes since last step
            host = HostInputs(positions, locations, load, write, rows_host,
                              *self.table.take_log())
        return ForwardInput(batch=batch, load_indices=load.to(device, non_blocking=True),
                            write_indices=write.to(device, non_blocking=True),
                            logit_rows=logit_rows, sample_args=sample_args, host=host,
                            input_logprobs=scored)

    def _scored_rows(self, reqs: list[Req], starts: list[int], counts: list[int]
                     ) -> tuple[torch.Tensor, InputLogprobRows] | None:
        """Token rows of this prefill whose logits score a prompt token (input logprobs), and
        what the engine needs to score them; None if there are none."""
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[int, int]] = []
        offset = 0
        for i, (req, start, count) in enumerate(zip(reqs, starts, counts)):
            wanted = req.input_logprob_positions
            first, end = max(start, wanted.start), min(start + count, wanted.stop)
            if first < end:
                rows += range(offset + first - start, offset + end - start)
                targets += req.prompt_ids[first + 1:end + 1]
                spans.append((i, end - first))
            offset += count
        if not spans:
            return None
        targets_t = torch.tensor(targets, dtype=torch.int64).to(self.engine.device,
                                                               non_blocking=True)
        top_k = min(max(reqs[i].logprob_num for i, _ in spans), self.engine.arch.vocab_size)
        return torch.tensor(rows), InputLogprobRows(targets_t, top_k, spans)

    # ---- results -----------------------------------------------------------------------------

    def _process(self, done: InFlight, out: ForwardOutput, ongoing: InFlight | None) -> None:
        self._in_flight = ongoing
        batch = done.batch
        tokens = out.next_tokens.tolist()
        logprobs = out.sample.logprobs.tolist() if out.sample.logprobs is not None else None
        tops = None
        if out.sample.top_logprobs is not None:
            tops = list(zip(out.sample.top_logprobs[0].tolist(),
                            out.sample.top_logprobs[1].tolist()))
        if out.input_logprobs is not None:
            self._store_input_logprobs(done.fwd, out)
        outputs: list[ReqOutput] = []
        for i, req in enumerate(batch.reqs):
            if not batch.last_chunk[i] or req.is_finished:
                continue  # NOTE: a request finished in an earlier batch gets no extra token
            if req.scores_only:  # prefilled for its input logprobs; the sample is unused
                self._finish(req, {"type": "length", "length": 0})
                output = ReqOutput(req, None, True)
            else:
                token = tokens[i]
                req.output_ids.append(token)
                reason = self._finish_reason(req, token)
                if reason is not None:
                    self._finish(req, reason)
                output = ReqOutput(req, token, reason is not None)
                self.stats.tokens_generated += 1
            if req.logprob_num >= 0 and logprobs is not None and output.token is not None:
                output.logprob = logprobs[i]
                if req.logprob_num > 0 and tops is not None:
                    values, ids = tops[i]
                    output.top_logprobs = list(zip(values[: req.logprob_num],
                                                   ids[: req.logprob_num]))
            if req.logprob_num >= 0 and not req.input_logprobs_sent:
                output.input_logprobs = req.input_logprobs
                output.input_top_logprobs = req.input_top_logprobs
                req.input_logprobs_sent = True
            outputs.append(output)
        self._release_finished(ongoing)
        if outputs:
            self.sink(outputs)

    @staticmethod
    def _store_input_logprobs(fwd: ForwardInput, out: ForwardOutput) -> None:
        """Append each request's scored rows of this prefill to Req.input_logprobs."""
        assert fwd.input_logprobs is not None and out.input_logprobs is not None
        values = out.input_logprobs.values.tolist()
        top = out.input_logprobs.top
        top_values = top[0].tolist() if top is not None else None
        top_ids = top[1].tolist() if top is not None else None
        offset = 0
        for i, count in fwd.input_logprobs.spans:
            req = fwd.batch.reqs[i]
            req.input_logprobs += values[offset:offset + count]
            if req.logprob_num > 0 and top_values is not None and top_ids is not None:
                k = req.logprob_num
                req.input_top_logprobs += [list(zip(v[:k], t[:k])) for v, t in zip(
                    top_values[offset:offset + count], top_ids[offset:offset + count])]
            else:
                req.input_top_logprobs += [[] for _ in range(count)]
            offset += count

    @staticmethod
    def _finish_reason(req: Req, token: int) -> dict[str, Any] | None:
        if len(req.output_ids) >= req.params.max_new_tokens:
            return {"type": "length", "length": len(req.output_ids)}
        if token in req.stop_ids:
            return {"type": "stop", "matched": token}
        return None

    def _finish(self, req: Req, reason: dict[str, Any]) -> None:
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
        self.reqs.pop(req.rid, None)
        self.decode.remove(req)
        if self.prefill.remove(req) or req.table_idx < 0:
            return  # never admitted: holds nothing
        self.to_release.append(req)  # released by the caller, once per step

    def _release_finished(self, ongoing: InFlight | None) -> None:
        busy = set(ongoing.batch.reqs) if ongoing is not None else set()
        keep = []
        for req in self.to_release:
            if req in busy:
                keep.append(req)  # NOTE: freed once the batch that still uses it is processed
            else:
                self._release(req)
        self.to_release = keep

    def _release(self, req: Req) -> None:
        locations = self.table.locations(req.table_idx, req.cached_len)
        self.cache.release(req.host_ids, locations, req.prefix_len, req.cache_handle)
        self.table.free(req.table_idx)
        req.table_idx, req.cache_handle = -1, None

    # ---- bookkeeping -------------------------------------------------------------------------

    def _on_idle(self) -> None:
        if self.to_release:
            self._release_finished(None)
        try:
            self.check_integrity()
        except AssertionError as exc:
            self.stats.integrity_error = str(exc)
            logger.error("KV integrity check failed: %s", exc)

    def check_integrity(self) -> None:
        """Every page is exactly one of: free, owned by a live request, held by the prefix cache;
        every slot is free or owned. Call only when no batch is in flight."""
        ps = self.cache.page_size
        free = self.cache.free_page_ids()
        cached = self.cache.prefix_cache.all_locations()
        owned = []
        admitted = [r for r in self.reqs.values() if r.table_idx >= 0] + self.to_release
        for req in admitted:
            own = self.table.locations(req.table_idx, req.cached_len)[req.prefix_len:]
            owned.append(own[::ps] // ps)
        parts = [free, cached[::ps] // ps if len(cached) else cached, *owned]
        pages = np.concatenate([np.asarray(p) for p in parts])  # NOTE: numpy, see CacheManager
        assert len(pages) == self.cache.num_pages, (
            f"{len(pages)} pages accounted for (free {len(free)}, cached {len(cached) // ps}, "
            f"owned {sum(len(o) for o in owned)}), the pool has {self.cache.num_pages}")
        assert len(np.unique(pages)) == len(pages), "a page is counted twice"
        rows = self.table.free_rows() + [r.table_idx for r in admitted]
        assert sorted(rows) == list(range(self.table.max_running)), "slots leaked or shared"
        if not self.reqs and not self.to_release:
            assert self.cache.prefix_cache.protected_size == 0, "cache locked with no request"

    def state(self) -> dict[str, Any]:
        ps = self.cache.page_size
        pool_tokens = self.cache.num_pages * ps
        used = self.cache.used_pages * ps
        return {
            "num_running_reqs": len(self.decode) + (self.prefill.chunked is not None),
            "num_waiting_reqs": len(self.prefill.waiting) + self._pending_new(),
            "kv_pool_tokens": pool_tokens,
            "kv_used_tokens": used,
            "kv_cached_tokens": self.cache.prefix_cache.size,
            "kv_usage": used / pool_tokens,
            "free_pages": self.cache.num_free,
            "prompt_tokens": self.stats.prompt_tokens,
            "cached_prompt_tokens": self.stats.cached_prompt_tokens,
            "cache_hit_rate": self.stats.cached_prompt_tokens / max(self.stats.prompt_tokens, 1),
            "generated_tokens": self.stats.tokens_generated,
            "batches": self.stats.batches,
            "retractions": self.stats.retractions,
            "new_token_ratio": self.prefill.ratio.value,
            "engine_busy_seconds": self.engine.busy_seconds,
            **{f"engine_{phase}_seconds": seconds
               for phase, seconds in self.engine.phase_seconds.items()},
            **{f"engine_{phase}_steps": steps for phase, steps in self.engine.phase_steps.items()},
            "integrity_error": self.stats.integrity_error,
        }
