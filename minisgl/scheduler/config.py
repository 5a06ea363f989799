"""How the scheduler batches, orders and admits requests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    chunked_prefill_size: int = 8192  # prompt tokens in one prefill batch at most
    schedule_policy: str = "fcfs"  # fcfs | lpm
    disable_radix_cache: bool = False
    disable_overlap_schedule: bool = False
    max_queued_requests: int | None = None
    max_sequences_per_request: int = 1024
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024
