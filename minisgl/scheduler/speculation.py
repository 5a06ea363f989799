"""Speculative decoding on the host side: which requests speculate, the KV slots a verify step
reserves, and giving back what its drafts did not use.

A verify step is built before the step in flight says how many drafts it accepted, so a
speculating request's kv_len and device_len are upper bounds: each verify step reserves KV
slots at [kv_len, kv_len + 1 + drafts) and advances both by that much. As long as the true
token count never exceeds device_len, the slots any step writes (from the true last token on)
are reserved. When the step's result arrives the surplus (drafts it reserved but did not
emit) comes off both again, and whole pages past the new kv_len go back to the pool: the
step in flight after it writes below that bound.
"""

from __future__ import annotations

from minisgl.core import Req
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.table import TableManager


def speculates(req: Req) -> bool:
    """Whether a request may verify drafts: its token at each position must depend on nothing
    a draft changes but the tokens before it. Penalties, logit_bias and min_new_tokens shape
    each position's logits from the output so far (per step, not per drafted position); a
    grammar's mask would need its matcher to walk the drafts; a sampling_seed promises the
    same output as without speculation. Such requests decode one token a step."""
    params = req.params
    return not (params.needs_penalties or params.logit_bias or params.min_new_tokens
                or req.matcher is not None
                or (params.sampling_seed is not None and not params.is_greedy))


def verify_counts(reqs: list[Req], drafts_per_row: int) -> list[int]:
    """Tokens to reserve for each request in a verify step: its last token and its drafts,
    never past what it may still produce."""
    return [max(1, min(1 + drafts_per_row, r.remain_len)) if r.speculative else 1
            for r in reqs]


def release_surplus(req: Req, surplus: int, cache: CacheManager, table: TableManager) -> None:
    """A verify step emitted `surplus` tokens fewer than it reserved for `req`: lower its bounds
    and free the whole pages past the new kv_len."""
    if surplus <= 0:
        return
    ps = cache.page_size
    old = req.kv_len
    req.kv_len -= surplus
    req.device_len -= surplus
    kept = -(-req.kv_len // ps) * ps
    locations = table.locations(req.table_idx, old)
    cache.free_locations(locations[kept:])
    req.tail_loc = int(locations[req.kv_len - 1]) if req.kv_len else -1
