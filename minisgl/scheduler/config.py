"""How the scheduler batches, orders and admits requests. Each field is the flag of the same
name (defaults and meaning: minisgl.args.ServerArgs)."""

from __future__ import annotations

from minisgl.args import flag_config


@flag_config
class SchedulerConfig:
    chunked_prefill_size: int | None  # None: Engine.default_chunked_prefill_size
    schedule_policy: str
    schedule_conservativeness: float
    enable_priority_scheduling: bool
    schedule_low_priority_values_first: bool
    priority_scheduling_preemption_threshold: int
    enable_mixed_chunk: bool
    seed: int  # the random policy's
    disable_radix_cache: bool
    hicache_write_policy: str
    disable_overlap_schedule: bool
    num_continuous_decode_steps: int | None  # None: AUTO_DECODE_STEPS for a lone request
    speculative_always_draft: bool
    max_queued_requests: int | None
    max_sequences_per_request: int
    max_stop_strings: int
    max_stop_string_length: int
