"""Prometheus metrics under SGLang's names (`sglang:*`, with its label sets and bucket edges,
so SGLang's Grafana dashboards and alerts read minisgl unchanged), beside minisgl's own engine
series (`minisgl_*`). Request-level series are observed as tokens arrive; the scheduler's gauges
are read from its state at scrape time. One registry per server, rendered by prometheus-client.

It also keeps the latest latencies, for the dashboard's percentiles.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from typing import Any, Callable, Iterator, get_args

from prometheus_client import (CollectorRegistry, Counter, Histogram, disable_created_metrics,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from minisgl.core import Phase

# SGLang's default bucket edges (seconds; tokens for the length histograms)
TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600,
               1200, 1800, 2400)
LENGTH_BUCKETS = (100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000,
                  9000, 10000, 12500, 15000, 17500, 20000, 22500, 25000, 27500, 30000, 35000,
                  40000, 60000, 80000, 100000, 200000, 300000, 400000, 600000, 800000, 1000000,
                  1100000)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
disable_created_metrics()  # NOTE: process-wide; SGLang's output has no *_created series
# latencies kept for the dashboard's percentiles: the last seconds of a busy server's tokens
RECENT_MAX = 20000

# name: (help, key of the scheduler's state); read at scrape time
PHASES = get_args(Phase)

SGLANG_GAUGES = {
    "num_running_reqs": ("The number of running requests.", "num_running_reqs"),
    "num_queue_reqs": ("The number of requests in the waiting queue.", "num_waiting_reqs"),
    "num_used_tokens": ("The number of used tokens.", "kv_request_tokens"),
    "token_usage": ("The token usage.", "token_usage"),
    "kv_used_tokens": ("Number of actively used token slots in the KV cache pool.",
                       "kv_request_tokens"),
    "kv_available_tokens": ("Number of free token slots in the KV cache pool.",
                            "kv_free_tokens"),
    "kv_evictable_tokens": ("Number of evictable (radix-cached) token slots in the KV cache "
                            "pool.", "kv_evictable_tokens"),
    "max_total_num_tokens": ("Tokens the KV cache pool holds.", "kv_pool_tokens"),
    "cache_hit_rate": ("The prefix cache hit rate.", "cache_hit_rate"),
    "new_token_ratio": ("The scheduler's estimate of the share of max_new_tokens a request "
                        "will use.", "new_token_ratio"),
    "spec_accept_length": ("Speculative decoding: tokens a request gains per verify step "
                           "(accepted drafts + 1), mean since start.", "spec_accept_length"),
    "spec_accept_rate": ("Speculative decoding: the share of drafted tokens accepted, since "
                         "start.", "spec_accept_rate"),
}
SGLANG_COUNTERS = {
    "num_retracted_requests": ("Requests sent back to the waiting queue for lack of KV "
                               "pages (preemptions included).", "retractions"),
}
MINISGL_COUNTERS = {
    "preemptions": "Running requests sent back to the waiting queue for a more urgent one",
    "spec_drafted_tokens": "Speculative decoding: drafted tokens verified",
    "spec_accepted_tokens": "Speculative decoding: drafted tokens accepted",
    **{f"engine_{phase}_steps": f"Number of {phase} steps" for phase in PHASES},
    **{f"engine_{phase}_seconds": f"Seconds in {phase} steps (CPU: compute; CUDA: launch only)"
       for phase in PHASES},
    "engine_prefill_tokens": "Prompt tokens forwarded (mixed steps' prefill rows included)",
    "engine_decode_tokens": "Decode tokens forwarded (mixed steps' decode rows included)",
    "hicache_host_hit_tokens": "Hierarchical cache: prompt tokens read back from host memory",
    "hicache_disk_hit_tokens": "Hierarchical cache: prompt tokens read back from disk",
    "hicache_saved_bytes": "Hierarchical cache: bytes of KV pages saved to the lower tiers",
    "hicache_loaded_bytes": "Hierarchical cache: bytes of KV pages loaded back into the pool",
    "hicache_load_seconds": "Hierarchical cache: seconds spent reading pages back (off the "
                            "event loop)",
    "hicache_rejected_pages": "Hierarchical cache: pages on disk that did not check and were "
                              "dropped",
}


def streaming_label(streaming: bool) -> str:
    return "true" if streaming else "false"


class _SchedulerCollector(Collector):
    """The scheduler's gauges and counters, read from its state when /metrics is scraped."""

    def __init__(self, state: Callable[[], dict[str, Any]], model_name: str,
                 gen_throughput: Callable[[], float]) -> None:
        self.state, self.model_name, self.gen_throughput = state, model_name, gen_throughput

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        state = self.state()
        values = {name: (help, state[key]) for name, (help, key) in SGLANG_GAUGES.items()}
        values["gen_throughput"] = ("The generation throughput (token/s).",
                                    self.gen_throughput())
        for name, (help, value) in values.items():
            family = GaugeMetricFamily(f"sglang:{name}", help, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        counters = {f"sglang:{name}": (help, state[key])
                    for name, (help, key) in SGLANG_COUNTERS.items()}
        counters |= {f"minisgl_{name}": (help, state[name])
                     for name, help in MINISGL_COUNTERS.items()}
        for name, (help, value) in counters.items():
            family = CounterMetricFamily(name, help, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class BucketCounts:
    """A histogram's counts, kept by hand: the per-token path runs once per generated token
    and must stay cheap, without prometheus-client's per-observation lock."""

    def __init__(self, edges: tuple[float, ...]) -> None:
        self.edges, self.counts, self.total = edges, [0] * (len(edges) + 1), 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.edges, value)] += 1
        self.total += value

    def family(self, name: str, help: str, model_name: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, help, labels=["model_name"])
        cumulative = list(itertools.accumulate(self.counts))
        family.add_metric([model_name], [(str(float(e)), n) for e, n in zip(self.edges,
                                                                            cumulative)]
                          + [("+Inf", cumulative[-1])], self.total)
        return family


class HandCounted(Collector):
    """Series counted as plain numbers on the hot path: generated tokens (by is_streaming) and
    inter-token latency per token, accepted requests per request."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.accepted = 0
        self.generated = {False: 0, True: 0}
        self.itl = BucketCounts(ITL_BUCKETS)

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        accepted = CounterMetricFamily("minisgl_requests", "Requests accepted",
                                       labels=["model_name"])
        accepted.add_metric([self.model_name], self.accepted)
        yield accepted
        family = CounterMetricFamily("sglang:generation_tokens", "Number of generation tokens "
                                     "processed.", labels=["model_name", "is_streaming"])
        for streaming, count in self.generated.items():
            family.add_metric([self.model_name, streaming_label(streaming)], count)
        yield family
        yield self.itl.family("sglang:inter_token_latency_seconds", "Histogram of inter-token "
                              "latency in seconds.", self.model_name)


class Metrics:
    """What the request manager observes, per request and per token."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self._scheduler: _SchedulerCollector | None = None
        self.recent_ttft: deque[tuple[float, float]] = deque(maxlen=RECENT_MAX)
        self.recent_itl: deque[tuple[float, float]] = deque(maxlen=RECENT_MAX)
        r, labels, by_mode = self.registry, ["model_name"], ["model_name", "is_streaming"]
        self._prompt_tokens = Counter("sglang:prompt_tokens", "Number of prefill tokens "
                                      "processed.", by_mode, registry=r)
        self._cached_tokens = Counter("sglang:cached_tokens", "Number of cached prompt tokens "
                                      "by source.", ["model_name", "cache_source"], registry=r)
        self._finished = Counter("sglang:num_requests", "Number of requests processed.",
                                 by_mode, registry=r)
        self._aborted = Counter("sglang:num_aborted_requests", "Number of requests aborted.",
                                labels, registry=r)
        self._structured = Counter("sglang:num_so_requests", "Number of structured output "
                                   "requests processed.", labels, registry=r)
        self._ttft = Histogram("sglang:time_to_first_token_seconds", "Histogram of time to "
                               "first token in seconds.", by_mode, buckets=TTFT_BUCKETS,
                               registry=r)
        # per request: (finished - first token) / (completion tokens - 1), under SGLang's
        # older name (its production-metrics page) and its newer one
        self._tpot = [Histogram(name, "Per-request time per output token in seconds.",
                                by_mode, buckets=ITL_BUCKETS, registry=r)
                      for name in ("sglang:time_per_output_token_seconds",
                                   "sglang:request_time_per_output_token_seconds")]
        self._e2e = Histogram("sglang:e2e_request_latency_seconds", "Histogram of end-to-end "
                              "request latency in seconds.", by_mode, buckets=E2E_BUCKETS,
                              registry=r)
        self._prompt_lengths = Histogram("sglang:prompt_tokens_histogram", "Histogram of "
                                         "prompt token length.", labels,
                                         buckets=LENGTH_BUCKETS, registry=r)
        self._output_lengths = Histogram("sglang:generation_tokens_histogram", "Histogram of "
                                         "generation token length.", labels,
                                         buckets=LENGTH_BUCKETS, registry=r)
        # NOTE: label children bound once (.labels() per token would cost a lookup chain), and
        # all at start, so that every series is there from the first scrape
        self._by_mode = {streaming: self._bind(streaming_label(streaming)) for streaming in
                         (False, True)}
        self.counted = HandCounted(model_name)
        self.registry.register(self.counted)
        self._aborted_child = self._aborted.labels(model_name)
        self._structured_child = self._structured.labels(model_name)
        self._cached_child = self._cached_tokens.labels(model_name, "device")
        self._prompt_lengths_child = self._prompt_lengths.labels(model_name)
        self._output_lengths_child = self._output_lengths.labels(model_name)

    def _bind(self, mode: str) -> dict[str, Any]:
        name = self.model_name
        return {"prompt": self._prompt_tokens.labels(name, mode),
                "finished": self._finished.labels(name, mode),
                "ttft": self._ttft.labels(name, mode),
                "tpot": [h.labels(name, mode) for h in self._tpot],
                "e2e": self._e2e.labels(name, mode)}

    def watch_scheduler(self, state: Callable[[], dict[str, Any]],
                        gen_throughput: Callable[[], float]) -> None:
        """Report the scheduler's gauges, read from `state()` at each scrape (replacing the
        previous watch: one server at a time reports a runtime)."""
        if self._scheduler is not None:
            self.registry.unregister(self._scheduler)
        self._scheduler = _SchedulerCollector(state, self.model_name, gen_throughput)
        self.registry.register(self._scheduler)

    @property
    def requests(self) -> int:
        """Requests accepted (minisgl_requests_total)."""
        return self.counted.accepted

    def on_submit(self) -> None:
        self.counted.accepted += 1

    def on_first_token(self, streaming: bool, ttft: float, prompt_tokens: int,
                       cached_tokens: int, now: float) -> None:
        """The prompt was processed: count its tokens once, here rather than at the end."""
        series = self._by_mode[streaming]
        series["ttft"].observe(ttft)
        series["prompt"].inc(prompt_tokens)
        self.counted.generated[streaming] += 1
        self._cached_child.inc(cached_tokens)
        self.recent_ttft.append((now, ttft))

    def on_next_token(self, streaming: bool, gap: float, now: float) -> None:
        """`now`: time.perf_counter() when the token arrived (the caller's clock reading)."""
        self.counted.generated[streaming] += 1
        self.counted.itl.observe(gap)
        self.recent_itl.append((now, gap))

    def on_finish(self, streaming: bool, e2e: float, decode_seconds: float | None,
                  prompt_tokens: int, completion_tokens: int, aborted: bool,
                  structured: bool) -> None:
        series = self._by_mode[streaming]
        series["finished"].inc()
        series["e2e"].observe(e2e)
        if decode_seconds is not None and completion_tokens > 1:
            for tpot in series["tpot"]:
                tpot.observe(decode_seconds / (completion_tokens - 1))
        self._prompt_lengths_child.observe(prompt_tokens)
        self._output_lengths_child.observe(completion_tokens)
        if aborted:
            self._aborted_child.inc()
        if structured:
            self._structured_child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def recent(self, window_s: float) -> tuple[list[float], list[float]]:
        """TTFTs and inter-token latencies observed in the last `window_s` seconds."""
        since = time.perf_counter() - window_s
        return ([v for t, v in self.recent_ttft if t >= since],
                [v for t, v in self.recent_itl if t >= since])
