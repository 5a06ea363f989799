"""The prefix-cache interface: token-id prefixes -> KV slot locations, in whole pages.

A location is the index of one token's K/V slot in the global pool. Locations come in pages of
`page_size` consecutive slots, and every sequence handed to `insert` is a whole number of pages.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


def empty_locations() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class CacheHandle:
    """What `match_prefix` found; pass it back to `lock`/`unlock`. `length` = matched tokens."""

    length: int


class PrefixCache(ABC):
    holds_prefixes = True  # False: a cache that keeps nothing (NaiveCache)

    def __init__(self, page_size: int) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, token_ids: list[int]) -> tuple[CacheHandle, torch.Tensor]:
        """Longest cached prefix of token_ids, in whole pages; returns a handle and its locations
        (len = matched tokens). A trailing partial page of token_ids is never matched."""

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None:
        """Ref-count +1 on the matched path: locked entries are never evicted."""

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None:
        """Ref-count -1 on the matched path."""

    @abstractmethod
    def insert(self, token_ids: list[int], locations: torch.Tensor) -> torch.Tensor:
        """Offer a finished sequence's KV (whole pages). Returns the caller's locations the cache
        did not take (where that prefix was already cached at other locations); the caller frees them."""

    @abstractmethod
    def extend(self, handle: CacheHandle, token_ids: list[int], locations: torch.Tensor
               ) -> CacheHandle | None:
        """Cache a live sequence's pages past the path `handle` matched (token_ids[:handle.
        length], which stays locked by the caller): token_ids (whole pages) at `locations`.
        Returns the handle of the longer path, unlocked; None, with nothing changed, where a
        page of that continuation is already cached (its own pages then stay the caller's)."""

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Free at least num_tokens if possible from unlocked entries, least recently used first;
        returns the freed locations."""

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held that are unlocked."""

    @property
    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held that are locked."""

    @property
    def size(self) -> int:
        """All tokens held."""
        return self.evictable_size + self.protected_size

    @abstractmethod
    def all_locations(self) -> torch.Tensor:
        """Every location held (for integrity checks)."""

    @abstractmethod
    def reset(self) -> torch.Tensor:
        """Drop everything and return the freed locations; raises RuntimeError if anything is locked."""

    def _check_insert_args(self, token_ids: list[int], locations: torch.Tensor) -> None:
        if len(token_ids) % self.page_size:
            raise ValueError(f"{len(token_ids)} tokens is not a multiple of page_size {self.page_size}")
        if locations.shape != (len(token_ids),):
            raise ValueError(f"locations shape {tuple(locations.shape)} != ({len(token_ids)},)")
