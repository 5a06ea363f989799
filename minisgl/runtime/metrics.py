"""Counters and latency histograms, rendered in the Prometheus text format."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.2, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help: str, labels: str) -> list[str]:
        lines = [f"# HELP {name} {help}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip((*map(str, self.buckets), "+Inf"), self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{{labels},le="{bound}"}} {cumulative}')
        lines += [f"{name}_sum{{{labels}}} {self.total}",
                  f"{name}_count{{{labels}}} {self.count}"]
        return lines


class Metrics:
    def __init__(self) -> None:
        self.requests = 0
        self.finished = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def on_submit(self) -> None:
        self.requests += 1

    def on_token(self, first: bool, since_previous: float) -> None:
        (self.ttft if first else self.itl).observe(since_previous)

    def on_finish(self, latency: float) -> None:
        self.finished += 1
        self.e2e.observe(latency)

    def render(self, state: dict[str, Any], model_name: str) -> str:
        """The Prometheus text format; every series carries a model_name label."""
        escaped = model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        labels = f'model_name="{escaped}"'
        gauges = {
            "num_running_reqs": "Requests being decoded or prefilled",
            "num_waiting_reqs": "Requests waiting for admission",
            "kv_usage": "Fraction of KV pool pages in use",
            "kv_used_tokens": "KV pool tokens in use",
            "cache_hit_rate": "Prompt tokens served from the prefix cache / prompt tokens",
        }
        counters = {
            "prompt_tokens": "Prompt tokens received",
            "generated_tokens": "Tokens generated",
            "cached_prompt_tokens": "Prompt tokens served from the prefix cache",
            "retractions": "Requests sent back to the waiting queue for lack of KV pages",
            "preemptions": "Running requests sent back to the waiting queue for a more urgent one",
            "engine_decode_steps": "Decode steps run",
            "engine_decode_seconds": "Seconds in decode steps (CPU: compute; CUDA: launch only)",
            "engine_prefill_steps": "Prefill steps run",
            "engine_prefill_seconds": "Seconds in prefill steps (CPU: compute; CUDA: launch only)",
            "engine_mixed_steps": "Mixed steps run (a prefill chunk with the running decodes)",
            "engine_mixed_seconds": "Seconds in mixed steps (CPU: compute; CUDA: launch only)",
        }
        lines = []
        for key, help in gauges.items():
            lines += [f"# HELP minisgl_{key} {help}", f"# TYPE minisgl_{key} gauge",
                      f"minisgl_{key}{{{labels}}} {state[key]}"]
        for key, help in counters.items():
            lines += [f"# HELP minisgl_{key}_total {help}", f"# TYPE minisgl_{key}_total counter",
                      f"minisgl_{key}_total{{{labels}}} {state[key]}"]
        lines += ["# HELP minisgl_requests_total Requests accepted",
                  "# TYPE minisgl_requests_total counter",
                  f"minisgl_requests_total{{{labels}}} {self.requests}"]
        for histogram, name, help in (
                (self.ttft, "time_to_first_token_seconds", "Time to first token"),
                (self.itl, "inter_token_latency_seconds", "Inter-token latency"),
                (self.e2e, "e2e_request_latency_seconds", "End-to-end latency")):
            lines += histogram.render(f"minisgl_{name}", help, labels)
        return "\n".join(lines) + "\n"
