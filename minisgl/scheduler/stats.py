"""The scheduler's counters, and the state report built from them and its managers."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from minisgl.engine import Engine, ForwardOutput
from minisgl.kvcache.page_store import TIERS
from minisgl.scheduler.batch_builder import ScheduledBatch
from minisgl.scheduler.hicache import TierCache
from minisgl.scheduler.memory import CacheManager
from minisgl.scheduler.prefill import DecodeManager, PrefillManager


@dataclass
class SchedulerStats:
    tokens_generated: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    batches: int = 0
    retractions: int = 0
    preemptions: int = 0  # retractions for a more urgent request (priority scheduling)
    integrity_error: str | None = None
    # speculative decoding: rows of speculating requests verified, their drafts and the drafts
    # accepted (each row also emits one token of the target's own)
    spec_verified_rows: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0

    def count_verify(self, done: ScheduledBatch, out: ForwardOutput) -> float | None:
        """Count a verify step's speculating rows; returns the tokens they emitted per row
        (None: it had none)."""
        assert out.counts is not None and out.drafted is not None
        rows = [i for i, req in enumerate(done.reqs) if req.spec is not None]
        counts, drafted = out.counts.tolist(), out.drafted.tolist()
        emitted = sum(counts[i] for i in rows)
        self.spec_verified_rows += len(rows)
        self.spec_drafted += sum(drafted[i] for i in rows)
        self.spec_accepted += emitted - len(rows)
        return emitted / len(rows) if rows else None

    @property
    def spec_accept_length(self) -> float:
        """Tokens a speculating request gains per verify step (accepted drafts + 1)."""
        rows = self.spec_verified_rows
        return (self.spec_accepted + rows) / rows if rows else 0.0

    @property
    def spec_accept_rate(self) -> float:
        return self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0


def report(stats: SchedulerStats, cache: CacheManager, prefill: PrefillManager,
           decode: DecodeManager, engine: Engine, pending_new: int) -> dict[str, Any]:
    """The scheduler's state as /get_server_info and /metrics show it."""
    ps = cache.page_size
    pool_tokens = cache.num_pages * ps
    used = cache.used_pages * ps
    evictable = cache.prefix_cache.evictable_size
    return {
        "num_running_reqs": len(decode) + (prefill.chunked is not None),
        "num_waiting_reqs": len(prefill.waiting) + pending_new,
        "kv_pool_tokens": pool_tokens,
        "kv_used_tokens": used,
        "kv_cached_tokens": cache.cached_size,
        "kv_usage": used / pool_tokens,
        "kv_request_tokens": used - evictable,  # held by requests (SGLang's num_used_tokens)
        "kv_evictable_tokens": evictable,
        "kv_free_tokens": cache.num_free * ps,
        "token_usage": (used - evictable) / pool_tokens,
        "free_pages": cache.num_free,
        "request_slots": prefill.table.max_running,
        "request_slots_used": prefill.table.max_running - prefill.table.num_free,
        "prompt_tokens": stats.prompt_tokens,
        "cached_prompt_tokens": stats.cached_prompt_tokens,
        "cache_hit_rate": stats.cached_prompt_tokens / max(stats.prompt_tokens, 1),
        "generated_tokens": stats.tokens_generated,
        "batches": stats.batches,
        "retractions": stats.retractions,
        "preemptions": stats.preemptions,
        "waiting_by_priority": waiting_by_priority(prefill),
        "new_token_ratio": prefill.ratio.value,
        "engine_busy_seconds": engine.busy_seconds,
        **{f"engine_{phase}_seconds": seconds
           for phase, seconds in engine.phase_seconds.items()},
        **{f"engine_{phase}_steps": steps for phase, steps in engine.phase_steps.items()},
        **{f"engine_{kind}_tokens": n for kind, n in engine.forwarded_tokens.items()},
        "spec_verified_rows": stats.spec_verified_rows,
        "spec_drafted_tokens": stats.spec_drafted,
        "spec_accepted_tokens": stats.spec_accepted,
        "spec_accept_length": stats.spec_accept_length,
        "spec_accept_rate": stats.spec_accept_rate,
        "integrity_error": stats.integrity_error,
        **tier_report(cache.tiers),
    }


def tier_report(tiers: TierCache | None) -> dict[str, Any]:
    """The hierarchical cache's counters (zeros without it): prompt tokens each tier served,
    bytes saved to and loaded from the tiers, the loads' reading time, each tier's size."""
    report: dict[str, Any] = {f"hicache_{tier}_{what}": 0 for tier in TIERS
                              for what in ("hit_tokens", "bytes", "pages")}
    report |= {"hicache_saved_bytes": 0, "hicache_dropped_bytes": 0, "hicache_loaded_bytes": 0,
               "hicache_loads": 0, "hicache_load_seconds": 0.0, "hicache_rejected_pages": 0}
    if tiers is None:
        return report
    stats, store = tiers.stats, tiers.store
    for tier in store.tiers:
        held = tier.stats
        report[f"hicache_{tier.name}_bytes"] = held.nbytes
        report[f"hicache_{tier.name}_pages"] = held.pages
        report["hicache_rejected_pages"] += held.rejected
    for tier, tokens in stats.hit_tokens.items():
        report[f"hicache_{tier}_hit_tokens"] = tokens
    report |= {"hicache_saved_bytes": store.saved_bytes,
               "hicache_dropped_bytes": store.dropped_bytes,
               "hicache_loaded_bytes": stats.loaded_pages * store.payload_bytes,
               "hicache_loads": stats.loads, "hicache_load_seconds": stats.load_seconds}
    return report


def waiting_by_priority(prefill: PrefillManager) -> dict[str, int]:
    """How many requests wait at each priority (JSON keys: strings)."""
    counts = Counter(req.priority for req in prefill.waiting)
    return {str(priority): counts[priority] for priority in sorted(counts, reverse=True)}
