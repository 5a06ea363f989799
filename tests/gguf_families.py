"""A GGUF file of a transformers model of a family llama.cpp covers, written here as
llama.cpp's converter lays it out (its tensor names, experts stacked per layer, the metadata
keys its loader reads) with the bundled SmolLM2 file's tokenizer: the GGUF route of a new
family without a download: Qwen3-MoE (llama.cpp's `qwen3moe`), Granite 4.0-H
(`granitehybrid`, with what llama.cpp's converter changes in a Mamba2 layer's tensors), the
Qwen hybrids and Nemotron-H (`nemotron_h`, `nemotron_h_moe`), SmolLM3, gpt-oss and DeepSeek
(`deepseek2`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import (
    MODEL_ARCH,
    ExpertGatingFuncType,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    RopeScalingType,
    get_tensor_name_map,
)

from minisgl.models.weights import bundled_gguf
from tests.gguf_requant import encode


def write_qwen3moe_gguf(model: torch.nn.Module, path: Path,
                        linears: GGMLQuantizationType | None = None) -> Path:
    """`model` (transformers' Qwen3MoeForCausalLM, vocabulary 49152: SmolLM2's tokenizer) as
    a GGUF file at `path`: F32, or with `linears` (Q4_0, Q8_0: types the gguf package
    encodes) for every layer's projections and experts."""
    config = model.config
    experts = config.num_local_experts if hasattr(config, "num_local_experts") else (
        config.num_experts)
    layers = config.num_hidden_layers
    writer = decoder_writer(path, "qwen3moe", config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    copy_tokenizer(writer)
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
    finish(writer)
    return path


def decoder_writer(path: Path, architecture: str, config: Any) -> GGUFWriter:
    """A writer for `architecture` at `path` with the keys every Llama-like decoder's file
    has: its depth, context, widths and head counts."""
    writer = GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    return writer


def copy_tokenizer(writer: GGUFWriter) -> None:
    """The bundled SmolLM2 file's tokenizer (vocabulary 49152)."""
    tokenizer = GGUFReader(str(bundled_gguf()))
    for key, field in tokenizer.fields.items():
        if key.startswith("tokenizer."):
            kind = field.types[0]
            writer.add_key_value(key, field.contents(), kind,
                                 sub_type=field.types[1] if kind == GGUFValueType.ARRAY else None)


def finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def permute_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q / k row permutation for Llama-style rotary (halves interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def write_granite_hybrid_gguf(folder: Path, path: Path,
                              linears: GGMLQuantizationType | None = None) -> Path:
    """The checkpoint saved in `folder` (transformers' GraniteMoeHybridForCausalLM, its Hub
    tensor names; SmolLM2's vocabulary) as llama.cpp's
    converter writes it: per-layer KV head counts (0 for a Mamba2 layer), Granite's multipliers
    under llama.cpp's names, A as -exp(A_log), the convolution squeezed, D as [heads, 1], the
    gated norm as [groups, inner / groups], q / k rows permuted, the fused gate / up split;
    F32, or with `linears` for every projection and expert."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    layers, hidden = config.num_hidden_layers, config.hidden_size
    mamba = [kind not in ("attention", "full_attention") for kind in config.layer_types]
    experts = config.num_local_experts
    inner = config.mamba_expand * hidden
    writer = GGUFWriter(str(path), "granitehybrid")
    writer.add_name("tiny-granite-hybrid")
    writer.add_block_count(layers)
    writer.add_context_length(2 ** 20)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([0 if m else config.num_key_value_heads for m in mamba])
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(hidden // config.num_attention_heads)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_logit_scale(config.logits_scaling)
    writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_group_count(config.mamba_n_groups)
    writer.add_ssm_inner_size(inner)
    writer.add_ssm_time_step_rank(config.mamba_n_heads)
    writer.add_rope_scaling_finetuned(config.position_embedding_type == "rope")
    copy_tokenizer(writer)
    names = get_tensor_name_map(MODEL_ARCH.GRANITE_HYBRID, layers)
    state = load_file(folder / "model.safetensors")
    state.pop("lm_head.weight" if config.tie_word_embeddings else "", None)
    shared = "_shexp" if experts else ""
    for name, value in state.items():
        base, _, suffix = name.rpartition(".")
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        kind = None
        if name.endswith("input_linear.weight"):  # gate and up, fused: llama.cpp splits them
            gate, up = np.split(value, 2, axis=-2)
            moe = "block_sparse_moe" in name
            for part, half in (("gate", gate), ("up", up)):
                add(writer, f"blk.{layer}.ffn_{part}{'_exps' if moe else shared}.weight",
                    np.ascontiguousarray(half), linears)
            continue
        if name.endswith("output_linear.weight"):
            moe = "block_sparse_moe" in name
            add(writer, f"blk.{layer}.ffn_down{'_exps' if moe else shared}.weight", value,
                linears)
            continue
        if name.endswith("router.layer.weight"):
            add(writer, f"blk.{layer}.ffn_gate_inp.weight", value, None)
            continue
        if name.endswith(".dt_bias"):
            add(writer, f"blk.{layer}.ssm_dt.bias", value, None)
            continue
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if name.endswith(".A_log"):
            gguf_name, value = f"blk.{layer}.ssm_a", -np.exp(value)[:, None]
        elif name.endswith(".D"):
            gguf_name, value = f"blk.{layer}.ssm_d", value[:, None]
        elif name.endswith("conv1d.weight"):
            value = value[:, 0, :]
        elif name.endswith("mamba.norm.weight"):
            value = value.reshape(config.mamba_n_groups, -1)
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            value = permute_rows(value, config.num_attention_heads if "q_proj" in name
                                 else config.num_key_value_heads)
        kind = linears if name.endswith("proj.weight") and "conv" not in name else None
        add(writer, gguf_name, np.ascontiguousarray(value), kind)
    finish(writer)
    return path


def add(writer: GGUFWriter, name: str, value: np.ndarray,
        kind: GGMLQuantizationType | None) -> None:
    if kind is None:
        writer.add_tensor(name, value)
    else:
        data = encode(value, kind)  # the k-quants too
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)


QWEN_ARCHITECTURES = {"qwen3_5_text": ("qwen35", MODEL_ARCH.QWEN35),
                      "qwen3_5_moe_text": ("qwen35moe", MODEL_ARCH.QWEN35MOE),
                      "qwen3_next": ("qwen3next", MODEL_ARCH.QWEN3NEXT)}


def tiled_rows(values: np.ndarray, keys: int, heads: int, width: int, axis: int = 0
               ) -> np.ndarray:
    """llama.cpp's Qwen3.5 value-head order: from grouped by key head to tiled over them."""
    shape = list(values.shape)
    grouped = values.reshape(*shape[:axis], keys, heads // keys, width, *shape[axis + 1:])
    return np.swapaxes(grouped, axis, axis + 1).reshape(shape)


def write_qwen_hybrid_gguf(folder: Path, path: Path,
                           linears: GGMLQuantizationType | None = None,
                           gate_blocks: bool = False) -> Path:
    """The checkpoint saved in `folder` (transformers' Qwen3.5, Qwen3.5-MoE or Qwen3-Next, its
    tensor names; SmolLM2's vocabulary) as llama.cpp's converter writes it (without the
    multi-token predictor): the decoder norms as 1 + w, A as -exp(A_log), the convolution
    squeezed; Qwen3-Next's in_proj_qkvz split into q, k, v and z over all heads; Qwen3.5's
    value heads tiled over the key heads (in_proj_qkv's v rows, in_proj_z, in_proj_a / b,
    A_log, dt_bias, the convolution's v channels, out_proj's columns); experts stacked. F32,
    or with `linears` for every projection and expert; `gate_blocks`: in_proj_a / in_proj_b
    too (F32 as the converter writes them; llama-quantize quantizes them)."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    architecture, arch = QWEN_ARCHITECTURES[config.model_type]
    layers, hidden, head_dim = config.num_hidden_layers, config.hidden_size, config.head_dim
    keys, values = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    tiled = architecture != "qwen3next" and keys != values
    writer = decoder_writer(path, architecture, config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    experts = getattr(config, "num_experts", 0)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(dk)
    writer.add_ssm_group_count(keys)
    writer.add_ssm_time_step_rank(values)
    writer.add_ssm_inner_size(dv * values)
    # NOTE: a key newer than the gguf package's writer methods
    writer.add_array(f"{architecture}.attention.recurrent_layers",
                     [kind == "linear_attention" for kind in config.layer_types])
    writer.add_full_attention_interval(getattr(config, "full_attention_interval", 4))
    writer.add_rope_dimension_count(int(head_dim * config.rope_parameters["partial_rotary_factor"]))
    if architecture != "qwen3next":
        writer.add_rope_dimension_sections([11, 11, 10, 0])
    copy_tokenizer(writer)
    names = get_tensor_name_map(arch, layers)
    state = load_file(folder / "model.safetensors")
    state.pop("lm_head.weight" if config.tie_word_embeddings else "", None)
    for layer in range(layers):  # per-expert tensors, stacked as llama.cpp stacks them
        for part in ("gate", "up", "down") if experts else ():
            stacked = np.stack([state.pop(f"model.layers.{layer}.mlp.experts.{e}.{part}_proj.weight")
                                for e in range(experts)])
            add(writer, f"blk.{layer}.ffn_{part}_exps.weight", stacked, linears)

    def head_rows(value: np.ndarray, width: int, axis: int = 0) -> np.ndarray:
        return tiled_rows(value, keys, values, width, axis) if tiled else value

    for name, value in state.items():
        base, _, suffix = name.rpartition(".")
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.endswith("in_proj_qkvz.weight"):  # per key head [q, k, v, z] -> over all heads
            per_head = value.reshape(keys, -1, hidden)
            q, k, v, z = np.split(per_head, np.cumsum([dk, dk, dv * values // keys]), axis=1)
            qkv = np.concatenate([q.reshape(-1, hidden), k.reshape(-1, hidden),
                                  v.reshape(-1, hidden)])
            add(writer, f"blk.{layer}.attn_qkv.weight", qkv, linears)
            add(writer, f"blk.{layer}.attn_gate.weight", z.reshape(-1, hidden), linears)
            continue
        if name.endswith("in_proj_ba.weight"):
            add(writer, f"blk.{layer}.ssm_ba.weight", value, None)
            continue
        if name.endswith(".dt_bias"):
            add(writer, f"blk.{layer}.ssm_dt.bias", head_rows(value, 1), None)
            continue
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if name.endswith(".A_log"):
            gguf_name, value = f"blk.{layer}.ssm_a", head_rows(-np.exp(value), 1)
        elif name.endswith("conv1d.weight"):
            value = value[:, 0, :]
            qk = 2 * keys * dk
            value = np.concatenate([value[:qk], head_rows(value[qk:], dv)])
        elif name.endswith("norm.weight") and ".linear_attn.norm." not in name:
            value = value + 1.0
        elif name.endswith("in_proj_qkv.weight"):
            value = np.concatenate([value[:2 * keys * dk], head_rows(value[2 * keys * dk:], dv)])
        elif name.endswith("shared_expert_gate.weight"):
            value = value.reshape(-1)  # llama.cpp's shape for it, {n_embd}
        elif name.endswith("in_proj_z.weight"):
            value = head_rows(value, dv)
        elif name.endswith(("in_proj_a.weight", "in_proj_b.weight")):
            value = head_rows(value, 1)
        elif name.endswith("linear_attn.out_proj.weight"):
            value = head_rows(value, dv, axis=1)
        gates = name.endswith(("in_proj_a.weight", "in_proj_b.weight"))
        kind = linears if (gate_blocks and gates) or (not gates and name.endswith(
            ("proj.weight", "in_proj_qkv.weight", "in_proj_z.weight"))) else None
        add(writer, gguf_name, np.ascontiguousarray(value), kind)
    finish(writer)
    return path


def write_nemotron_h_gguf(folder: Path, path: Path,
                          linears: GGMLQuantizationType | None = None,
                          experts: GGMLQuantizationType | None = None) -> Path:
    """The checkpoint saved in `folder` (transformers' NemotronHForCausalLM, its Hub names
    under `backbone.`; SmolLM2's vocabulary) as llama.cpp's converter writes it: `nemotron_h`,
    or `nemotron_h_moe` with experts (their routing in the expert_* keys, the experts
    stacked, the correction bias as exp_probs_b); per-layer KV heads and MLP widths (0 where a
    layer has none); the Mamba2 tensors as for Granite (A as -exp(A_log), D as [heads, 1],
    the convolution squeezed, the gated norm as [groups, inner / groups]); q / k rows
    permuted as for Llama's rotary halves. F32, or with `linears` for every projection and
    `experts` (by default `linears`) for the experts."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    kinds = list(config.layers_block_type)
    layers, hidden = len(kinds), config.hidden_size
    moe = "moe" in kinds
    architecture = "nemotron_h_moe" if moe else "nemotron_h"
    writer = GGUFWriter(str(path), architecture)
    writer.add_name(f"tiny-{architecture}")
    writer.add_block_count(layers)
    writer.add_context_length(2 ** 20)
    writer.add_embedding_length(hidden)
    # NOTE: as the converter does, a MoE file gives its plain MLP layers width 0
    width = ({"moe": config.moe_intermediate_size} if moe else
             {"mlp": config.intermediate_size})
    writer.add_feed_forward_length([width.get(kind, 0) for kind in kinds])
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([config.num_key_value_heads if kind == "full_attention" else 0
                              for kind in kinds])
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_ssm_conv_kernel(config.conv_kernel)
    writer.add_ssm_state_size(config.ssm_state_size)
    writer.add_ssm_group_count(config.n_groups)
    writer.add_ssm_inner_size(config.mamba_num_heads * config.mamba_head_dim)
    writer.add_ssm_time_step_rank(config.mamba_num_heads)
    writer.add_rope_scaling_finetuned(False)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if moe:
        writer.add_expert_count(config.n_routed_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.moe_shared_expert_intermediate_size)
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_expert_weights_norm(config.norm_topk_prob)
        writer.add_expert_weights_scale(config.routed_scaling_factor)
    copy_tokenizer(writer)
    state = load_file(folder / "model.safetensors")
    tables = {"backbone.embeddings.weight": "token_embd.weight",
              "backbone.norm_f.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for layer, kind in enumerate(kinds):
        prefix = f"backbone.layers.{layer}.mixer.experts."
        for part in ("up", "down") if kind == "moe" else ():
            stacked = np.stack([state.pop(f"{prefix}{e}.{part}_proj.weight")
                                for e in range(config.n_routed_experts)])
            add(writer, f"blk.{layer}.ffn_{part}_exps.weight", stacked, experts or linears)
    names = {"norm.weight": "attn_norm.weight", "mixer.in_proj.weight": "ssm_in.weight",
             "mixer.out_proj.weight": "ssm_out.weight", "mixer.conv1d.weight":
             "ssm_conv1d.weight", "mixer.conv1d.bias": "ssm_conv1d.bias",
             "mixer.dt_bias": "ssm_dt.bias", "mixer.A_log": "ssm_a", "mixer.D": "ssm_d",
             "mixer.norm.weight": "ssm_norm.weight", "mixer.q_proj.weight": "attn_q.weight",
             "mixer.k_proj.weight": "attn_k.weight", "mixer.v_proj.weight": "attn_v.weight",
             "mixer.o_proj.weight": "attn_output.weight", "mixer.gate.weight":
             "ffn_gate_inp.weight", "mixer.gate.e_score_correction_bias": "exp_probs_b.bias",
             "mixer.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
             "mixer.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
             "mixer.up_proj.weight": "ffn_up.weight", "mixer.down_proj.weight": "ffn_down.weight"}
    for name, value in state.items():
        if name in tables:
            add(writer, tables[name], value, None)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest.endswith("A_log"):
            value = -np.exp(value)[:, None]
        elif rest.endswith(".D"):
            value = value[:, None]
        elif rest.endswith("conv1d.weight"):
            value = value[:, 0, :]
        elif rest == "mixer.norm.weight":
            value = value.reshape(config.n_groups, -1)
        elif rest.endswith(("q_proj.weight", "k_proj.weight")):
            value = permute_rows(value, config.num_attention_heads if "q_proj" in rest
                                 else config.num_key_value_heads)
        kind = linears if rest.endswith("proj.weight") else None
        add(writer, f"blk.{layer}.{names[rest]}", np.ascontiguousarray(value), kind)
    finish(writer)
    return path


def write_smollm3_gguf(model: torch.nn.Module, path: Path,
                       linears: GGMLQuantizationType | None = None) -> Path:
    """`model` (transformers' SmolLM3ForCausalLM, vocabulary 49152: SmolLM2's tokenizer) as
    llama.cpp's converter writes it (`smollm3`: Llama's tensors, q / k rows permuted; which
    layers go without RoPE is llama.cpp's rule, not in the file): F32, or with `linears` for
    every projection."""
    config = model.config
    layers = config.num_hidden_layers
    writer = decoder_writer(path, "smollm3", config)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    copy_tokenizer(writer)
    names = get_tensor_name_map(MODEL_ARCH.SMOLLM3, layers)
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, value in state.items():
        base, _, suffix = name.rpartition(".")
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            value = permute_rows(value, config.num_attention_heads if "q_proj" in name
                                 else config.num_key_value_heads)
        add(writer, f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(value),
            linears if name.endswith("proj.weight") else None)
    finish(writer)
    return path


def gpt_oss_writer(path: Path, config: Any) -> GGUFWriter:
    """A `gpt-oss` file's writer with llama.cpp's keys for `config` (transformers' GptOssConfig)
    and the bundled tokenizer: the tensors follow."""
    rope = config.rope_parameters
    writer = decoder_writer(path, "gpt-oss", config)
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    copy_tokenizer(writer)
    return writer


def write_gpt_oss_gguf(folder: Path, path: Path,
                       experts: GGMLQuantizationType | None = None) -> Path:
    """The checkpoint saved in `folder` (transformers' GptOssForCausalLM, SmolLM2's vocabulary)
    as llama.cpp's converter writes it from bfloat16 weights (`gpt-oss`): the experts' gate
    and up apart, stacked output-major with their biases; YaRN's keys; q / k rows as they are.
    F32, or with `experts` for the experts' weights."""
    from safetensors.numpy import load_file
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    layers = config.num_hidden_layers
    writer = gpt_oss_writer(path, config)
    names = get_tensor_name_map(MODEL_ARCH.GPT_OSS, layers)
    state = load_file(folder / "model.safetensors")
    for layer in range(layers):
        prefix = f"model.layers.{layer}.mlp."
        gate_up = state.pop(prefix + "experts.gate_up_proj")  # [E, hidden, 2 I], interleaved
        gate_up_bias = state.pop(prefix + "experts.gate_up_proj_bias")
        parts = {"gate": (gate_up[..., 0::2], gate_up_bias[:, 0::2]),
                 "up": (gate_up[..., 1::2], gate_up_bias[:, 1::2]),
                 "down": (state.pop(prefix + "experts.down_proj"),
                          state.pop(prefix + "experts.down_proj_bias"))}
        for part, (weight, bias) in parts.items():
            add(writer, f"blk.{layer}.ffn_{part}_exps.weight",
                np.ascontiguousarray(weight.transpose(0, 2, 1)), experts)
            add(writer, f"blk.{layer}.ffn_{part}_exps.bias", np.ascontiguousarray(bias), None)
        for suffix in ("weight", "bias"):
            add(writer, f"blk.{layer}.ffn_gate_inp.{suffix}",
                state.pop(f"{prefix}router.{suffix}"), None)
        add(writer, f"blk.{layer}.attn_sinks.weight",
            state.pop(f"model.layers.{layer}.self_attn.sinks"), None)
    for name, value in state.items():
        base, _, suffix = name.rpartition(".")
        add(writer, f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(value), None)
    finish(writer)
    return path


def write_deepseek2_gguf(folder: Path, path: Path,
                         linears: GGMLQuantizationType | None = None) -> Path:
    """The checkpoint saved in `folder` (transformers' DeepseekV2/V3ForCausalLM, SmolLM2's
    vocabulary; its config.json's scoring_func as the Hub's configs carry it) as llama.cpp's
    converter writes it (`deepseek2`): one KV head (MLA as MQA), the per-head sizes under
    *_mla, kv_b_proj split into k_b (transposed) and v_b, each layer's experts stacked (saved
    per expert, the Hub's names), the correction bias
    as exp_probs_b, YaRN's mscale_all_dim as 0.1 x it; the rope rows as they are (adjacent
    pairs). F32, or with `linears` for the linear weights and experts (k_b / v_b stay F32,
    as the converter's own type choice keeps them small)."""
    import json

    from safetensors.numpy import load_file
    config = json.loads((folder / "config.json").read_text())
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    latent, rope_dim = config["kv_lora_rank"], config["qk_rope_head_dim"]
    nope, value = config["qk_nope_head_dim"], config["v_head_dim"]
    writer = GGUFWriter(str(path), "deepseek2")
    writer.add_name("tiny-deepseek2")
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(1)
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if config.get("n_group") is not None:
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
    if config.get("scoring_func") == "sigmoid":
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    elif config.get("scoring_func") == "softmax":
        writer.add_expert_gating_func(ExpertGatingFuncType.SOFTMAX)
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_vocab_size(config["vocab_size"])
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(latent)
    writer.add_key_length(latent + rope_dim)
    writer.add_value_length(latent)
    writer.add_key_length_mla(nope + rope_dim)
    writer.add_value_length_mla(value)
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rope_dim)
    copy_tokenizer(writer)
    names = get_tensor_name_map(MODEL_ARCH.DEEPSEEK2, layers)
    state = load_file(folder / "model.safetensors")
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        kv_b = state.pop(prefix + "self_attn.kv_b_proj.weight").reshape(heads, nope + value,
                                                                        latent)
        add(writer, f"blk.{layer}.attn_k_b.weight",
            np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1)), None)
        add(writer, f"blk.{layer}.attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:]), None)
        if layer >= config["first_k_dense_replace"]:  # the experts, as the Hub names them
            for part in ("gate", "up", "down"):
                stacked = np.stack([state.pop(f"{prefix}mlp.experts.{e}.{part}_proj.weight")
                                    for e in range(config["n_routed_experts"])])
                add(writer, f"blk.{layer}.ffn_{part}_exps.weight", stacked, linears)
        bias = state.pop(prefix + "mlp.gate.e_score_correction_bias", None)
        if bias is not None:
            add(writer, f"blk.{layer}.exp_probs_b.bias", bias, None)
    for name, tensor in state.items():
        base, _, suffix = name.rpartition(".")
        kind = linears if name.endswith("proj.weight") or "proj_with_mqa" in name else None
        add(writer, f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(tensor), kind)
    finish(writer)
    return path


def write_gemma4_gguf(folder: Path, path: Path,
                      linears: GGMLQuantizationType | None = None) -> Path:
    """The checkpoint saved in `folder` (transformers' Gemma4ForCausalLM, SmolLM2's
    vocabulary) as llama.cpp's converter writes it (`gemma4`): the global layers' head size
    under key_length and the sliding ones' under *_swa, KV heads per layer where the global
    ones differ, the MLP widths per layer with the double-wide MLP, the layer types as a
    sliding-window pattern, proportional RoPE as a full rotation with frequency factors
    (rope_freqs: 1 for the pairs that turn, 1e30 for the rest), the router's scales under
    ffn_gate_inp.scale and ffn_down_exps.scale, the norms as they are. F32, or with `linears`
    for the linear weights and experts."""
    import json

    from safetensors.numpy import load_file
    config = json.loads((folder / "config.json").read_text())
    layers, types = config["num_hidden_layers"], config["layer_types"]
    sliding = [t == "sliding_attention" for t in types]
    full = types.index("full_attention")
    overrides = {int(k): v for k, v in config.get("per_layer_config", {}).items()}[full]
    head_full = overrides.get("head_dim", config["head_dim"])
    writer = GGUFWriter(str(path), "gemma4")
    writer.add_name("tiny-gemma4")
    writer.add_block_count(layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    shared = config.get("num_kv_shared_layers") or 0
    width = config["intermediate_size"]
    if config.get("use_double_wide_mlp"):
        writer.add_feed_forward_length([width if i < layers - shared else 2 * width
                                        for i in range(layers)])
    else:
        writer.add_feed_forward_length(width)
    writer.add_head_count(config["num_attention_heads"])
    full_kv = overrides.get("num_key_value_heads")
    writer.add_head_count_kv([config["num_key_value_heads"] if s else full_kv for s in sliding]
                             if full_kv is not None else config["num_key_value_heads"])
    ropes = config["rope_parameters"]
    writer.add_rope_freq_base(ropes["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(ropes["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(head_full)
    writer.add_value_length(head_full)
    writer.add_key_length_swa(config["head_dim"])
    writer.add_value_length_swa(config["head_dim"])
    if config.get("final_logit_softcapping"):
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(config.get("hidden_size_per_layer_input") or 0)
    writer.add_sliding_window_pattern(sliding)
    if config.get("enable_moe_block"):
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["top_k_experts"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_rope_dimension_count(head_full)
    writer.add_rope_dimension_count_swa(config["head_dim"])
    copy_tokenizer(writer)
    turning = int(head_full * ropes["full_attention"]["partial_rotary_factor"] / 2)
    writer.add_tensor("rope_freqs.weight", np.array(
        [1.0] * turning + [1e30] * (head_full // 2 - turning), dtype=np.float32))
    names = get_tensor_name_map(MODEL_ARCH.GEMMA4, layers)
    state = load_file(folder / "model.safetensors")
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        for part in ("gate_up", "down"):
            stacked = state.pop(f"{prefix}experts.{part}_proj", None)
            if stacked is not None:
                add(writer, f"blk.{layer}.ffn_{part}_exps.weight", stacked, linears)
        if prefix + "router.scale" in state:
            add(writer, f"blk.{layer}.ffn_gate_inp.scale", state.pop(prefix + "router.scale"),
                None)
            add(writer, f"blk.{layer}.ffn_down_exps.scale",
                state.pop(prefix + "router.per_expert_scale"), None)
        add(writer, f"blk.{layer}.layer_output_scale.weight", state.pop(prefix + "layer_scalar"),
            None)
    for name, tensor in state.items():
        base, _, suffix = name.rpartition(".")
        quantized = name.startswith("model.layers.") and "router" not in name and name.endswith(
            ("proj.weight", "input_gate.weight", "per_layer_projection.weight"))
        kind = linears if quantized else None
        add(writer, f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(tensor), kind)
    finish(writer)
    return path
