"""What an engine is built from: the model, its precision and device, memory and parallelism."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # None: the bundled SmolLM2
    json_model_override_args: str | None = None
    load_format: str = "auto"  # auto | dummy
    # gguf | w8a8_int8 | fp8 | none; None: engine.quantization's default
    quantization: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    tp_size: int = 1
    context_length: int | None = None
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    page_size: int | None = None
    attention_backend: str | None = None
    cuda_graph_max_bs: int = 160
    disable_cuda_graph: bool = False
    seed: int = 0  # dummy weights
    log_level: str = "info"  # of the tensor-parallel worker processes
