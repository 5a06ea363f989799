"""The prefix cache of a hybrid model. Its attention layers resume from cached KV pages as any
model's do, but its linear layers resume only from the recurrent state at the exact end of the
cached prefix: so a radix node may carry a snapshot (a row of the state pool past the request
rows, kvcache.state_pool) holding the state after the node's last token, and a match stops at
the deepest matched node that has one. Whatever lies past it is recomputed.

Snapshots are few next to pages: when none is free, the least recently used snapshot of an
unlocked node is dropped (its node's pages stay, for the longer prefixes below it). A locked
node keeps its snapshot: a request admitted on it copies the state from it before its first
chunk runs. Evicting a node frees its snapshot with its pages.
"""

from __future__ import annotations

import torch

from minisgl.kvcache.prefix_cache import CacheHandle, RadixCache, RadixHandle, RadixNode


class StateRadixCache(RadixCache):
    def __init__(self, page_size: int, first_slot: int, num_slots: int) -> None:
        super().__init__(page_size)
        self.slots = range(first_slot, first_slot + num_slots)
        self._free_slots = list(reversed(self.slots))  # pop() hands out the first one first
        self._holders: dict[int, RadixNode] = {}  # slot -> the node whose snapshot it holds

    def match_prefix(self, token_ids: list[int]) -> tuple[RadixHandle, torch.Tensor]:
        whole = len(token_ids) - len(token_ids) % self.page_size
        path = self._descend(token_ids[:whole])
        while path and path[-1].snapshot is None:
            path.pop()
        node = path[-1] if path else self._root
        locations = torch.cat([n.locations for n in path]) if path else torch.empty(
            0, dtype=torch.int64)
        return RadixHandle(length=len(locations), node=node), locations

    def snapshot_of(self, handle: CacheHandle) -> int:
        """The snapshot at the end of a matched (and locked) prefix."""
        slot = self._node_of(handle).snapshot
        assert slot is not None, "a hybrid's match ends at a node with a snapshot"
        return slot

    def take_slot(self) -> int | None:
        """A snapshot slot for the caller to fill, dropping the least recently used snapshot of
        an unlocked node when none is free; None if every one is locked."""
        if not self._free_slots:
            unlocked = [n for n in self._holders.values() if n.ref_count == 0]
            if not unlocked:
                return None
            self._detach(min(unlocked, key=lambda n: (n.last_access, n.uid)))
        return self._free_slots.pop()

    def give_slot(self, slot: int) -> None:
        """A slot taken and not attached to any node."""
        self._free_slots.append(slot)

    def attach(self, handle: CacheHandle, slot: int) -> bool:
        """Make `slot` (filled with the state after handle.length tokens, or about to be by a
        step launched before any that reads it) the snapshot of the path's end; False, and the
        slot stays the caller's, where that node has one already."""
        return self._attach(self._node_of(handle), slot)

    def attach_at(self, token_ids: list[int], slot: int) -> bool:
        """`attach` at the node that ends after exactly token_ids (whole pages, cached)."""
        path = self._descend(token_ids)
        if not path or sum(len(n) for n in path) != len(token_ids):
            return False
        return self._attach(path[-1], slot)

    def reset(self) -> torch.Tensor:
        freed = super().reset()
        self._free_slots.extend(self._holders)
        self._holders.clear()
        return freed

    @property
    def free_slots(self) -> list[int]:
        return list(self._free_slots)

    @property
    def held_slots(self) -> list[int]:
        return list(self._holders)

    def _attach(self, node: RadixNode, slot: int) -> bool:
        if node is self._root or node.snapshot is not None:
            return False
        node.snapshot = slot
        self._holders[slot] = node
        return True

    def _detach(self, node: RadixNode) -> None:
        slot = node.snapshot
        assert slot is not None
        node.snapshot = None
        del self._holders[slot]
        self._free_slots.append(slot)

    def _evicted(self, node: RadixNode) -> None:
        if node.snapshot is not None:
            self._detach(node)
