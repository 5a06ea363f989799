"""How the scheduler batches, orders and admits requests."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_CHUNK = 8192
# NOTE: measured (BENCHMARKS.md, "Mixed chunked prefill"): on CPU a mixed step costs about as
# much as its prefill chunk, so the chunk bounds the running streams' inter-token stall; 256
# cuts the p99 4-5x for ~3% output tok/s. Unmixed, prefill runs first anyway and a small chunk
# would only add per-step overhead.
CPU_MIXED_CHUNK = 256
# NOTE: glibc serves an allocation above 32 MiB (its largest mmap threshold) with a fresh
# mapping, so a prefill step whose activations are wider page-faults them in anew at every
# layer: 8192-row gate/up projections of the bundled model (50 MB out) measured 1.8x (int8)
# and 1.4x (bf16) slower per row than 4096-row ones (BENCHMARKS.md). On CPU the default chunk
# keeps the widest activation, the merged gate/up output, under that size.
CPU_ALLOCATION_LIMIT = 32 << 20
CPU_SMALLEST_CHUNK = 1024


def default_chunk(device_type: str, mixed: bool, widest_row_bytes: int) -> int:
    """`widest_row_bytes`: one token's widest activation (gate/up output) on this rank."""
    if device_type != "cpu":
        return DEFAULT_CHUNK
    if mixed:
        return CPU_MIXED_CHUNK
    chunk = DEFAULT_CHUNK
    while chunk > CPU_SMALLEST_CHUNK and chunk * widest_row_bytes > CPU_ALLOCATION_LIMIT:
        chunk //= 2
    return chunk


@dataclass(frozen=True)
class SchedulerConfig:
    chunked_prefill_size: int | None = None  # prompt tokens in one prefill batch at most
    schedule_policy: str = "fcfs"  # fcfs | lpm | lof | random
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    enable_mixed_chunk: bool = False
    seed: int = 0  # the random policy's
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    max_queued_requests: int | None = None
    max_sequences_per_request: int = 1024
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024
