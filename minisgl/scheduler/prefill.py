"""The waiting queue and prefill admission, with chunked prefill. Prefilled pages go to the
prefix cache as soon as their batch is built (`share`), so a request that arrives while another
with the same prefix runs reuses them; under lpm, a request that shares an uncached prefix with
one admitted in the same round waits for the next round to hit it.

A request is admitted when a slot is free and the pool can hold its next chunk plus a
reservation for the decode tokens of everything running (SGLang's adaptive new-token ratio,
scaled by --schedule-conservativeness: optimistic while memory is plentiful, raised after each
retraction). The manager owns a request's slot and pages from admission on: `release` gives
them back (a finished request) and `retract` sends a running request back to the queue (out of
pages, or preempted).

The waiting queue's order (`WaitingOrder`): priority first (with --enable-priority-scheduling),
then the schedule policy, and which running request a more urgent one may preempt. Policies
(`--schedule-policy`): fcfs (arrival; a retracted request goes first again), lpm (longest
cached prefix first, with in-batch prefix sharing), lof (longest output first: most
max_new_tokens), random. Admitted requests whose prompt is fully prefilled form the running
set (`DecodeManager`).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from minisgl.core import Req
from minisgl.kvcache import CacheHandle
from minisgl.layers.rotary import LongRopeSwitch
from minisgl.scheduler.lora import AdapterTable
from minisgl.scheduler.memory import CacheManager, TableManager, locations_for, pages_spanned


class DecodeManager:
    def __init__(self) -> None:
        # NOTE: an insertion-ordered set in admission order: a request enters at its last
        # prefill chunk, and no request is admitted while another is partly prefilled
        self.running: dict[Req, None] = {}

    def add(self, req: Req) -> None:
        self.running[req] = None

    def remove(self, req: Req) -> None:
        self.running.pop(req, None)

    def __len__(self) -> int:
        return len(self.running)

    def schedule(self) -> list[Req]:
        # NOTE: a request whose last token is already in flight has remain_len 0: it waits for
        # that token to be processed and is not decoded again.
        return [r for r in self.running if r.remain_len > 0]


POLICIES = ("fcfs", "lpm", "lof", "random")


class WaitingOrder:
    def __init__(self, policy: str, priorities: bool = False, low_values_first: bool = False,
                 preemption_threshold: int = 10, seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r} ({', '.join(POLICIES)})")
        self.policy, self.priorities = policy, priorities
        self.low_values_first = low_values_first
        self.preemption_threshold = preemption_threshold
        self._rng = random.Random(seed)

    @property
    def shares_in_batch(self) -> bool:
        return self.policy == "lpm"

    def urgency(self, priority: int) -> int:
        """Higher is served first; 0 for everyone without priority scheduling."""
        if not self.priorities:
            return 0
        return -priority if self.low_values_first else priority

    def order(self, waiting: Iterable[Req], cached_len: Callable[[Req], int]) -> list[Req]:
        reqs = list(waiting)
        if len(reqs) < 2:
            return reqs
        if self.policy == "lpm":
            lengths = {r: cached_len(r) for r in reqs}
            reqs.sort(key=lambda r: -lengths[r])
        elif self.policy == "lof":
            reqs.sort(key=lambda r: -(r.params.max_new_tokens or 0))
        elif self.policy == "random":
            self._rng.shuffle(reqs)
        if self.priorities:  # NOTE: a stable sort: the policy orders requests of equal priority
            reqs.sort(key=lambda r: -self.urgency(r.priority))
        return reqs

    def preemption_victim(self, waiting: Iterable[Req], running: Iterable[Req]) -> Req | None:
        """The running request the most urgent waiting one may preempt: the least urgent one
        whose urgency is at least the threshold below it (the newest admitted among equals),
        or None (also without priority scheduling)."""
        if not self.priorities:
            return None
        most_urgent = max((self.urgency(r.priority) for r in waiting), default=None)
        if most_urgent is None:
            return None
        floor = most_urgent - self.preemption_threshold
        candidates = [r for r in running if self.urgency(r.priority) <= floor]
        if not candidates:
            return None
        newest_first = list(reversed(candidates))  # NOTE: `running` is in admission order
        return min(newest_first, key=lambda r: self.urgency(r.priority))

    def displaced(self, arrivals: list[int], waiting: Iterable[Req], count: int
                  ) -> list[Req] | None:
        """With the waiting queue full: `count` waiting requests, each less urgent than an
        arrival (`arrivals`: their priorities), that may be dropped to make room; None if
        there are not enough (the arrivals are refused instead)."""
        if not self.priorities:
            return None
        pool = sorted(waiting, key=lambda r: (self.urgency(r.priority), -r.uid))
        chosen = []
        for urgency in sorted(map(self.urgency, arrivals), reverse=True)[:count]:
            if not pool or self.urgency(pool[0].priority) >= urgency:
                return None
            chosen.append(pool.pop(0))
        return chosen if len(chosen) == count else None


RESERVE_CLIP = 4096  # decode tokens reserved per request at most
IN_BATCH_SHARE = 32  # lpm: a shared uncached prefix this long defers the later request


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # NOTE: a[:low] == b[:low] and a[:high] != b[:high]; list compares are C
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


@dataclass
class PrefillChunk:
    req: Req
    start: int  # first position computed (== req.kv_len before this chunk)
    count: int
    is_last: bool  # the chunk ends the prompt: its sampled token is the first output
    locations: torch.Tensor
    first: bool = False  # the first chunk after an admission (start: the cached prefix)


class NewTokenRatio:
    """Fraction of each running request's remaining max_new_tokens assumed still to come: from
    `initial` down to `minimum` over DECAY_STEPS decode steps, both scaled by
    --schedule-conservativeness."""

    DECAY_STEPS = 600

    def __init__(self, conservativeness: float = 1.0) -> None:
        self.initial = self.value = min(1.0, 0.7 * conservativeness)
        self.minimum = min(1.0, 0.1 * conservativeness)
        self.decay = (self.initial - self.minimum) / self.DECAY_STEPS

    def step(self) -> None:
        self.value = max(self.minimum, self.value - self.decay)

    def after_retraction(self) -> None:
        self.value = min(1.0, max(self.value, self.initial) + 0.1)


def chunk_count(req: Req, start: int, end: int, budget: int) -> int:
    """Tokens of the next chunk from `start`: up to `end` within the budget, where an image
    whose tokens see each other both ways (PromptImages.whole) is never cut: the chunk stops
    before it, or (starting in it) takes the rest of it."""
    count = min(end - start, budget)
    if req.images is not None and req.images.whole:
        count = req.images.chunk_end(start, start + count) - start
    return count


class PrefillManager:
    def __init__(self, cache: CacheManager, table: TableManager, decode: DecodeManager,
                 order: WaitingOrder, adapters: AdapterTable,
                 long_rope: LongRopeSwitch | None = None,
                 on_release: Callable[[Req], None] | None = None,
                 conservativeness: float = 1.0) -> None:
        self.cache, self.table, self.decode = cache, table, decode
        self.tiers = cache.tiers  # --enable-hierarchical-cache
        self.on_release = on_release  # after a request's pages went back (hybrids' snapshots)
        self.adapters = adapters
        self.long_rope = long_rope
        self.order = order
        self.waiting: deque[Req] = deque()
        self.chunked: Req | None = None  # admitted, prompt only partly prefilled
        self.ratio = NewTokenRatio(conservativeness)

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def retract(self, req: Req, memory_short: bool = True) -> None:
        """Send an admitted request back to the waiting queue, first in line, keeping its
        tokens: its KV goes to the prefix cache, so the re-prefill reuses what is not evicted
        meanwhile. If memory was short, assume more of each running request's tokens are
        still to come."""
        self.decode.remove(req)
        self.drop(req)
        self.release(req)
        req.kv_len = req.device_len = 0
        if req.logprobs is not None and not req.num_outputs:  # its prefill starts over
            req.logprobs.input_logprobs.clear()
            req.logprobs.input_top_logprobs.clear()
        self.waiting.appendleft(req)
        if memory_short:
            self.ratio.after_retraction()

    def release(self, req: Req) -> None:
        """Give an admitted request's slot back, and its KV: whole pages to the prefix cache,
        the rest to the free pages."""
        locations = self.table.locations(req.table_idx, req.kv_len)
        self.cache.release(self._cache_ids(req, req.cacheable_len), locations, req.shared_len,
                           req.cache_handle)
        if self.on_release is not None:
            self.on_release(req)
        if req.lora_uid:
            self.adapters.release(req.lora_uid)
        self.table.free(req.table_idx)
        req.table_idx, req.cache_handle = -1, None

    def on_decode_step(self) -> None:
        self.ratio.step()

    @property
    def runnable(self) -> bool:
        """A request may be admitted or continued (not one that waits for its pages to be
        read from the lower tiers)."""
        waiting = len(self.waiting) - (self.tiers.waiting if self.tiers is not None else 0)
        return waiting > 0 or self.chunked is not None

    def admissible(self) -> list[Req]:
        """The waiting requests, but those waiting for their pages to be read."""
        if self.tiers is None:
            return list(self.waiting)
        return [r for r in self.waiting if not self.tiers.reading(r)]

    def _reserved_pages(self) -> int:
        ps = self.cache.page_size
        tokens = sum(min(r.remain_len, RESERVE_CLIP) for r in self.decode.running)
        return int(tokens * self.ratio.value) // ps + len(self.decode.running)

    def schedule(self, budget: int) -> list[PrefillChunk]:
        chunks: list[PrefillChunk] = []
        if self.chunked is not None:
            chunk = self._next_chunk(self.chunked, budget)
            if chunk is None:
                return chunks
            chunks.append(chunk)
            budget -= chunk.count
            if chunk.is_last:
                self.chunked = None
        admitted: list[Req] = []
        matches: dict[Req, tuple[CacheHandle, torch.Tensor, int]] = {}

        def match(req: Req) -> tuple[CacheHandle, torch.Tensor]:
            """One prefix match per request and round, redone only once pages were evicted."""
            found = matches.get(req)
            if found is None or found[2] != self.cache.evictions:
                found = (*self.cache.match(self._cache_ids(req), self._matched_len(req)),
                         self.cache.evictions)
                matches[req] = found
            return found[0], found[1]

        for req in self.order.order(self.waiting, lambda r: match(r)[0].length):
            if budget <= 0 or self.chunked is not None or self.table.num_free == 0:
                break
            if req.lora_uid and not self.adapters.can_admit(req.lora_uid):
                continue  # NOTE: its adapter needs a slot the running requests' adapters hold
            if self.order.shares_in_batch and self._shares_uncached(req, match(req)[0].length,
                                                                    admitted):
                continue  # NOTE: next round, once this round's pages are cached, it hits them
            loaded = 0
            if self.tiers is not None:
                found = self.tiers.continuation(req, self._cache_ids(req), match(req)[0].length,
                                                self._matched_len(req))
                if found is None:
                    continue  # NOTE: its pages are being read; the loop is woken when done
                loaded = found
            if not self._admit(req, *match(req), budget, loaded):
                break
            admitted.append(req)
            self.waiting.remove(req)
            chunk = self._next_chunk(req, budget)
            assert chunk is not None  # _admit checked the room for it
            chunk.first = True
            chunks.append(chunk)
            budget -= chunk.count
            if not chunk.is_last:
                self.chunked = req
        return chunks

    def _cache_ids(self, req: Req, end: int | None = None) -> list[int]:
        """The request's ids as the prefix cache keys them: a LongRoPE long prompt's KV is
        rotated otherwise than a short one's."""
        return req.cache_ids(end, long_rope=self.long_rope is not None
                             and self.long_rope.long_prompt(req.prompt_len))

    @staticmethod
    def _matched_len(req: Req) -> int:
        """How much of host_ids the prefix cache may serve (up to the last token, see
        CacheManager.match). NOTE: scored positions must run (their logits are wanted)."""
        scored = req.input_logprob_positions
        return scored.start + 1 if scored else len(req.host_ids)

    def _shares_uncached(self, req: Req, cached: int, admitted: list[Req]) -> bool:
        """Whether `req` (`cached` tokens of it cached) shares an uncached prefix of
        IN_BATCH_SHARE tokens or more with a request admitted in this round (lpm's in-batch
        prefix sharing)."""
        if not admitted:
            return False
        ids = req.host_ids
        return any(common_prefix_len(ids, other.host_ids) - cached >= IN_BATCH_SHARE
                   for other in admitted if other.lora_uid == req.lora_uid)

    def share(self, req: Req) -> None:
        """Let later requests match this request's prefilled pages while it runs."""
        locations = self.table.locations(req.table_idx, req.kv_len)
        shared = self.cache.share(self._cache_ids(req), locations, req.shared_len,
                                  req.cache_handle)
        if shared is not None:
            req.cache_handle = shared

    def _admit(self, req: Req, handle: CacheHandle, prefix: torch.Tensor, budget: int,
               loaded: int = 0) -> bool:
        """Take a slot for `req`, with the cached prefix `handle` matched for it and `loaded`
        pages after it from the lower tiers, if the pool can hold those, its first chunk and
        the decode reservation."""
        ps = self.cache.page_size
        input_len = len(req.host_ids)
        future = min(req.max_device_len - input_len, RESERVE_CLIP) * self.ratio.value
        reserved = 0
        if self.decode.running or self.chunked is not None:
            reserved = int(future) // ps + 1 + self._reserved_pages()

        def need(loaded: int) -> int:
            start = handle.length + loaded * ps
            return reserved + pages_spanned(handle.length, loaded * ps + chunk_count(
                req, start, input_len, budget), ps)

        # NOTE: lock before allocating, so eviction cannot take the matched prefix.
        self.cache.lock(handle)
        while loaded and self.cache.available_pages < need(loaded):
            loaded //= 2  # NOTE: pages read back are taken at once: fewer, where short
        if self.cache.available_pages < need(loaded):
            self.cache.unlock(handle)
            return False
        row = self.table.allocate()
        self.table.write_tokens(row, req.host_ids)
        if handle.length:
            self.table.write_locations(row * self.table.context_len + torch.arange(handle.length),
                                       prefix)
        req.table_idx, req.cache_handle = row, handle
        req.kv_len = handle.length
        req.device_len = input_len
        req.tail_loc = int(prefix[-1]) if handle.length else -1
        if self.tiers is not None:
            self.tiers.admit(req, handle.length, self._take_loaded(req, loaded))
        if req.lora_uid:
            self.adapters.admit(req.lora_uid)
        return True

    def _take_loaded(self, req: Req, count: int) -> torch.Tensor | None:
        """Pages for `count` pages read from the lower tiers, as `req`'s own after its cached
        prefix (the room was checked); None for none."""
        if not count:
            return None
        ps = self.cache.page_size
        pages = self.cache.allocate(count)
        assert pages is not None
        locations = locations_for([(req.kv_len, count * ps, req.tail_loc)], pages, ps)
        self.table.write_locations(
            req.table_idx * self.table.context_len + torch.arange(req.kv_len, req.kv_len
                                                                  + len(locations)), locations)
        req.kv_len += len(locations)
        req.tail_loc = int(locations[-1])
        return pages

    def _next_chunk(self, req: Req, budget: int) -> PrefillChunk | None:
        count = chunk_count(req, req.kv_len, req.device_len, budget)
        pages = self.cache.allocate(pages_spanned(req.kv_len, count, self.cache.page_size))
        if pages is None:
            return None
        locations = locations_for([(req.kv_len, count, req.tail_loc)], pages,
                                  self.cache.page_size)
        is_last = req.kv_len + count == req.device_len
        return PrefillChunk(req, req.kv_len, count, is_last, locations)

    def drop(self, req: Req) -> bool:
        """Forget a request (finished or retracted): True if it was still waiting, so it holds
        nothing; a partly prefilled one stops being the chunked request."""
        if self.tiers is not None:
            self.tiers.forget(req)
        if self.chunked is req:
            self.chunked = None
            return False
        try:
            self.waiting.remove(req)
            return True
        except ValueError:
            return False
