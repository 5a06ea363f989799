"""A prefix cache that caches nothing: every request recomputes its whole prompt."""

from __future__ import annotations

import torch

from minisgl.kvcache.prefix_cache import CacheHandle, PrefixCache, empty_locations

_NO_MATCH = CacheHandle(length=0)


class NaiveCache(PrefixCache):
    holds_prefixes = False

    def match_prefix(self, token_ids: list[int]) -> tuple[CacheHandle, torch.Tensor]:
        return _NO_MATCH, empty_locations()

    def lock(self, handle: CacheHandle) -> None:
        pass

    def unlock(self, handle: CacheHandle) -> None:
        pass

    def insert(self, token_ids: list[int], locations: torch.Tensor) -> torch.Tensor:
        self._check_insert_args(token_ids, locations)
        return locations

    def extend(self, handle: CacheHandle, token_ids: list[int], locations: torch.Tensor
               ) -> CacheHandle | None:
        return None

    def evict(self, num_tokens: int) -> torch.Tensor:
        return empty_locations()

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0

    def all_locations(self) -> torch.Tensor:
        return empty_locations()

    def reset(self) -> torch.Tensor:
        return empty_locations()
