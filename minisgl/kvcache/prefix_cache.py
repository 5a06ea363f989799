"""Prefix caches: token-id prefixes -> KV slot locations, in whole pages. The interface
(`PrefixCache`), the radix tree (`RadixCache`) and the cache that caches nothing (`NaiveCache`,
--disable-radix-cache).

A location is the index of one token's K/V slot in the global pool. Locations come in pages of
`page_size` consecutive slots, and every sequence handed to `insert` is a whole number of pages.

The radix tree works at page granularity: every edge holds a whole number of pages; a node's
children are keyed by the token ids of their first page, and nodes are only ever split at page
boundaries. Eviction removes unlocked leaves, least recently used first (recency is a counter
bumped by every match/insert, not wall time).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
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


_uids = itertools.count()


class RadixNode:
    __slots__ = ("token_ids", "locations", "children", "parent", "ref_count", "last_access", "uid",
                 "snapshot")

    def __init__(self, token_ids: list[int], locations: torch.Tensor,
                 parent: RadixNode | None, last_access: int) -> None:
        self.token_ids = token_ids
        self.locations = locations
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent  # None for the root and for evicted nodes
        self.ref_count = 0
        self.last_access = last_access
        self.uid = next(_uids)  # tie-break for the eviction heap
        self.snapshot: int | None = None  # hybrids: the state at the node's end (state_cache)

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class RadixHandle(CacheHandle):
    """`node` is the deepest matched node; the matched path is node -> root."""

    node: RadixNode


class RadixCache(PrefixCache):
    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self._root = RadixNode([], empty_locations(), None, 0)
        self._clock = 0
        self._evictable = 0
        self._protected = 0
        # called with each evicted node's (token ids from the root to its end, its locations)
        self.on_evict: Callable[[list[int], torch.Tensor, int], None] | None = None

    # ---- queries ----

    def match_prefix(self, token_ids: list[int]) -> tuple[RadixHandle, torch.Tensor]:
        whole = len(token_ids) - len(token_ids) % self.page_size
        path = self._descend(token_ids[:whole])
        node = path[-1] if path else self._root
        locations = torch.cat([n.locations for n in path]) if path else empty_locations()
        return RadixHandle(length=len(locations), node=node), locations

    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    def all_locations(self) -> torch.Tensor:
        parts = [n.locations for n in self._nodes()]
        return torch.cat(parts) if parts else empty_locations()

    # ---- locking ----

    def lock(self, handle: CacheHandle) -> None:
        node = self._node_of(handle)
        while node is not self._root:
            if node.ref_count == 0:
                self._evictable -= len(node)
                self._protected += len(node)
            node.ref_count += 1
            node = node.parent
            assert node is not None

    def unlock(self, handle: CacheHandle) -> None:
        node = self._node_of(handle)
        while node is not self._root:
            if node.ref_count <= 0:
                raise RuntimeError("unlock without a matching lock")
            node.ref_count -= 1
            if node.ref_count == 0:
                self._evictable += len(node)
                self._protected -= len(node)
            node = node.parent
            assert node is not None

    # ---- mutation ----

    def insert(self, token_ids: list[int], locations: torch.Tensor) -> torch.Tensor:
        self._check_insert_args(token_ids, locations)
        path = self._descend(token_ids)
        pos, rejected = 0, []
        for node in path:  # already cached: the tree keeps its own locations
            theirs = locations[pos:pos + len(node)]
            rejected.append(theirs[theirs != node.locations])
            pos += len(node)
        if pos < len(token_ids):
            parent = path[-1] if path else self._root
            leaf = RadixNode(list(token_ids[pos:]), locations[pos:].clone(), parent, self._clock)
            parent.children[self._key(leaf.token_ids)] = leaf
            self._evictable += len(leaf)
        return torch.cat(rejected) if rejected else empty_locations()

    def extend(self, handle: CacheHandle, token_ids: list[int], locations: torch.Tensor
               ) -> RadixHandle | None:
        self._check_insert_args(token_ids, locations)
        node, start = self._node_of(handle), handle.length
        if start >= len(token_ids) or self._key(token_ids, start) in node.children:
            return None
        self._clock += 1
        leaf = RadixNode(list(token_ids[start:]), locations[start:].clone(), node, self._clock)
        node.children[self._key(leaf.token_ids)] = leaf
        self._evictable += len(leaf)
        return RadixHandle(length=len(token_ids), node=leaf)

    def evict(self, num_tokens: int) -> torch.Tensor:
        if num_tokens <= 0:
            return empty_locations()
        heap = [(n.last_access, n.uid, n) for n in self._nodes() if not n.children and n.ref_count == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while heap and num_freed < num_tokens:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None
            if self.on_evict is not None:
                ids = self._path_ids(node)
                self.on_evict(ids, node.locations, len(ids) - len(node))
            del parent.children[self._key(node.token_ids)]
            node.parent = None
            self._evicted(node)
            freed.append(node.locations)
            num_freed += len(node)
            self._evictable -= len(node)
            if parent is not self._root and not parent.children and parent.ref_count == 0:
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        return torch.cat(freed) if freed else empty_locations()

    def reset(self) -> torch.Tensor:
        if self._protected:
            raise RuntimeError(f"reset with {self._protected} locked tokens")
        freed = self.all_locations()
        for node in self._nodes():
            node.parent = None  # outstanding handles become detectably stale
        self._root = RadixNode([], empty_locations(), None, 0)
        self._evictable = 0
        return freed

    # ---- internals ----

    def _evicted(self, node: RadixNode) -> None:
        """A node left the tree (a subclass frees what it held besides pages)."""

    def _path_ids(self, node: RadixNode) -> list[int]:
        """The token ids from the root to the end of `node`."""
        edges = []
        while node is not self._root:
            edges.append(node.token_ids)
            assert node.parent is not None
            node = node.parent
        return [t for edge in reversed(edges) for t in edge]

    def _key(self, token_ids: list[int], start: int = 0) -> tuple[int, ...]:
        return tuple(token_ids[start:start + self.page_size])

    def _descend(self, token_ids: list[int]) -> list[RadixNode]:
        """Walk the longest cached page-aligned prefix of token_ids (a whole number of pages),
        splitting the last node so that the path ends exactly at the match, and touch it."""
        self._clock += 1
        node, pos, path = self._root, 0, []
        while pos < len(token_ids):
            child = node.children.get(self._key(token_ids, pos))
            if child is None:
                break
            common = self._common_length(child.token_ids, token_ids, pos)
            if common < len(child):
                child = self._split(child, common)
            child.last_access = self._clock
            path.append(child)
            node, pos = child, pos + common
        return path

    def _common_length(self, edge: list[int], token_ids: list[int], pos: int) -> int:
        """Page-aligned common prefix length of edge and token_ids[pos:]; the first page is known equal."""
        n = min(len(edge), len(token_ids) - pos)
        if edge[:n] == token_ids[pos:pos + n]:
            return n
        p, i = self.page_size, self.page_size
        while i < n and edge[i:i + p] == token_ids[pos + i:pos + i + p]:
            i += p
        return i

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut node's edge at `at` tokens; the new upper part is returned and `node` keeps the
        lower part, so handles pointing at `node` still cover the same path."""
        parent = node.parent
        assert parent is not None and 0 < at < len(node) and at % self.page_size == 0
        upper = RadixNode(node.token_ids[:at], node.locations[:at], parent, node.last_access)
        upper.ref_count = node.ref_count
        parent.children[self._key(node.token_ids)] = upper
        node.token_ids, node.locations = node.token_ids[at:], node.locations[at:]
        node.parent = upper
        upper.children[self._key(node.token_ids)] = node
        return upper

    def _node_of(self, handle: CacheHandle) -> RadixNode:
        if not isinstance(handle, RadixHandle):
            raise TypeError(f"not a RadixHandle: {handle!r}")
        if handle.length == 0:
            return self._root  # also valid across reset()
        if handle.node is not self._root and handle.node.parent is None:
            raise RuntimeError("stale handle: its node was evicted (lock right after match_prefix)")
        return handle.node

    def _nodes(self) -> Iterator[RadixNode]:
        """Every node but the root."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


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
