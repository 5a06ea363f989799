"""The scheduler's side of the hierarchical prefix cache (--enable-hierarchical-cache): which
pages go to the lower tiers, and which requests continue their prefix match there.

Saves: with write_through a request's whole pages are offered when it gives them to the
prefix cache (`CacheManager.release`); with write_back when the pool evicts them
(`RadixCache.on_evict`). Pages some tier holds (or is writing) are not offered again. Their
copy is made by the next step launched (`take_moves`), before its layers write any KV: no
step writes a page freed after the step in flight was built before that copy.

Loads: after the radix match, `continuation` hashes the prompt's next whole pages and asks
the tiers' indexes how many they hold from there (no IO). With some, the request waits (it is
skipped at admission, the loop sleeps while nothing else can run) until the store's thread
has read them; the loop is woken then, and the request is admitted with those pages as its
own, written into the pool by its first step. A page that does not read back intact ends the
load there: the rest is recomputed. If the radix match shrank meanwhile, below where the load
started, the request recomputes past it.

KV computed under a LoRA adapter is never saved nor loaded: adapter ids are not stable
across restarts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from minisgl.core import Req, cache_id_kind
from minisgl.engine.hicache import KVMoves
from minisgl.kvcache.page_store import Loaded, PageStore, page_keys

WAIT = None  # `continuation`: the request's pages are being read


@dataclass
class _Prefetch:
    first_page: int  # the page index the load starts at
    result: Loaded | None = None  # set on the store's thread


@dataclass
class LoadStats:
    hit_tokens: dict[str, int] = field(default_factory=dict)  # per tier, prompt tokens loaded
    loaded_pages: int = 0
    loads: int = 0
    load_seconds: float = 0.0


class TierCache:
    def __init__(self, store: PageStore, fingerprint: bytes, page_size: int,
                 write_back: bool) -> None:
        self.store, self.fingerprint, self.page_size = store, fingerprint, page_size
        self.write_back = write_back
        self.wake: Callable[[], None] = lambda: None  # the loop's, set when it runs
        self._saves: list[tuple[bytes, int]] = []
        self._offered: set[bytes] = set()  # in _saves
        self._loads: list[tuple[torch.Tensor, torch.Tensor]] = []  # (pages, their payloads)
        self._prefetches: dict[Req, _Prefetch] = {}
        self._keys: dict[Req, tuple[int, list[bytes]]] = {}  # a waiting request's page keys
        self.stats = LoadStats()

    # ---- saves --------------------------------------------------------------------------------

    def offer(self, token_ids: list[int], locations: torch.Tensor, start: int = 0) -> None:
        """Pages of a cached sequence (`token_ids` from the first token, whole pages;
        `locations`: the pool locations of token_ids[start:])."""
        ps = self.page_size
        if not token_ids or not _persistent(token_ids) or len(token_ids) - start < ps:
            return
        keys = page_keys(self.fingerprint, token_ids, ps, start // ps)
        pages = (locations[::ps] // ps).tolist()
        for key, page in zip(keys, pages):
            if key not in self._offered and not self.store.has(key):
                self._offered.add(key)
                self._saves.append((key, page))

    def take_moves(self) -> KVMoves | None:
        """The copies the next step launched makes (None: none)."""
        if not self._saves and not self._loads:
            return None
        saves, self._saves = self._saves, []
        self._offered.clear()
        loads, self._loads = self._loads, []
        payloads = [rows for _, rows in loads]
        return KVMoves(save_pages=[page for _, page in saves],
                       load_pages=[p for pages, _ in loads for p in pages.tolist()],
                       save_keys=[key for key, _ in saves],
                       load_payloads=(None if not payloads else payloads[0] if len(payloads) == 1
                                      else torch.cat(payloads)))

    # ---- loads --------------------------------------------------------------------------------

    @property
    def waiting(self) -> int:
        """Requests whose pages are still being read."""
        return sum(1 for p in self._prefetches.values() if p.result is None)

    def continuation(self, req: Req, cache_ids: list[int], matched: int, end: int
                     ) -> int | None:
        """Past the radix match (`matched` tokens of cache_ids; at most `end` - 1 may be
        served): how many pages the tiers give back, maybe none; WAIT while they are being
        read. `admit` takes them."""
        ps = self.page_size
        prefetch = self._prefetches.get(req)
        if prefetch is None:
            whole = (end - 1) // ps * ps
            if whole <= matched or not _persistent(cache_ids):
                return 0
            known = self._keys.get(req)
            if known is None or known[0] != whole:  # NOTE: hashed once while it waits
                known = self._keys[req] = (whole, page_keys(self.fingerprint, cache_ids[:whole],
                                                            ps))
            keys = known[1][matched // ps:]
            hits = self.store.hits(keys)
            if not hits:
                return 0
            prefetch = self._prefetches[req] = _Prefetch(matched // ps)
            self.store.load(keys[:hits], lambda result: self._loaded(prefetch, result))
            return WAIT
        if prefetch.result is None:
            return WAIT
        skip = matched // ps - prefetch.first_page
        if skip < 0:
            del self._prefetches[req]  # NOTE: the radix match shrank meanwhile: recompute
            return 0
        return max(0, len(prefetch.result.payloads) - skip)

    def _loaded(self, prefetch: _Prefetch, result: Loaded) -> None:
        """On the store's thread."""
        prefetch.result = result
        self.wake()

    def admit(self, req: Req, matched: int, pages: torch.Tensor | None) -> None:
        """`req` was admitted on `matched` tokens and, into `pages`, the pages its
        `continuation` counted: the next step writes them. Its first admission's
        `Req.tier_tokens` are counted here."""
        prefetch = self._prefetches.pop(req, None)
        self._keys.pop(req, None)
        served = {tier.name: 0 for tier in self.store.tiers}
        if prefetch is not None and prefetch.result is not None and pages is not None:
            result, skip = prefetch.result, matched // self.page_size - prefetch.first_page
            self.stats.loads += 1
            self.stats.load_seconds += result.seconds
            self.stats.loaded_pages += len(pages)
            for tier in result.tiers[skip:skip + len(pages)]:
                served[tier] += self.page_size
                self.stats.hit_tokens[tier] = self.stats.hit_tokens.get(tier, 0) + self.page_size
            self._loads.append((pages, result.payloads[skip:skip + len(pages)]))
        if req.tier_tokens is None:
            req.tier_tokens = served

    def forget(self, req: Req) -> None:
        """A request that no longer waits (finished, aborted): its read, if any, is dropped."""
        self._prefetches.pop(req, None)
        self._keys.pop(req, None)

    def reading(self, req: Req) -> bool:
        """Whether `req` waits for its pages to be read."""
        prefetch = self._prefetches.get(req)
        return prefetch is not None and prefetch.result is None


def _persistent(cache_ids: list[int]) -> bool:
    """KV not computed under a LoRA adapter (see the module's docstring)."""
    return cache_id_kind(cache_ids[0]) < 2
