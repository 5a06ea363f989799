"""Hybrid models' prefix caching: where a request's recurrent state is saved for the prefix
cache, and where it resumes from (kvcache.state_cache).

A request admitted on a cached prefix copies that prefix's snapshot into its own state row
before its first chunk runs (a load). Each step of a running request then saves its state at
the last page boundary the step reaches into a free snapshot slot: a prompt's last chunk at
the boundary before the prompt's last token (a match never covers a prompt's last token, whose
forward gives the first output, so the same prompt again resumes there) and at the one its
end reaches. A prefill chunk's pages up to its first boundary go to the prefix cache at once,
the snapshot attached; any later snapshot, as a decode step's, stays the request's own (its
track) until the request ends, when it joins the node its cached pages end at. A request
keeps only its newest snapshot outside the tree.
"""

from __future__ import annotations

from minisgl.core import Req
from minisgl.errors import IntegrityError
from minisgl.kvcache import StateRadixCache
from minisgl.scheduler.batch_builder import ScheduledBatch
from minisgl.scheduler.memory import CacheManager, TableManager
from minisgl.scheduler.prefill import PrefillChunk


class StateSnapshots:
    def __init__(self, cache: CacheManager, table: TableManager) -> None:
        tree = cache.prefix_cache
        assert isinstance(tree, StateRadixCache)
        self.cache, self.tree, self.table = cache, tree, table
        # a running request's newest snapshot outside the tree: (slot, tokens it follows)
        self.tracks: dict[Req, tuple[int, int]] = {}

    def plan(self, scheduled: ScheduledBatch, chunks: list[PrefillChunk]) -> None:
        """The loads and saves of a batch just built (its prefill `chunks`; every other row
        decodes one token), and its chunks' pages shared up to their saves."""
        page = self.cache.page_size
        by_req = {chunk.req: chunk for chunk in chunks}
        loads: list[tuple[int, int]] = []
        saves: list[tuple[int, int, int]] = []
        for req in scheduled.reqs:
            chunk = by_req.get(req)
            if chunk is None:  # NOTE: the builder counted the decoded token into kv_len
                if req.kv_len % page:
                    continue  # a decode step saves only where it reaches a page boundary
                start, end = req.kv_len - 1, req.kv_len
                targets = [end]
            else:
                start, end = chunk.start, chunk.start + chunk.count
                # a prompt's last chunk: also where its end's state is, for the next turn
                targets = [min(end, len(req.host_ids) - 1), end] if chunk.is_last else [end]
                if chunk.first and start:
                    loads.append((self.tree.snapshot_of(req.cache_handle), req.table_idx))
            for point in sorted({target // page * page for target in targets}):
                if point <= start or point <= self._saved_len(req):
                    continue
                slot = self.tree.take_slot()
                if slot is None:
                    break  # NOTE: every snapshot is locked by running requests: none is saved
                saves.append((req.table_idx, point - start, slot))
                if chunk is None or not self._share(req, point, slot):
                    self._keep(req, slot, point)
        batch = scheduled.fwd.batch
        batch.state_loads, batch.state_saves = loads or None, saves or None

    def released(self, req: Req) -> None:
        """`req` gave its slot and pages back (the pages to the prefix cache): its track joins
        the node it ends at, if that node is cached and has none."""
        track = self.tracks.pop(req, None)
        if track is not None:
            slot, length = track
            if not self.tree.attach_at(req.cache_ids(length), slot):
                self.tree.give_slot(slot)

    def check(self, live: bool) -> None:
        """Every snapshot slot is free, a node's, or one running request's, exactly once."""
        slots = [*self.tree.free_slots, *self.tree.held_slots,
                 *(slot for slot, _ in self.tracks.values())]
        if sorted(slots) != list(self.tree.slots):
            raise IntegrityError("state snapshots leaked or shared")
        if not live and self.tracks:
            raise IntegrityError("a state snapshot held with no request")

    def _saved_len(self, req: Req) -> int:
        track = self.tracks.get(req)
        return max(req.shared_len, 0 if track is None else track[1])

    def _share(self, req: Req, point: int, slot: int) -> bool:
        """The request's pages up to `point` to the prefix cache, `slot` their end's snapshot;
        False where the cache holds those tokens already (another request's)."""
        handle = self.cache.share(req.cache_ids(point), self.table.locations(req.table_idx, point),
                                  req.shared_len, req.cache_handle)
        if handle is None:
            return False
        req.cache_handle = handle
        attached = self.tree.attach(handle, slot)
        assert attached, "a node just made has no snapshot"
        self._drop_track(req)
        return True

    def _keep(self, req: Req, slot: int, point: int) -> None:
        self._drop_track(req)
        self.tracks[req] = (slot, point)

    def _drop_track(self, req: Req) -> None:
        track = self.tracks.pop(req, None)
        if track is not None:
            self.tree.give_slot(track[0])
