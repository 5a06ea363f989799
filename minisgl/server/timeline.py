"""The server's recent history, one sample a second: what the dashboard plots.

A sample reads the scheduler's state (a dict built from counters the scheduler keeps anyway)
and the metrics' latest latencies; rates are differences from the previous sample. Ten minutes
of samples are kept, so a page opened late still shows the recent past.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any, Callable

from minisgl.runtime.metrics import Metrics

SAMPLE_S = 1.0
HISTORY = 600  # samples
LATENCY_WINDOW_S = 10.0  # the percentiles of a sample cover this many seconds
THROUGHPUT_SAMPLES = 5  # sglang:gen_throughput averages this many samples
# a sample's per-second rates: its name -> the counter of the scheduler's state it differences
RATES = {"output_tok_s": "generated_tokens", "prefill_tok_s": "engine_prefill_tokens",
         "decode_tok_s": "engine_decode_tokens", "busy": "engine_busy_seconds",
         "hicache_host_tok_s": "hicache_host_hit_tokens",
         "hicache_disk_tok_s": "hicache_disk_hit_tokens"}


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 1]); None when there are no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Timeline:
    def __init__(self, state: Callable[[], dict[str, Any]], metrics: Metrics) -> None:
        self.state, self.metrics = state, metrics
        self.samples: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self._previous: tuple[float, dict[str, Any]] | None = None

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_S)

    def sample(self) -> dict[str, Any]:
        now = time.monotonic()
        state = self.state()
        ttft, itl = self.metrics.recent(LATENCY_WINDOW_S)
        pool = state["kv_pool_tokens"]
        sample: dict[str, Any] = {
            "t": round(time.time(), 3),
            "running": state["num_running_reqs"],
            "waiting": state["num_waiting_reqs"],
            "kv_requests": state["token_usage"],
            "kv_cache": state["kv_evictable_tokens"] / pool,
            "cache_hit_rate": state["cache_hit_rate"],
            "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
            "itl_p50": percentile(itl, 0.5), "itl_p99": percentile(itl, 0.99),
        }
        if self._previous is None:
            sample |= dict.fromkeys(RATES, 0.0)
            sample["spec_accept_length"] = 0.0
        else:
            then, before = self._previous
            elapsed = max(now - then, 1e-6)
            sample |= {name: (state[key] - before[key]) / elapsed for name, key in RATES.items()}
            rows = state["spec_verified_rows"] - before["spec_verified_rows"]
            accepted = state["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            sample["spec_accept_length"] = (accepted + rows) / rows if rows else 0.0
        sample["busy"] = min(sample["busy"], 1.0)
        sample |= {k: round(v, 6) for k, v in sample.items() if isinstance(v, float) and k != "t"}
        self._previous = (now, state)
        self.samples.append(sample)
        return sample

    def since(self, t: float) -> list[dict[str, Any]]:
        """Samples taken after wall-clock time `t` (all of them for t <= 0)."""
        return [s for s in self.samples if s["t"] > t]

    def gen_throughput(self) -> float:
        recent = list(self.samples)[-THROUGHPUT_SAMPLES:]
        return sum(s["output_tok_s"] for s in recent) / len(recent) if recent else 0.0
