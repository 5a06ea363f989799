"""How the scheduler batches, orders and admits requests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    chunked_prefill_size: int = 8192  # prompt tokens in one prefill batch at most
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
