"""What an engine is built from: the model, its precision and device, memory and parallelism.
Each field is the flag of the same name (defaults and meaning: minisgl.args.ServerArgs)."""

from __future__ import annotations

from minisgl.args import flag_config


@flag_config
class EngineConfig:
    model_path: str | None  # None: the bundled SmolLM2
    json_model_override_args: str | None
    load_format: str
    quantization: str | None  # None: engine.quantization's default
    cpu_int8_activations: bool
    dtype: str
    device: str
    tp_size: int
    context_length: int | None
    max_running_requests: int | None
    max_total_tokens: int | None
    mem_fraction_static: float | None
    page_size: int | None
    attention_backend: str | None
    cuda_graph_max_bs: int
    disable_cuda_graph: bool
    seed: int  # sampling and dummy weights
    speculative_algorithm: str | None
    speculative_num_draft_tokens: int | None  # None: engine.speculation's device default
    speculative_ngram_min_match_window_size: int
    speculative_ngram_max_match_window_size: int
    speculative_draft_model_path: str | None
    speculative_draft_model_quantization: str | None
    speculative_always_draft: bool  # NGRAM on CPU: no draft budget either (engine.draft_budget)
    enable_lora: bool
    lora_paths: list[str] | None
    max_loras_per_batch: int
    max_lora_rank: int | None
    lora_target_modules: list[str] | None
    max_loaded_loras: int | None
    log_level: str  # of the tensor-parallel worker processes
