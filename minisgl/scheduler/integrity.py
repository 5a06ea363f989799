"""The KV bookkeeping invariant: every page is exactly one of free, owned by a live request,
or held by the prefix cache; every slot is free or owned by exactly one request."""

from __future__ import annotations

import numpy as np

from minisgl.core import Req
from minisgl.errors import IntegrityError
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.table import TableManager


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
