"""What a running request holds: a slot, KV pages and a cached prefix, and the check that each
is accounted for.

Slots (`TableManager`): a slot is one row of the page table and of the token pool. The page
table maps (slot, position) to a KV location; the token pool holds (slot, position) token
ids, where each batch gathers its input ids and writes its sampled ids. On a GPU both live on
the device, so a host mirror of the page table answers "where is this request's KV" without a
device sync. With tensor parallelism every other rank keeps its own page table and token pool:
with `mirror=True` each host write is also logged, and the next step carries the log there.

KV pages (`CacheManager`): the free-page stack plus the prefix cache, which holds the pages of
finished requests and the prefilled pages of running ones. A page is free, owned by exactly one
live request, or held by the prefix cache (locked while live requests use it as their prefix).
Eviction moves unlocked cached pages back to free. `check_kv_integrity` proves it: every page
is exactly one of free, owned by a live request, or held by the prefix cache; every slot is
free or owned by exactly one request.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from minisgl.core import Req
from minisgl.errors import IntegrityError
from minisgl.kvcache import CacheHandle, PrefixCache, RadixCache

if TYPE_CHECKING:
    from minisgl.scheduler.hicache import TierCache


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: PrefixCache,
                 tiers: TierCache | None = None) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache
        self.tiers = tiers  # --enable-hierarchical-cache: pages go there as well
        if tiers is not None and tiers.write_back:
            assert isinstance(prefix_cache, RadixCache)
            prefix_cache.on_evict = tiers.offer
        # NOTE: numpy-built, like every large host tensor of the scheduler's thread: a parallel
        # torch op here would start a second OpenMP pool (see engine.stream.CpuStream).
        self._free = torch.from_numpy(np.arange(num_pages, dtype=np.int64))  # [0, num_free) free
        self.num_free = num_pages
        self.evictions = 0  # bumped whenever cached pages are dropped: older matches are stale

    @property
    def available_pages(self) -> int:
        """Pages that an allocation can get, evicting unlocked cached pages if it must."""
        return self.num_free + self.prefix_cache.evictable_size // self.page_size

    @property
    def used_pages(self) -> int:
        return self.num_pages - self.num_free

    @property
    def cached_size(self) -> int:
        """Tokens the prefix cache holds."""
        return self.prefix_cache.size

    @property
    def locked_size(self) -> int:
        """Cached tokens that live requests use as their prefix."""
        return self.prefix_cache.protected_size

    def cached_locations(self) -> torch.Tensor:
        return self.prefix_cache.all_locations()

    def lock(self, handle: CacheHandle) -> None:
        """Keep a matched prefix from eviction while a request uses it."""
        self.prefix_cache.lock(handle)

    def unlock(self, handle: CacheHandle) -> None:
        self.prefix_cache.unlock(handle)

    def match(self, token_ids: list[int], length: int | None = None
              ) -> tuple[CacheHandle, torch.Tensor]:
        """The longest cached prefix of token_ids[:length] (all of them by default). NOTE: the
        last of those tokens is never matched: its forward must run to give the logits that
        follow it."""
        end = len(token_ids) if length is None else length
        return self.prefix_cache.match_prefix(token_ids[: end - 1])

    def allocate(self, num_pages: int) -> torch.Tensor | None:
        """Page ids, evicting from the prefix cache if needed; None (nothing taken) if short."""
        if num_pages > self.num_free:
            shortfall = num_pages - self.num_free
            if shortfall > self.prefix_cache.evictable_size // self.page_size:
                return None
            self.free_locations(self.prefix_cache.evict(shortfall * self.page_size))
            self.evictions += 1
        self.num_free -= num_pages
        return self._free[self.num_free:self.num_free + num_pages].clone()

    def free_pages(self, pages: torch.Tensor) -> None:
        count = pages.numel()
        self._free[self.num_free:self.num_free + count] = pages
        self.num_free += count

    def free_locations(self, locations: torch.Tensor) -> None:
        """Free whole pages given by their token locations."""
        if locations.numel():
            self.free_pages(locations[:: self.page_size] // self.page_size)

    def release(self, token_ids: list[int], locations: torch.Tensor, owned_from: int,
                handle: CacheHandle) -> None:
        """A request is done with its KV: [0, owned_from) came from the cache (locked by
        `handle`), [owned_from, len) it owns. Whole pages go to the cache, the rest is freed."""
        aligned = len(locations) // self.page_size * self.page_size
        aligned = min(aligned, len(token_ids) // self.page_size * self.page_size)
        rejected = self.prefix_cache.insert(token_ids[:aligned], locations[:aligned])
        if self.tiers is not None and not self.tiers.write_back:
            # NOTE: a rejected page is freed here but still holds its KV when the next step
            # launched copies it (TierCache)
            self.tiers.offer(token_ids[:aligned], locations[:aligned])
        self.free_locations(rejected)
        self.prefix_cache.unlock(handle)
        tail = locations[max(aligned, owned_from):]
        self.free_locations(tail)

    def share(self, token_ids: list[int], locations: torch.Tensor, shared_len: int,
              handle: CacheHandle) -> CacheHandle | None:
        """Hand a live request's whole pages past `shared_len` to the prefix cache (locked by
        it), so later requests can match them while it runs. Returns its new handle (its
        length the new shared_len); None if nothing changed, also when another request cached
        part of the same tokens meanwhile (its pages stay the request's own, cached when it
        finishes)."""
        aligned = min(len(locations), len(token_ids)) // self.page_size * self.page_size
        if not self.prefix_cache.holds_prefixes or aligned <= shared_len:
            return None
        assert handle.length == shared_len
        new_handle = self.prefix_cache.extend(handle, token_ids[:aligned], locations[:aligned])
        if new_handle is None:
            return None
        self.prefix_cache.lock(new_handle)
        self.prefix_cache.unlock(handle)
        return new_handle

    def free_page_ids(self) -> np.ndarray:
        return self._free[: self.num_free].numpy().copy()

    def reset_cache(self) -> None:
        self.free_locations(self.prefix_cache.reset())
        self.evictions += 1


def pages_spanned(start: int, count: int, page_size: int) -> int:
    """New pages needed to hold positions [start, start + count) when [0, start) is held."""
    return -(-(start + count) // page_size) - -(-start // page_size)


def locations_for(spans: list[tuple[int, int, int]], pages: torch.Tensor, page_size: int
                  ) -> torch.Tensor:
    """Token locations for spans (start, count, last location before start) filled from the
    tail of their current page, then from `pages` in order."""
    if page_size == 1:
        return pages
    if all(count == 1 for _, count, _ in spans):  # a decode step: plain ints, one tensor
        fresh = iter(pages.tolist())
        return torch.tensor([tail + 1 if start % page_size else next(fresh) * page_size
                             for start, _, tail in spans], dtype=torch.int64)
    parts, used = [], 0
    offsets = torch.arange(page_size, dtype=torch.int64)
    for start, count, tail in spans:
        cont = min(-start % page_size, count)
        if cont:
            parts.append(torch.arange(tail + 1, tail + 1 + cont, dtype=torch.int64))
        fresh = pages_spanned(start, count, page_size)
        if fresh:
            block = pages[used:used + fresh, None] * page_size + offsets
            parts.append(block.view(-1)[: count - cont])
            used += fresh
    return torch.cat(parts)


class TableManager:
    def __init__(self, max_running: int, dummy_row: int, page_table: torch.Tensor,
                 token_pool: torch.Tensor, mirror: bool = False) -> None:
        self.max_running = max_running
        self.page_table = page_table
        self.token_pool = token_pool
        self.context_len = page_table.shape[1]
        self.dummy_row = dummy_row  # padding rows (CUDA graphs) point here, never at a request
        on_host = page_table.device.type == "cpu"
        self.host_page_table = page_table if on_host else torch.zeros_like(page_table, device="cpu")
        self._free_rows = list(range(max_running - 1, -1, -1))  # pop() hands out row 0 first
        self.token_log: list[tuple[int, int, torch.Tensor]] | None = [] if mirror else None
        self.location_log: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if mirror else None

    def take_log(self) -> tuple[list, list]:
        """(token writes, location writes) since the last call, in order (mirror=True)."""
        assert self.token_log is not None and self.location_log is not None
        tokens, locations = self.token_log, self.location_log
        self.token_log, self.location_log = [], []
        return tokens, locations

    @property
    def num_free(self) -> int:
        return len(self._free_rows)

    def allocate(self) -> int:
        return self._free_rows.pop()

    def free(self, row: int) -> None:
        self._free_rows.append(row)

    def free_rows(self) -> list[int]:
        return list(self._free_rows)

    def write_tokens(self, row: int, token_ids: list[int]) -> None:
        ids = torch.tensor(token_ids, dtype=torch.int32)
        self.token_pool[row, : len(token_ids)].copy_(ids, non_blocking=True)
        if self.token_log is not None:
            self.token_log.append((row, 0, ids))

    def write_locations(self, flat_indices: torch.Tensor, locations: torch.Tensor) -> None:
        """page_table[i // context_len, i % context_len] = location, for flat indices i."""
        locations = locations.to(torch.int32)
        if self.location_log is not None:
            self.location_log.append((flat_indices, locations))
        if self.host_page_table is not self.page_table:
            self.host_page_table.view(-1)[flat_indices] = locations
            device = self.page_table.device
            self.page_table.view(-1)[flat_indices.to(device, non_blocking=True)] = locations.to(
                device, non_blocking=True)
        else:
            self.page_table.view(-1)[flat_indices] = locations

    def locations(self, row: int, length: int) -> torch.Tensor:
        return self.host_page_table[row, :length].to(torch.int64)


def check_kv_integrity(cache: CacheManager, table: TableManager, admitted: list[Req],
                       live: bool) -> None:
    """`admitted`: every request holding a slot (live, or finished and not yet released);
    `live`: whether any request is still running. Raises IntegrityError."""
    ps = cache.page_size
    free = cache.free_page_ids()
    cached = cache.cached_locations()
    owned = []
    for req in admitted:
        own = table.locations(req.table_idx, req.kv_len)[req.shared_len:]
        owned.append(own[::ps] // ps)
    parts = [free, cached[::ps] // ps if len(cached) else cached, *owned]
    pages = np.concatenate([np.asarray(p) for p in parts])  # NOTE: numpy, see CacheManager
    if len(pages) != cache.num_pages:
        raise IntegrityError(
            f"{len(pages)} pages accounted for (free {len(free)}, cached {len(cached) // ps}, "
            f"owned {sum(len(o) for o in owned)}), the pool has {cache.num_pages}")
    if len(pages) and (pages.min() < 0 or pages.max() >= cache.num_pages):
        raise IntegrityError("a page id outside the pool")
    seen = np.zeros(cache.num_pages, dtype=np.bool_)  # O(pages); a sort took seconds on GPUs'
    seen[pages] = True  # pools of millions of pages
    if not seen.all():  # as many ids as pages, all in range: one missing means one repeated
        raise IntegrityError("a page is counted twice")
    rows = table.free_rows() + [r.table_idx for r in admitted]
    if sorted(rows) != list(range(table.max_running)):
        raise IntegrityError("slots leaked or shared")
    if not live and not admitted and cache.locked_size:
        raise IntegrityError("cache locked with no request")
