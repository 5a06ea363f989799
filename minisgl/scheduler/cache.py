"""KV pages: the free-page stack plus the prefix cache, which holds the pages of finished
requests and the prefilled pages of running ones.

A page is free, owned by exactly one live request, or held by the prefix cache (locked while
live requests use it as their prefix). Eviction moves unlocked cached pages back to free.
"""

from __future__ import annotations

import numpy as np
import torch

from minisgl.kvcache import CacheHandle, PrefixCache


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: PrefixCache) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.prefix_cache = prefix_cache
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
        self.free_locations(rejected)
        self.prefix_cache.unlock(handle)
        tail = locations[max(aligned, owned_from):]
        self.free_locations(tail)

    def share(self, token_ids: list[int], locations: torch.Tensor, shared_len: int,
              handle: CacheHandle) -> tuple[int, CacheHandle] | None:
        """Hand a live request's whole pages past `shared_len` to the prefix cache (locked by
        it), so later requests can match them while it runs. Returns its new (shared_len,
        handle); None if nothing changed, also when another request cached part of the same
        tokens meanwhile (its pages stay the request's own, cached when it finishes)."""
        aligned = min(len(locations), len(token_ids)) // self.page_size * self.page_size
        if not self.prefix_cache.holds_prefixes or aligned <= shared_len:
            return None
        assert handle.length == shared_len
        new_handle = self.prefix_cache.extend(handle, token_ids[:aligned], locations[:aligned])
        if new_handle is None:
            return None
        self.prefix_cache.lock(new_handle)
        self.prefix_cache.unlock(handle)
        return aligned, new_handle

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
