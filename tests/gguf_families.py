"""A GGUF file of a transformers model of a family llama.cpp covers, written here as
llama.cpp's converter lays it out (its tensor names, experts stacked per layer, the metadata
keys its loader reads) with the bundled SmolLM2 file's tokenizer: the GGUF route of a new
family without a download. Only Qwen3-MoE so far (llama.cpp's `qwen3moe`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import (
    MODEL_ARCH,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    get_tensor_name_map,
    quants,
)

from minisgl.models.weights import bundled_gguf


def write_qwen3moe_gguf(model: torch.nn.Module, path: Path,
                        linears: GGMLQuantizationType | None = None) -> Path:
    """`model` (transformers' Qwen3MoeForCausalLM, vocabulary 49152: SmolLM2's tokenizer) as
    a GGUF file at `path`: F32, or with `linears` (Q4_0, Q8_0: types the gguf package
    encodes) for every layer's projections and experts."""
    config = model.config
    experts = config.num_local_experts if hasattr(config, "num_local_experts") else (
        config.num_experts)
    layers = config.num_hidden_layers
    writer = GGUFWriter(str(path), "qwen3moe")
    writer.add_name("tiny-qwen3moe")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    tokenizer = GGUFReader(str(bundled_gguf()))
    for key, field in tokenizer.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(key, field.contents(), kind,
                                 sub_type=field.types[1] if kind == GGUFValueType.ARRAY else None)
    names = get_tensor_name_map(MODEL_ARCH.QWEN3MOE, layers)
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    for layer in range(layers):  # transformers 5 holds each layer's experts stacked
        prefix = f"model.layers.{layer}.mlp.experts."
        gate, up = np.split(state.pop(prefix + "gate_up_proj"), 2, axis=1)
        for part, stacked in (("gate", gate), ("up", up), ("down", state.pop(prefix + "down_proj"))):
            add(writer, f"blk.{layer}.ffn_{part}_exps.weight", np.ascontiguousarray(stacked),
                linears)
    for name, value in state.items():
        base, _, suffix = name.rpartition(".")
        add(writer, f"{names.get_name(base)}.{suffix}", value,
            linears if name.endswith("proj.weight") else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add(writer: GGUFWriter, name: str, value: np.ndarray,
        kind: GGMLQuantizationType | None) -> None:
    if kind is None:
        writer.add_tensor(name, value)
    else:
        data = quants.quantize(value, kind)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)
