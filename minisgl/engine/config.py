"""What an engine is built from: the model, its precision and device, memory and parallelism.
Each field is the flag of the same name (defaults and meaning: minisgl.args.ServerArgs).

The flags leave some values open (None, "auto"): the device's defaults, the model's context,
the quantization a file implies. `resolve` settles them once, before anything is built, into
the EngineConfig every part of the engine reads; the KV pool's size (`max_total_tokens`)
follows once the weights are loaded (Engine.config then holds it too)."""

from __future__ import annotations

import dataclasses

import torch

from minisgl.args import device_default, flag_config
from minisgl.attention import default_attention_backend
from minisgl.engine.placement import resolve_dtype, resolve_kv_cache_dtype
from minisgl.engine.quantization import resolve_quantization
from minisgl.models import ModelArch


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
    kv_cache_dtype: str  # resolved: the torch dtype's name of the pages
    disable_radix_cache: bool
    enable_hierarchical_cache: bool
    hicache_ratio: float
    hicache_size: int
    hicache_storage_backend: str | None
    hicache_storage_dir: str | None
    hicache_storage_backend_extra_config: str | None
    max_mamba_cache_size: int | None  # hybrids: the state pool's rows (requests + snapshots)
    mamba_ssm_dtype: str  # hybrids: the recurrent states' dtype between steps
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


def resolve(config: EngineConfig, device: torch.device, arch: ModelArch) -> EngineConfig:
    """`config` with every value it left open settled for `device` and the model `arch`
    (a resolved config resolves to itself)."""
    dtype = resolve_dtype(config.dtype, device)
    dtype_chosen = config.dtype != "auto"  # NOTE: `auto` may pick float32 and GGUF blocks

    def quantization_of(method: str | None, model: str | None) -> str:
        return resolve_quantization(method, model, device, dtype, config.load_format,
                                    dtype_chosen=dtype_chosen)

    def default(name: str) -> object:
        value = getattr(config, name)
        return device_default(name, device.type) if value is None else value

    draft = config.speculative_draft_model_path
    max_running = int(default("max_running_requests"))  # type: ignore[call-overload]
    return dataclasses.replace(
        config, device=device.type, dtype=str(dtype).removeprefix("torch."),
        kv_cache_dtype=str(resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
                           ).removeprefix("torch."),
        quantization=quantization_of(config.quantization, config.model_path),
        context_length=arch.context_limit(config.context_length),
        max_running_requests=max_running, page_size=default("page_size"),
        max_mamba_cache_size=state_rows(config, arch, max_running),
        mem_fraction_static=default("mem_fraction_static"),
        attention_backend=config.attention_backend or default_attention_backend(
            device, dtype, arch.largest_head_dim, arch.attention_sinks),
        speculative_num_draft_tokens=(None if config.speculative_algorithm is None
                                      else default("speculative_num_draft_tokens")),
        speculative_draft_model_quantization=(
            None if config.speculative_algorithm != "STANDALONE" or draft is None
            else quantization_of(config.speculative_draft_model_quantization, draft)))


def state_rows(config: EngineConfig, arch: ModelArch, max_running: int) -> int | None:
    """A hybrid model's recurrent states in all (--max-mamba-cache-size): one per running
    request, the rest the prefix cache's snapshots (none without a prefix cache)."""
    if not arch.is_hybrid:
        return config.max_mamba_cache_size
    if config.disable_radix_cache:
        return max_running
    total = config.max_mamba_cache_size
    if total is None:
        return 2 * max_running
    if total < max_running:
        raise ValueError(f"--max-mamba-cache-size {total} is below --max-running-requests "
                         f"{max_running}: every running request holds a state")
    return total
