"""A model built on its device with its weights, and the attention backend over its KV pool:
the target's, and a STANDALONE draft model's (which must share the target's vocabulary)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from minisgl.attention import create_attention_backend, default_attention_backend
from minisgl.attention.base import AttentionBackend
from minisgl.engine.config import EngineConfig
from minisgl.kvcache import KVLayout, KVPool
from minisgl.layers.linear import can_prepack
from minisgl.layers.quant import activation_terms
from minisgl.models import (
    ModelArch,
    build_model,
    check_supported,
    load_config,
    load_weights,
    log_weight_memory,
    resolve_model_path,
)


def load_model(arch: ModelArch, folder: Path, quantization: str, dtype: torch.dtype,
               device: torch.device, *, load_format: str, seed: int, model_path: str | None,
               log: bool, terms: int = 2) -> torch.nn.Module:
    """The model of `arch` (this thread's TP shard) with its weights, prepacked for the CPU
    kernels where they run (their activations in `terms` int8 terms: layers.quant)."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(arch)
    finally:
        torch.set_default_dtype(default_dtype)
    with activation_terms(terms):
        load_weights(model, folder, arch, quantization, dtype, device, load_format=load_format,
                     seed=seed, model_path=model_path)
    if can_prepack(next(model.parameters())):
        for module in model.modules():
            if hasattr(module, "prepack_for_cpu"):
                module.prepack_for_cpu()
    if log:
        log_weight_memory(model, quantization, dtype)
    return model.eval()


def first_attention(model: torch.nn.Module) -> torch.nn.Module:
    """The first layer's attention that keeps KV (a hybrid's first layers may not)."""
    return next(layer.self_attn for layer in model.layers if hasattr(layer, "self_attn"))


def kv_layout(model: torch.nn.Module, arch: ModelArch) -> KVLayout:
    """The KV pool's layer shapes on this rank: the model's own where its layers differ
    (Gemma 4), else every KV layer with the first attention's KV heads and the head size."""
    own = getattr(model, "kv_layout", None)
    if own is not None:
        return own()
    heads = first_attention(model).qkv_proj.num_kv_heads
    return KVLayout.uniform(arch.kv_layers, heads, arch.head_dim)


def attention_for(name: str | None, arch: ModelArch, model: torch.nn.Module, pool: KVPool,
                  page_table: torch.Tensor, device: torch.device, dtype: torch.dtype
                  ) -> AttentionBackend:
    """`--attention-backend` `name` (None: the default for the device, dtype and model)."""
    windows = arch.layer_windows if arch.sliding_window else ()
    softcap = arch.attn_logit_softcap
    if name == "flashinfer" and arch.attention_sinks:
        raise ValueError("--attention-backend flashinfer: this model's attention sinks are not "
                         "in minisgl's FlashInfer path; use --attention-backend torch")
    own_layout = len(pool.buffers) > 1 or pool.layout.latent > 0
    if name == "flashinfer" and own_layout:
        raise ValueError("--attention-backend flashinfer: this model's KV layout (head sizes "
                         "that differ by layer, or latent attention) is not in minisgl's "
                         "FlashInfer path; use --attention-backend torch")
    name = name or ("torch" if own_layout else default_attention_backend(
        device, dtype, arch.largest_head_dim, arch.attention_sinks))
    options = ({"num_qo_heads": first_attention(model).qkv_proj.num_heads}
               if name == "flashinfer" else {})
    return create_attention_backend(name, pool, page_table, arch.head_dim ** -0.5, windows,
                                    softcap, **options)


def draft_arch(config: EngineConfig, target: ModelArch, context_len: int
               ) -> tuple[Path, ModelArch] | None:
    """STANDALONE's draft model folder and shape (served at the target's context), checked
    before any weights load: ValueError if its vocabulary is not the target's."""
    path = config.speculative_draft_model_path
    if config.speculative_algorithm != "STANDALONE" or path is None:
        return None
    folder = resolve_model_path(path)
    arch = ModelArch.from_config(load_config(folder))
    check_supported(arch)
    if arch.vocab_size != target.vocab_size:
        raise ValueError(f"--speculative-draft-model-path {path}: its vocabulary has "
                         f"{arch.vocab_size} tokens, the target's {target.vocab_size}; a draft "
                         "model must share the target's tokenizer")
    return folder, dataclasses.replace(arch, served_context=context_len)
