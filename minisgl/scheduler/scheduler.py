"""The scheduler task: continuous batching with the overlap loop.

Each iteration schedules batch N+1 and launches it on the engine stream *before* awaiting
batch N's results; batch N+1 gathers its input ids from the token pool on the device, where
batch N writes its sampled ids, so the host never waits for them to launch the next step.

Choosing the next batch (`BatchSelector`): a prefill when one can be admitted (with the running
decodes in the same forward under --enable-mixed-chunk), else one decode step for every running
request. When a request must give its pages or slot back first (the pool is out of pages, or a
more urgent request waits), the batch in flight may still use them: the selector then asks the
loop to settle it before it retracts anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from minisgl.core import LogprobState, Req
from minisgl.engine import Engine, ForwardOutput
from minisgl.errors import EngineFailed, IntegrityError, InvalidRequest
from minisgl.kvcache import NaiveCache, PrefixCache, RadixCache, StateRadixCache
from minisgl.scheduler.batch_builder import BatchBuilder, ScheduledBatch, decodes_in_runs
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.hicache import TierCache
from minisgl.scheduler.intake import RequestLimits, RequestSpec, check_batch, fill_max_new_tokens
from minisgl.scheduler.lora import Adapter, AdapterTable, load_adapter, unload_adapter
from minisgl.scheduler.memory import (CacheManager, TableManager, check_kv_integrity, locations_for,
                                      pages_spanned)
from minisgl.scheduler.prefill import DecodeManager, PrefillChunk, PrefillManager, WaitingOrder
from minisgl.scheduler.results import Queued, ReqEvent, collect_events, finished_event
from minisgl.scheduler.snapshots import StateSnapshots
from minisgl.scheduler.speculation import HostSpeculation
from minisgl.scheduler.stats import SchedulerStats, report


logger = logging.getLogger(__name__)
# The idle check reads every page id: bigger pools (a small model, a large GPU) on demand only
IDLE_CHECK_MAX_PAGES = 1 << 22
# --num-continuous-decode-steps' default while one request runs, on an engine that takes runs
AUTO_DECODE_STEPS = 4


def prefix_cache_of(engine: Engine, disabled: bool) -> PrefixCache:
    """The radix cache; for a hybrid model one whose prefixes carry state snapshots, or none
    where the engine keeps no snapshots (a hybrid resumes only from a state)."""
    page_size = engine.page_size
    if disabled:
        return NaiveCache(page_size)
    if engine.states is None:
        return RadixCache(page_size)
    if not engine.states.snapshots:
        logger.info("prefix cache off: --max-mamba-cache-size leaves no state snapshots")
        return NaiveCache(page_size)
    return StateRadixCache(page_size, engine.states.rows, engine.states.snapshots)


class Scheduler:
    def __init__(self, engine: Engine, config: SchedulerConfig) -> None:
        if config.chunked_prefill_size is None:
            config = replace(config, chunked_prefill_size=engine.default_chunked_prefill_size(
                config.enable_mixed_chunk))
        self.engine, self.config = engine, config
        self._outbox: asyncio.Queue[list[ReqEvent]] | None = None
        ps = engine.page_size
        self.tiers = (None if engine.page_store is None else TierCache(
            engine.page_store, engine.kv_fingerprint, ps,
            write_back=config.hicache_write_policy == "write_back"))
        self.cache = CacheManager(engine.kv_pool.num_pages, ps,
                                  prefix_cache_of(engine, config.disable_radix_cache), self.tiers)
        self.stats = SchedulerStats()
        self.table = TableManager(engine.max_running, engine.dummy_row, engine.page_table,
                                  engine.token_pool, mirror=engine.tp.size > 1)
        self.snapshots = (StateSnapshots(self.cache, self.table)
                          if isinstance(self.cache.prefix_cache, StateRadixCache) else None)
        self.decode = DecodeManager()
        self.order = WaitingOrder(config.schedule_policy, config.enable_priority_scheduling,
                                  config.schedule_low_priority_values_first,
                                  config.priority_scheduling_preemption_threshold, config.seed)
        self.adapters = AdapterTable(engine.config.max_loras_per_batch if engine.lora else 0,
                                     engine.config.max_loaded_loras)
        self.prefill = PrefillManager(self.cache, self.table, self.decode, self.order,
                                      self.adapters, engine.arch.long_rope,
                                      self.snapshots and self.snapshots.released,
                                      config.schedule_conservativeness)
        self.builder = BatchBuilder(engine, self.table, ps, self.adapters)
        self.speculation = None if engine.speculation is None else HostSpeculation(
            engine.speculation, grammar_drafts=engine.runs_steps_in_order,
            governed=not config.speculative_always_draft, cache=self.cache, table=self.table,
            stats=self.stats)
        # runs of decode steps: on the CPU engine thread, one rank, no verify steps to lay out
        runs = engine.runs_steps_in_order and engine.tp.size == 1 and self.speculation is None
        self.selector = BatchSelector(config, self.prefill, self.decode, self.cache, self.builder,
                                      self.stats, self.speculation, self.snapshots, runs)
        self.context_len = engine.context_len
        self.eos_ids = frozenset(engine.eos_token_ids)
        self.limits = RequestLimits(
            vocab_size=engine.arch.vocab_size, context_len=self.context_len,
            pool_pages=self.cache.num_pages, page_size=ps,
            max_sequences=config.max_sequences_per_request,
            max_stop_strings=config.max_stop_strings,
            max_stop_string_length=config.max_stop_string_length,
            max_queued=config.max_queued_requests)
        self.reqs: dict[str, Req] = {}  # live requests by rid
        self.to_release: list[Req] = []  # finished, still holding a slot and pages
        self._inbox: deque[tuple[str, Any]] = deque()
        self._uids = itertools.count()
        self._wake: asyncio.Event | None = None  # made by run(), on its loop
        self._stopping = False
        self._in_flight: ScheduledBatch | None = None  # launched, its results not processed

    # ---- requests in -------------------------------------------------------------------------

    def add_requests(self, specs: list[RequestSpec],
                     rid_taken: Callable[[str], bool] | None = None) -> list[Queued]:
        """Validate the whole batch (`intake.check_batch`), then queue every request; raises
        InvalidRequest or QueueFull with nothing queued. Loop thread only. `rid_taken` adds
        rids the caller still considers live."""
        def taken(rid: str) -> bool:
            return rid in self.reqs or (rid_taken is not None and rid_taken(rid))

        specs = [fill_max_new_tokens(spec, self.limits) for spec in specs]
        if self.speculation is not None and any(spec.images for spec in specs):
            raise InvalidRequest("image inputs are not served with speculative decoding "
                                 "(--speculative-algorithm)")
        adapters = [self.adapters.uid_of(spec.lora) if spec.lora else 0 for spec in specs]
        waiting = len(self.prefill.waiting) + self._pending_new()
        displaced = self._displaceable(specs, waiting)
        check_batch(specs, self.limits, taken, waiting - len(displaced))
        for req in displaced:  # NOTE: only once the whole batch is known to be accepted
            self._post("finish", (req.rid, {"type": "abort", "message": "displaced from the "
                                  "full waiting queue by a more urgent request"}))
        return [self._queue(spec, uid) for spec, uid in zip(specs, adapters)]

    def _displaceable(self, specs: list[RequestSpec], waiting: int) -> list[Req]:
        """With priority scheduling and the waiting queue full: the waiting requests the
        batch's more urgent requests push out (none if it cannot make room for all)."""
        limit = self.limits.max_queued
        if limit is None or waiting + len(specs) <= limit:
            return []
        queued = [*self.prefill.waiting, *(p for kind, p in self._inbox if kind == "new")]
        return self.order.displaced([spec.priority or 0 for spec in specs],
                                    [r for r in queued if not r.is_finished],
                                    waiting + len(specs) - limit) or []

    def _queue(self, spec: RequestSpec, lora_uid: int) -> Queued:
        params, prompt_len = spec.params, len(spec.input_ids)
        rid = spec.rid if spec.rid is not None else uuid.uuid4().hex
        start = spec.logprob_start_len
        req = Req(uid=next(self._uids), rid=rid, prompt_ids=spec.input_ids, params=params,
                  stop_ids=frozenset(params.stop_token_ids or ()) | (
                      frozenset() if params.ignore_eos else self.eos_ids))
        req.priority, req.lora_uid, req.embed = spec.priority or 0, lora_uid, spec.embed
        req.matcher, req.images = spec.matcher, spec.images
        if spec.logprob_num >= 0:
            req.logprobs = LogprobState(spec.logprob_num, prompt_len - 1 if start < 0 else start)
        if params.sampling_seed is not None:
            req.generator = torch.Generator(self.engine.device).manual_seed(
                params.sampling_seed % 2**64)
        if self.speculation is not None:
            self.speculation.admit(req)
        self.reqs[rid] = req
        self._post("new", req)
        return Queued(rid, params)

    # ---- LoRA adapters (scheduler.lora) -------------------------------------------------------

    async def load_adapter(self, name: str, path: str, pinned: bool = False) -> Adapter:
        return await load_adapter(self.adapters, self.engine.lora, name, path, pinned)

    async def unload_adapter(self, name: str) -> Adapter:
        return await unload_adapter(self.adapters, self.engine.lora, name, lambda uid: any(
            r.lora_uid == uid for r in (*self.reqs.values(), *self.to_release)))

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
        self._wake_up()

    def _wake_up(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def _pending_new(self) -> int:
        return sum(1 for kind, _ in self._inbox if kind == "new")

    def _take_inbox(self) -> None:
        events: list[ReqEvent] = []
        while self._inbox:
            kind, payload = self._inbox.popleft()
            if kind == "new":
                req: Req = payload
                if req.is_finished:
                    continue  # aborted before it was ever queued
                if req.params.max_new_tokens == 0 and not req.prefill_only:
                    self._finish(req, {"type": "length", "length": 0})
                    events.append(finished_event(req))
                    continue
                self.stats.prompt_tokens += req.prompt_len
                self.prefill.add(req)
            else:
                rid, reason = payload
                req = self.reqs.get(rid)
                if req is not None and not req.is_finished:
                    self._finish(req, reason)
                    events.append(finished_event(req))
        if events:
            self._release_finished(self._in_flight)
            self._emit(events)

    def open_outbox(self) -> asyncio.Queue[list[ReqEvent]]:
        """A fresh queue of this scheduler's events (one list per step with news), for the
        event loop about to run it: the runtime reads its answers from here."""
        self._outbox = asyncio.Queue()
        return self._outbox

    def _emit(self, events: list[ReqEvent]) -> None:
        assert self._outbox is not None, "open_outbox before the scheduler runs"
        self._outbox.put_nowait(events)

    # ---- the loop ----------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._inbox) or self.prefill.runnable or len(self.decode) > 0

    async def run(self) -> None:
        self._wake = asyncio.Event()
        if self.tiers is not None:
            loop = asyncio.get_running_loop()
            self.tiers.wake = lambda: loop.call_soon_threadsafe(self._wake_up)
        self._stopping = False
        failure = self.engine.failure() if self.engine.tp.size > 1 else None
        if failure is not None:
            failure.add_done_callback(lambda _: self._wake_up())  # end an idle wait
        ongoing: ScheduledBatch | None = None  # launched this step, before _in_flight is done
        failed = False
        try:
            while not self._stopping or self._in_flight is not None:
                if failure is not None and failure.done():
                    raise EngineFailed(failure.result())
                if self._in_flight is None and not self.has_work():
                    await self._sleep_until_work()
                    continue
                self._take_inbox()
                batch = await self._schedule()
                if batch is not None and batch.fwd.grammar is not None:
                    await self._ready_masks(batch)
                if (batch is not None and batch.fwd.verify is not None
                        and not self.engine.runs_steps_in_order):
                    await self._settle()  # NOTE: the one sync of speculation (on CUDA)
                ongoing = self._launch(batch) if batch is not None else None
                if self._in_flight is not None:
                    done = self._in_flight
                    self._process(done, await self._result(done), ongoing)
                    if ongoing is not None:
                        ongoing.fill_masks()  # its grammar rows' previous tokens are in
                self._in_flight, ongoing = ongoing, None
                if self.config.disable_overlap_schedule:
                    await self._settle()
                await asyncio.sleep(0)  # let handlers run between steps, even when saturated
        except EngineFailed as exc:
            failed = True
            self._fail_all(str(exc))
            raise
        finally:
            last, self._in_flight = self._in_flight, None
            self._release_masks(last, ongoing)  # NOTE: an engine thread may wait on a mask
            # NOTE: never wait for a forward that may sit in a broken collective
            if last is not None and last.completion is not None and not failed:
                with contextlib.suppress(Exception):  # the forward ends before we return
                    last.completion.result()

    @staticmethod
    def _release_masks(*batches: ScheduledBatch | None) -> None:
        """Unblock an engine thread that waits on a grammar mask which will never be filled."""
        for batch in batches:
            if batch is not None and batch.fwd.grammar is not None:
                batch.fwd.grammar.release(EngineFailed("the scheduler stopped"))

    def stop(self) -> None:
        """End the loop: every live request is aborted."""
        self.abort_all("the server is shutting down")
        self._stopping = True
        self._wake_up()

    async def _sleep_until_work(self) -> None:
        self._on_idle()
        assert self._wake is not None
        self._wake.clear()
        if not self.has_work() and not self._stopping:
            await self._wake.wait()

    async def _ready_masks(self, batch: ScheduledBatch) -> None:
        """Fill the grammar masks of `batch` now if its matchers are up to date (nothing in
        flight). Else, where a launched step cannot wait for its mask (CUDA), settle the batch
        in flight first; on the CPU engine thread the mask is filled after launching, once
        the batch in flight is processed (GrammarMask)."""
        if not self.engine.runs_steps_in_order:
            await self._settle()
        if self._in_flight is None:
            batch.fill_masks()

    def _launch(self, batch: ScheduledBatch) -> ScheduledBatch:
        self.stats.batches += 1
        if self.tiers is not None:
            batch.fwd.kv_moves = self.tiers.take_moves()
        batch.completion = self.engine.launch(batch.fwd)
        return batch

    async def _result(self, batch: ScheduledBatch) -> ForwardOutput:
        assert batch.completion is not None
        if self.engine.tp.size == 1:
            return await batch.completion.wait()
        return await batch.completion.wait_unless(self.engine.failure())

    async def _settle(self) -> None:
        """Process the batch in flight (if any) before anything else is launched."""
        done = self._in_flight
        if done is not None:
            self._process(done, await self._result(done), None)
            self._in_flight = None

    def _fail_all(self, message: str) -> None:
        """The engine is gone: end every live request with an abort. Slots and pages are left
        as they are; nothing can run on this engine any more."""
        reason = {"type": "abort", "message": message}
        events = []
        for req in list(self.reqs.values()):
            req.finish_reason = reason
            events.append(finished_event(req))
        self.reqs.clear()
        self._inbox.clear()
        if events:
            self._emit(events)

    # ---- scheduling --------------------------------------------------------------------------

    async def _schedule(self) -> ScheduledBatch | None:
        """The next batch (BatchSelector), or None; the batch in flight is settled first when
        a request must give its pages or slot back."""
        while True:
            flight = self._in_flight
            selection = self.selector.next_batch(
                in_flight=flight is not None,
                verify_in_flight=flight is not None and flight.fwd.verify is not None)
            if not selection.settle_first:
                return selection.batch
            await self._settle()

    # ---- results -----------------------------------------------------------------------------

    def _process(self, done: ScheduledBatch, out: ForwardOutput,
                 ongoing: ScheduledBatch | None) -> None:
        """`done`'s results; `ongoing`: the batch launched after it, still in flight."""
        spec = self.speculation
        events = collect_events(done, out, self._finish,
                                None if spec is None else spec.release_surplus)
        self.stats.tokens_generated += sum(e.token is not None for e in events)
        if spec is not None:
            spec.after_step(done, out)
        self._release_finished(ongoing)
        if events:
            self._emit(events)

    def _finish(self, req: Req, reason: dict[str, Any]) -> None:
        req.finish_reason = reason
        self.reqs.pop(req.rid, None)
        self.decode.remove(req)
        if self.prefill.drop(req) or req.table_idx < 0:
            return  # never admitted: holds nothing
        self.to_release.append(req)  # released by the caller, once per step

    def _release_finished(self, ongoing: ScheduledBatch | None) -> None:
        busy = set(ongoing.reqs) if ongoing is not None else set()
        keep = []
        for req in self.to_release:
            if req in busy:
                keep.append(req)  # NOTE: freed once the batch that still uses it is processed
            else:
                self.prefill.release(req)
        self.to_release = keep

    # ---- bookkeeping -------------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """No request is live, none is still releasing its pages, and nothing is queued."""
        return not (self.reqs or self.to_release or self.has_work())

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests are live."""
        if not self.idle:
            return False
        self.cache.reset_cache()
        return True

    def _on_idle(self) -> None:
        if self.to_release:
            self._release_finished(None)
        if self.tiers is not None:  # NOTE: pages due to the lower tiers go now, not next step
            moves = self.tiers.take_moves()
            if moves is not None:
                self.engine.move_pages(moves)
        if self.cache.num_pages > IDLE_CHECK_MAX_PAGES:
            return
        try:
            self.check_integrity()
        except IntegrityError as exc:
            self.stats.integrity_error = str(exc)
            logger.error("KV integrity check failed: %s", exc)

    def check_integrity(self) -> None:
        """Raises IntegrityError unless every page and slot is accounted for exactly once.
        Call only when no batch is in flight."""
        admitted = [r for r in self.reqs.values() if r.table_idx >= 0] + self.to_release
        check_kv_integrity(self.cache, self.table, admitted, live=bool(self.reqs))
        if self.snapshots is not None:
            self.snapshots.check(live=bool(admitted))

    def state(self) -> dict[str, Any]:
        return report(self.stats, self.cache, self.prefill, self.decode, self.engine,
                      self._pending_new())


@dataclass(frozen=True)
class Selection:
    """`next_batch`'s answer: the batch to launch (None: nothing to run), or `settle_first`:
    process the batch in flight, then ask again."""

    batch: ScheduledBatch | None = None
    settle_first: bool = False


IDLE = Selection()
SETTLE = Selection(settle_first=True)


class BatchSelector:
    def __init__(self, config: SchedulerConfig, prefill: PrefillManager, decode: DecodeManager,
                 cache: CacheManager, builder: BatchBuilder, stats: SchedulerStats,
                 speculation: HostSpeculation | None = None,
                 snapshots: StateSnapshots | None = None, runs_decode_steps: bool = False
                 ) -> None:
        """`runs_decode_steps`: whether the engine takes runs of decode steps."""
        self.config, self.prefill, self.decode, self.cache = config, prefill, decode, cache
        self.builder, self.stats, self.speculation = builder, stats, speculation
        self.snapshots, self.runs_decode_steps = snapshots, runs_decode_steps

    def next_batch(self, in_flight: bool, verify_in_flight: bool = False) -> Selection:
        """SETTLE only when `in_flight` (`verify_in_flight`: it is a verify step, so the
        speculating requests' lengths are upper bounds until it is processed)."""
        while True:
            if self.prefill.runnable:
                chunks = self.prefill.schedule(self.config.chunked_prefill_size)
                if chunks:
                    return Selection(self._prefill_batch(chunks, verify_in_flight))
                victim = self._preemption_victim()
                if victim is not None:
                    if in_flight:  # NOTE: the victim may be in the batch in flight
                        return SETTLE
                    self.prefill.retract(victim, memory_short=False)
                    self.stats.preemptions += 1
                    continue
            reqs = self.decode.schedule()
            if not reqs:
                return IDLE
            spec = self.speculation
            counts = None if spec is None else spec.verify_counts(reqs)
            if counts is None and spec is not None and spec.waits_for_verify(reqs,
                                                                              verify_in_flight):
                return SETTLE
            steps = self._decode_steps(reqs) if counts is None else 1
            locations = self._decode_locations(reqs, counts if steps == 1 else
                                               [steps] * len(reqs))
            if locations is None and steps > 1:  # short of pages for the run: one step
                steps, locations = 1, self._decode_locations(reqs)
            if locations is not None:
                for _ in range(steps):
                    self.prefill.on_decode_step()
                if counts is None:
                    batch = self.builder.decode(reqs, locations, steps)
                    if self.snapshots is not None:
                        self.snapshots.plan(batch, [])
                    return Selection(batch)
                return Selection(self.builder.verify(reqs, counts, locations))
            if in_flight:  # out of pages even after eviction: settle first, then retract
                return SETTLE
            self._retract_newest()

    def _prefill_batch(self, chunks: list[PrefillChunk], verify_in_flight: bool
                       ) -> ScheduledBatch:
        for chunk in chunks:
            if chunk.first:
                chunk.req.cached_tokens = chunk.req.cached_tokens or chunk.start
                self.stats.cached_prompt_tokens += chunk.start
        spec = self.speculation
        decodes = ([r for r in self.decode.schedule()
                    if spec is None or spec.rides_mixed(r, verify_in_flight)]
                   if self.config.enable_mixed_chunk else [])
        locations = self._decode_locations(decodes) if decodes else None
        if locations is not None:  # NOTE: without pages for the decodes they wait, unmixed
            batch = self.builder.mixed(chunks, decodes, locations)
            self.prefill.on_decode_step()
        else:
            batch = self.builder.prefill(chunks)
        if self.snapshots is not None:  # NOTE: it shares each chunk's pages up to its save
            self.snapshots.plan(batch, chunks)
        for chunk in chunks:
            if self.snapshots is None:
                self.prefill.share(chunk.req)
            if chunk.is_last and not chunk.req.prefill_only:
                self.decode.add(chunk.req)
        return batch

    def _decode_steps(self, reqs: list[Req]) -> int:
        """Decode steps the next launch runs (engine.decode_steps): one while a request waits
        to be admitted, or where some row's sampling would change from step to step."""
        steps = self.config.num_continuous_decode_steps
        if steps is None:
            steps = AUTO_DECODE_STEPS if len(reqs) == 1 else 1
        if (steps == 1 or not self.runs_decode_steps or self.prefill.runnable
                or self.snapshots is not None or not all(map(decodes_in_runs, reqs))):
            return 1
        return min(steps, min(r.remain_len for r in reqs))

    def _decode_locations(self, reqs: list[Req], counts: list[int] | None = None
                          ) -> torch.Tensor | None:
        """KV locations for one more token of each request (`counts`: that many); None
        (nothing taken) if short."""
        spans = [(r.kv_len, 1 if counts is None else counts[i], r.tail_loc)
                 for i, r in enumerate(reqs)]
        pages = self.cache.allocate(sum(pages_spanned(s, n, self.cache.page_size)
                                        for s, n, _ in spans))
        return None if pages is None else locations_for(spans, pages, self.cache.page_size)

    def _preemption_victim(self) -> Req | None:
        """With priority scheduling: the running request the most urgent waiting one may
        preempt, now that it could not be admitted."""
        if self.prefill.chunked is not None:
            return None
        return self.prefill.order.preemption_victim(self.prefill.admissible(),
                                                    self.decode.running)

    def _retract_newest(self) -> None:
        """Out of pages: retract the newest admitted request (also a partly prefilled one)."""
        candidates = list(self.decode.running)  # NOTE: in admission order
        if self.prefill.chunked is not None:
            candidates.append(self.prefill.chunked)  # admitted after every running one
        victim = candidates[-1]
        if len(candidates) == 1 and self.cache.available_pages == 0:
            logger.warning("request %s cannot make progress; retracting it", victim.rid)
        self.prefill.retract(victim)
        self.stats.retractions += 1
