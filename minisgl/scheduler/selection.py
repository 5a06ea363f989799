"""Choosing the next batch: a prefill when one can be admitted (with the running decodes in the
same forward under --enable-mixed-chunk), else one decode step for every running request.
When a request must give its pages or slot back first (the pool is out of pages, or a more
urgent request waits), the batch in flight may still use them: the selector then asks the loop
to settle it before it retracts anything.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from minisgl.core import Req
from minisgl.engine.speculation import SpecConfig
from minisgl.scheduler.batch_builder import BatchBuilder, ScheduledBatch
from minisgl.scheduler.cache import CacheManager, locations_for, pages_spanned
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.decode import DecodeManager
from minisgl.scheduler.prefill import PrefillChunk, PrefillManager
from minisgl.scheduler.speculation import DraftGovernor, verify_counts
from minisgl.scheduler.stats import SchedulerStats

logger = logging.getLogger(__name__)


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
                 spec: SpecConfig | None = None, governor: DraftGovernor | None = None) -> None:
        self.config, self.prefill, self.decode, self.cache = config, prefill, decode, cache
        self.builder, self.stats, self.spec, self.governor = builder, stats, spec, governor

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
            counts = self._verify_counts(reqs)
            if counts is None and verify_in_flight and any(r.speculative for r in reqs):
                return SETTLE  # NOTE: a plain decode step needs their exact lengths
            locations = self._decode_locations(reqs, counts)
            if locations is not None:
                self.prefill.on_decode_step()
                if counts is None:
                    return Selection(self.builder.decode(reqs, locations))
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
        # NOTE: a speculating request rides one token a step, without drafts, once no verify
        # step is in flight (its lengths are exact only then)
        decodes = ([r for r in self.decode.schedule()
                    if not (r.speculative and verify_in_flight)]
                   if self.config.enable_mixed_chunk else [])
        locations = self._decode_locations(decodes) if decodes else None
        if locations is not None:  # NOTE: without pages for the decodes they wait, unmixed
            batch = self.builder.mixed(chunks, decodes, locations)
            self.prefill.on_decode_step()
        else:
            batch = self.builder.prefill(chunks)
        for chunk in chunks:
            self.prefill.share(chunk.req)
            if chunk.is_last and not chunk.req.prefill_only:
                self.decode.add(chunk.req)
        return batch

    def _verify_counts(self, reqs: list[Req]) -> list[int] | None:
        """KV slots each request reserves in a verify step; None: a plain decode step (no
        request speculates)."""
        if self.spec is None or not any(r.speculative for r in reqs) or (
                self.governor is not None and not self.governor.drafting):
            return None
        drafts = self.spec.drafts_per_row(len(reqs))
        return verify_counts(reqs, drafts) if drafts else None

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
        return self.prefill.order.preemption_victim(self.prefill.waiting, self.decode.running)

    def _retract_newest(self) -> None:
        """Out of pages: retract the newest admitted request (also a partly prefilled one)."""
        candidates = list(self.decode.running)
        if self.prefill.chunked is not None:
            candidates.append(self.prefill.chunked)
        victim = max(candidates, key=lambda r: r.admitted_at)
        if len(candidates) == 1 and self.cache.available_pages == 0:
            logger.warning("request %s cannot make progress; retracting it", victim.rid)
        self.prefill.retract(victim)
        self.stats.retractions += 1
