"""GGUF files of the families transformers' GGUF reader does not take (or, for gpt-oss, fails
on): the hybrids, SmolLM3, gpt-oss and DeepSeek: llama.cpp's `granitehybrid` (Granite 4.0-H),
`qwen35` and `qwen35moe` (Qwen3.5), `qwen3next`, `nemotron_h` / `nemotron_h_moe` (Nemotron-H, a
block's mixer kind told by its tensors), `smollm3` (Llama's layout, every fourth layer without
RoPE), `gpt-oss` (its experts' gate and up apart, every other layer windowed) and `deepseek2`
(DeepSeek-V2 and V3: kv_b_proj as llama.cpp splits it, k_b transposed and v_b; the rope rows
in the checkpoint's adjacent pairs, reordered into halves as read). The config comes
from the file's metadata; every tensor is renamed to the checkpoint name our model loads, with
what llama.cpp's converter changed undone:
  - the hybrids: A stored as -exp(A_log), the convolution's weight squeezed to [channels, K];
  - Granite and Nemotron-H: D as [heads, 1], the gated norm's weight as [groups, inner /
    groups]; Granite's fused gate / up projections split;
  - Granite, Nemotron-H and SmolLM3: q / k rows permuted as for Llama;
  - Qwen: the decoder norms stored as 1 + w; Qwen3-Next's in_proj_qkvz split into q, k, v and
    z (each over all heads) and its in_proj_ba kept grouped by key head; Qwen3.5's value heads
    reordered from grouped by key head to tiled over them (k0 k1 .. k0 k1 ..), which we undo
    in every row order and keep only in the output projection's columns (a blocks' input
    order is fixed: the model takes them tiled, `linear_value_heads_tiled`).
A linear kept as blocks (models.gguf_blocks) has the name and the row order given here.
Multi-token-prediction blocks (`nextn_predict_layers`, after the decoder's) are not served.

A metadata key of the family that this reader does not know is refused: it may change the
output."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from minisgl.models.gguf_reader import gguf_reader

logger = logging.getLogger(__name__)

Metadata = dict[str, Any]  # the family's keys, without the "<architecture>." prefix
Shapes = dict[str, tuple[int, ...]]  # tensor name -> numpy shape (rows first)
Config = dict[str, Any]
TABLES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
          "output_norm.weight": "model.norm.weight",
          # Gemma 4's per-layer inputs
          "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
          "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
          "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight"}
# read into the config (Gemma 4's proportional RoPE: its rotated share), not a weight
CONFIG_TENSORS = ("rope_freqs.weight",)


def llama_rows(rows: int, heads: int) -> torch.Tensor:
    """The inverse of llama.cpp's q / k row permutation (rotary halves interleaved): HF row r
    is GGUF row order[r]."""
    permuted = torch.arange(rows).view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)
    order = torch.empty_like(permuted)
    order[permuted] = torch.arange(rows)
    return order


def grouped_rows(config: Config, width: int) -> torch.Tensor:
    """Qwen3.5's value heads (`width` rows each) from llama.cpp's tiled order back to grouped
    by key head: our row (h, j) is the file's row (j, h)."""
    keys, values = config["linear_num_key_heads"], config["linear_num_value_heads"]
    return torch.arange(values * width).view(values // keys, keys, width).transpose(0, 1).reshape(-1)


def _granite_config(meta: Metadata, shapes: Shapes) -> Config:
    layers = int(meta["block_count"])
    kv = meta["attention.head_count_kv"]
    kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * layers  # 0: a Mamba2 layer
    hidden, inner = int(meta["embedding_length"]), int(meta["ssm.inner_size"])
    heads = int(meta["ssm.time_step_rank"])  # NOTE: llama.cpp's field for the Mamba2 heads
    experts = int(meta.get("expert_count", 0))
    shared = "ffn_gate_shexp" if experts else "ffn_gate"
    mamba = next(i for i, n in enumerate(kv) if n == 0)
    return {
        "architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
        "vocab_size": shapes["token_embd.weight"][0], "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": int(meta["attention.head_count"]),
        "num_key_value_heads": max(kv), "layer_types": ["attention" if n else "mamba" for n in kv],
        "intermediate_size": int(meta.get("feed_forward_length", 0)),
        "shared_intermediate_size": shapes[f"blk.0.{shared}.weight"][0],
        "num_local_experts": experts, "num_experts_per_tok": int(meta.get("expert_used_count", 0)),
        "rms_norm_eps": float(meta["attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
        # NOTE: llama.cpp's converter marks the rotary Granite hybrids (Bamba's) with this flag
        "position_embedding_type": "rope" if meta.get("rope.scaling.finetuned") else "nope",
        "max_position_embeddings": int(meta["context_length"]),
        "embedding_multiplier": float(meta.get("embedding_scale", 1.0)),
        "attention_multiplier": float(meta.get("attention.scale", 0.0)) or None,
        "residual_multiplier": float(meta.get("residual_scale", 1.0)),
        "logits_scaling": float(meta.get("logit_scale", 1.0)),
        "mamba_n_heads": heads, "mamba_d_head": inner // heads,
        "mamba_d_state": int(meta["ssm.state_size"]), "mamba_n_groups": int(meta["ssm.group_count"]),
        "mamba_d_conv": int(meta["ssm.conv_kernel"]), "mamba_expand": inner // hidden,
        "mamba_conv_bias": f"blk.{mamba}.ssm_conv1d.bias" in shapes,
        "mamba_proj_bias": f"blk.{mamba}.ssm_in.bias" in shapes,
        "tie_word_embeddings": "output.weight" not in shapes,
    }


def _granite_tensor(kind: str, suffix: str, value: torch.Tensor, config: Config
                    ) -> list[tuple[str, torch.Tensor]]:
    if kind == "ssm_a":
        return [("mamba.A_log", (-value.flatten()).log())]
    if kind == "ssm_d":
        return [("mamba.D", value.flatten())]
    if kind == "ssm_dt":
        return [("mamba.dt_bias", value)]
    if kind == "ssm_conv1d" and suffix == "weight":
        return [("mamba.conv1d.weight", value.unsqueeze(1))]
    if kind == "ssm_norm":
        return [("mamba.norm.weight", value.flatten())]
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "ffn_gate_inp": "mlp.gate", "ssm_conv1d": "mamba.conv1d"}
    return [(f"{names[kind]}.{suffix}", value)] if kind in names else []


def _granite_rows(kind: str, config: Config) -> torch.Tensor | None:
    heads = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}.get(kind)
    if heads is None:
        return None
    rows = config[heads] * config["hidden_size"] // config["num_attention_heads"]
    return llama_rows(rows, config[heads])


QWEN_ARCHITECTURES = {"qwen35": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
                      "qwen35moe": ("Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"),
                      "qwen3next": ("Qwen3NextForCausalLM", "qwen3_next")}


def _qwen_config(architecture: str) -> Callable[[Metadata, Shapes], Config]:
    def config(meta: Metadata, shapes: Shapes) -> Config:
        layers = int(meta["block_count"]) - int(meta.get("nextn_predict_layers", 0))
        recurrent = list(meta["attention.recurrent_layers"])[:layers]
        keys, values = int(meta["ssm.group_count"]), int(meta["ssm.time_step_rank"])
        head_dim = int(meta["attention.key_length"])
        if int(meta.get("attention.value_length", head_dim)) != head_dim:
            raise ValueError(f"{architecture}: attention key and value lengths differ")
        model_class, model_type = QWEN_ARCHITECTURES[architecture]
        fields: Config = {
            "architectures": [model_class], "model_type": model_type,
            "vocab_size": shapes["token_embd.weight"][0],
            "hidden_size": int(meta["embedding_length"]), "num_hidden_layers": layers,
            "intermediate_size": int(meta.get("feed_forward_length", 0)),
            "num_attention_heads": int(meta["attention.head_count"]),
            "num_key_value_heads": int(meta["attention.head_count_kv"]), "head_dim": head_dim,
            "rms_norm_eps": float(meta["attention.layer_norm_rms_epsilon"]),
            "max_position_embeddings": int(meta["context_length"]),
            "rope_parameters": {"rope_type": "default",
                                "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
                                "partial_rotary_factor":
                                    int(meta["rope.dimension_count"]) / head_dim},
            "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent],
            "linear_conv_kernel_dim": int(meta["ssm.conv_kernel"]),
            "linear_key_head_dim": int(meta["ssm.state_size"]), "linear_num_key_heads": keys,
            "linear_num_value_heads": values,
            "linear_value_head_dim": int(meta["ssm.inner_size"]) // values,
            "linear_projections_grouped": False,
            "linear_value_heads_tiled": architecture != "qwen3next" and keys != values,
            "tie_word_embeddings": "output.weight" not in shapes,
        }
        if "expert_count" in meta:  # NOTE: llama.cpp renormalises the chosen experts' weights
            fields.update(num_experts=int(meta["expert_count"]),
                          num_experts_per_tok=int(meta["expert_used_count"]),
                          moe_intermediate_size=int(meta["expert_feed_forward_length"]),
                          shared_expert_intermediate_size=int(
                              meta["expert_shared_feed_forward_length"]),
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        return fields
    return config


QWEN_NORMS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
              "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def _qwen_tensor(kind: str, suffix: str, value: torch.Tensor, config: Config
                 ) -> list[tuple[str, torch.Tensor]]:
    tiled = config["linear_value_heads_tiled"]

    def heads(vector: torch.Tensor) -> torch.Tensor:  # one row per value head
        return vector[grouped_rows(config, 1)] if tiled else vector

    if kind in QWEN_NORMS:
        return [(f"{QWEN_NORMS[kind]}.weight", value - 1.0)]
    if kind == "ssm_a":
        return [("linear_attn.A_log", heads((-value.flatten()).log()))]
    if kind == "ssm_dt":
        return [("linear_attn.dt_bias", heads(value))]
    if kind == "ssm_ba":  # [key heads, (b: group, a: group)] rows
        group = config["linear_num_value_heads"] // config["linear_num_key_heads"]
        b, a = value.view(config["linear_num_key_heads"], 2, group, -1).unbind(1)
        return [("linear_attn.in_proj_b.weight", b.reshape(-1, value.shape[1])),
                ("linear_attn.in_proj_a.weight", a.reshape(-1, value.shape[1]))]
    if kind == "ssm_conv1d":
        if tiled:
            qk = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
            v = value[qk:][grouped_rows(config, config["linear_value_head_dim"])]
            value = torch.cat([value[:qk], v])
        return [("linear_attn.conv1d.weight", value.unsqueeze(1))]
    if kind == "ssm_norm":
        return [("linear_attn.norm.weight", value)]
    if kind == "ffn_gate_inp_shexp":  # llama.cpp's {n_embd} (llama-quantize drops a unit dim)
        return [(f"mlp.shared_expert_gate.{suffix}", value.reshape(1, -1))]
    return [(f"mlp.gate.{suffix}", value)] if kind == "ffn_gate_inp" else []


def _qwen_rows(kind: str, config: Config) -> torch.Tensor | None:
    if not config["linear_value_heads_tiled"] or kind not in ("attn_qkv", "attn_gate",
                                                              "ssm_alpha", "ssm_beta"):
        return None
    if kind in ("ssm_alpha", "ssm_beta"):  # one row per value head
        return grouped_rows(config, 1)
    v = grouped_rows(config, config["linear_value_head_dim"])
    if kind == "attn_gate":
        return v
    qk = 2 * config["linear_num_key_heads"] * config["linear_key_head_dim"]
    return torch.cat([torch.arange(qk), qk + v])


NEMOTRON_ARCHITECTURES = ("nemotron_h", "nemotron_h_moe")
# the tensor that marks a block's mixer kind (an attention block: its KV heads in the metadata)
NEMOTRON_MIXERS = {"ssm_in.weight": "linear_attention", "ffn_up_exps.weight": "moe",
                   "ffn_up.weight": "mlp"}
SIGMOID_GATING = 2  # llama.cpp's expert_gating_func for sigmoid scores


def _one_value(meta: Metadata, key: str, default: Any = 0) -> Any:
    """A key llama.cpp may write per layer (0 for the layers without it): its one value."""
    value = meta.get(key, default)
    if not isinstance(value, (list, tuple)):
        return value
    values = {v for v in value if v}
    if len(values) > 1:
        raise ValueError(f"{key} differs across the layers ({sorted(values)}): minisgl's "
                         "Nemotron-H takes one value for every layer")
    return values.pop() if values else default


def _nemotron_config(meta: Metadata, shapes: Shapes) -> Config:
    layers = int(meta["block_count"]) - int(meta.get("nextn_predict_layers", 0))
    kv = meta["attention.head_count_kv"]
    kv = list(kv) if isinstance(kv, (list, tuple)) else [kv] * layers
    kinds = []
    for layer in range(layers):
        kind = "full_attention" if kv[layer] else next(
            (k for tensor, k in NEMOTRON_MIXERS.items() if f"blk.{layer}.{tensor}" in shapes),
            None)
        if kind is None:
            raise ValueError(f"GGUF block {layer}: neither attention, Mamba2, MLP nor experts")
        kinds.append(kind)
    head_dim = int(meta["attention.key_length"])
    if int(meta.get("attention.value_length", head_dim)) != head_dim:
        raise ValueError("nemotron_h: attention key and value lengths differ")
    if meta.get("rope.scaling.finetuned"):
        raise ValueError("nemotron_h: rotary attention (rope.scaling.finetuned) is not "
                         "Nemotron-H's")
    heads, inner = int(meta["ssm.time_step_rank"]), int(meta["ssm.inner_size"])
    mamba = kinds.index("linear_attention") if "linear_attention" in kinds else None
    mlp = kinds.index("mlp") if "mlp" in kinds else None
    fields: Config = {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": int(meta["embedding_length"]), "num_hidden_layers": layers,
        "layers_block_type": kinds, "num_attention_heads": int(meta["attention.head_count"]),
        "num_key_value_heads": max(kv[:layers]), "head_dim": head_dim,
        "intermediate_size": shapes[f"blk.{mlp}.ffn_up.weight"][0] if mlp is not None else 0,
        "layer_norm_epsilon": float(meta.get("attention.layer_norm_rms_epsilon",
                                             meta["attention.layer_norm_epsilon"])),
        "max_position_embeddings": int(meta["context_length"]),
        "mamba_num_heads": heads, "mamba_head_dim": inner // heads,
        "ssm_state_size": int(meta["ssm.state_size"]), "n_groups": int(meta["ssm.group_count"]),
        "conv_kernel": int(meta["ssm.conv_kernel"]),
        "use_conv_bias": mamba is not None and f"blk.{mamba}.ssm_conv1d.bias" in shapes,
        "use_bias": mamba is not None and f"blk.{mamba}.ssm_in.bias" in shapes,
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    if "moe" in kinds:
        if int(meta.get("expert_gating_func", SIGMOID_GATING)) != SIGMOID_GATING:
            raise ValueError(f"nemotron_h_moe: expert_gating_func "
                             f"{meta['expert_gating_func']} (Nemotron-H's is sigmoid, 2)")
        fields.update(
            n_routed_experts=int(meta["expert_count"]),
            num_experts_per_tok=int(_one_value(meta, "expert_used_count")),
            moe_intermediate_size=int(_one_value(meta, "expert_feed_forward_length")),
            moe_shared_expert_intermediate_size=int(meta["expert_shared_feed_forward_length"]),
            n_shared_experts=int(meta.get("expert_shared_count", 1)),
            n_group=int(meta.get("expert_group_count", 1)),
            topk_group=int(meta.get("expert_group_used_count", 1)),
            norm_topk_prob=bool(meta.get("expert_weights_norm", False)),
            routed_scaling_factor=float(meta.get("expert_weights_scale", 1.0)),
            moe_latent_size=meta.get("moe_latent_size"))
    return fields


def _nemotron_tensor(kind: str, suffix: str, value: torch.Tensor, config: Config
                     ) -> list[tuple[str, torch.Tensor]]:
    if kind == "ssm_a":
        return [("mixer.A_log", (-value.flatten()).log())]
    if kind in ("ssm_d", "ssm_norm"):
        return [({"ssm_d": "mixer.D", "ssm_norm": "mixer.norm.weight"}[kind], value.flatten())]
    if kind == "ssm_dt":
        return [("mixer.dt_bias", value)]
    if kind == "ssm_conv1d":
        return [(f"mixer.conv1d.{suffix}", value.unsqueeze(1) if suffix == "weight" else value)]
    names = {"attn_norm": "norm", "ffn_gate_inp": "mixer.gate"}
    if kind == "exp_probs_b":
        return [("mixer.gate.e_score_correction_bias", value)]
    return [(f"{names[kind]}.{suffix}", value)] if kind in names else []


def _smollm3_config(meta: Metadata, shapes: Shapes) -> Config:
    heads = int(meta["attention.head_count"])
    head_dim = int(meta.get("attention.key_length", int(meta["embedding_length"]) // heads))
    if int(meta.get("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("smollm3: RoPE over part of each head (rope.dimension_count "
                         f"{meta['rope.dimension_count']} of {head_dim})")
    if int(meta.get("attention.value_length", head_dim)) != head_dim:
        raise ValueError("smollm3: attention key and value lengths differ")
    return {
        "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3",
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": int(meta["embedding_length"]),
        "num_hidden_layers": int(meta["block_count"]),
        "intermediate_size": int(meta["feed_forward_length"]),
        "num_attention_heads": heads, "num_key_value_heads": int(meta["attention.head_count_kv"]),
        "head_dim": head_dim, "rms_norm_eps": float(meta["attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": int(meta["context_length"]),
        "rope_theta": float(meta.get("rope.freq_base", 10000.0)),
        # NOTE: llama.cpp's smollm3 takes every fourth layer without RoPE; the file says nothing
        "no_rope_layer_interval": 4,
        "tie_word_embeddings": "output.weight" not in shapes,
    }


def _llama_norms(kind: str, suffix: str, value: torch.Tensor, config: Config
                 ) -> list[tuple[str, torch.Tensor]]:
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    return [(f"{names[kind]}.{suffix}", value)] if kind in names else []


def _gpt_oss_config(meta: Metadata, shapes: Shapes) -> Config:
    layers, heads = int(meta["block_count"]), int(meta["attention.head_count"])
    head_dim = int(meta["attention.key_length"])
    if int(meta.get("attention.value_length", head_dim)) != head_dim:
        raise ValueError("gpt-oss: attention key and value lengths differ")
    pattern = meta.get("attention.sliding_window_pattern", 2)
    if isinstance(pattern, (list, tuple)):  # per layer: windowed or not
        windowed = [bool(p) for p in pattern][:layers]
    else:  # NOTE: llama.cpp's rule: the last layer of every `pattern` is the full one
        windowed = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    rope = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 10000.0))}
    if meta.get("rope.scaling.type", "none") != "none":
        if meta["rope.scaling.type"] != "yarn":
            raise ValueError(f"gpt-oss: rope.scaling.type {meta['rope.scaling.type']!r}")
        # NOTE: truncate false, as the checkpoint's config says (the file does not)
        rope.update(rope_type="yarn", factor=float(meta["rope.scaling.factor"]),
                    original_max_position_embeddings=int(
                        meta["rope.scaling.original_context_length"]),
                    beta_fast=float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
                    truncate=False)
    return {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": int(meta["embedding_length"]), "num_hidden_layers": layers,
        "intermediate_size": int(meta["expert_feed_forward_length"]),
        "num_attention_heads": heads, "num_key_value_heads": int(meta["attention.head_count_kv"]),
        "head_dim": head_dim, "rms_norm_eps": float(meta["attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": int(meta["context_length"]),
        "rope_parameters": rope, "sliding_window": int(meta["attention.sliding_window"]),
        "layer_types": ["sliding_attention" if w else "full_attention" for w in windowed],
        "num_local_experts": int(meta["expert_count"]),
        "num_experts_per_tok": int(meta["expert_used_count"]), "attention_bias": True,
        "tie_word_embeddings": "output.weight" not in shapes,
    }


def _gpt_oss_tensor(kind: str, suffix: str, value: torch.Tensor, config: Config
                    ) -> list[tuple[str, torch.Tensor]]:
    names = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_gate_inp": "mlp.router"}
    if kind == "attn_sinks":
        return [("self_attn.sinks", value)]
    return [(f"{names[kind]}.{suffix}", value)] if kind in names else []


def _deepseek2_config(meta: Metadata, shapes: Shapes) -> Config:
    layers = int(meta["block_count"]) - int(meta.get("nextn_predict_layers", 0))
    heads, rope_dim = int(meta["attention.head_count"]), int(meta["rope.dimension_count"])
    latent = int(meta["attention.kv_lora_rank"])
    # NOTE: files written since MLA's absorbed form keep the per-head sizes under *_mla
    key = int(meta.get("attention.key_length_mla", meta["attention.key_length"]))
    value = int(meta.get("attention.value_length_mla", meta["attention.value_length"]))
    sigmoid = int(meta.get("expert_gating_func", 1)) == SIGMOID_GATING  # absent: softmax
    groups = int(meta.get("expert_group_count", 1))
    rope: Config = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base",
                                                                          10000.0))}
    if meta.get("rope.scaling.type", "none") not in ("none", "yarn"):
        raise ValueError(f"deepseek2: rope.scaling.type {meta['rope.scaling.type']!r}")
    if meta.get("rope.scaling.type") == "yarn":
        # NOTE: the file keeps 0.1 * mscale_all_dim; DeepSeek's checkpoints set mscale equal
        mscale = float(meta.get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        rope.update(rope_type="yarn", factor=float(meta["rope.scaling.factor"]),
                    original_max_position_embeddings=int(
                        meta["rope.scaling.original_context_length"]),
                    beta_fast=float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
                    mscale=mscale, mscale_all_dim=mscale)
    config: Config = {
        "architectures": ["DeepseekV3ForCausalLM" if sigmoid else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if sigmoid else "deepseek_v2",
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": int(meta["embedding_length"]), "num_hidden_layers": layers,
        "intermediate_size": int(meta["feed_forward_length"]),
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": int(meta["attention.q_lora_rank"]) if "attention.q_lora_rank" in meta
        else None,
        "kv_lora_rank": latent, "qk_rope_head_dim": rope_dim, "qk_nope_head_dim": key - rope_dim,
        "v_head_dim": value, "rms_norm_eps": float(meta["attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": int(meta["context_length"]), "rope_parameters": rope,
        "rope_interleave": False,  # the rope rows are reordered as they are read (_mla_rows)
        "first_k_dense_replace": int(meta.get("leading_dense_block_count", 0)),
        "tie_word_embeddings": "output.weight" not in shapes,
    }
    if "expert_count" in meta:
        config.update(
            n_routed_experts=int(meta["expert_count"]),
            num_experts_per_tok=int(meta["expert_used_count"]),
            moe_intermediate_size=int(meta["expert_feed_forward_length"]),
            n_shared_experts=int(meta.get("expert_shared_count", 0)),
            routed_scaling_factor=float(meta.get("expert_weights_scale", 1.0)),
            norm_topk_prob=bool(meta.get("expert_weights_norm", False)),
            n_group=groups, topk_group=int(meta.get("expert_group_used_count", groups)),
            scoring_func="sigmoid" if sigmoid else "softmax",
            topk_method=("noaux_tc" if sigmoid else
                         "group_limited_greedy" if groups > 1 else "greedy"))
    return config


def _mla_rows(kind: str, config: Config) -> torch.Tensor | None:
    """q's and the compressed row's rope rows from adjacent pairs to halves (llama.cpp keeps
    the checkpoint's pairs and rotates them so)."""
    from minisgl.models.deepseek import MLAShape, rope_rows
    if kind not in ("attn_q", "attn_q_b", "attn_kv_a_mqa"):
        return None
    return rope_rows(MLAShape.from_config(config), kind == "attn_kv_a_mqa")


def _deepseek2_tensor(kind: str, suffix: str, value: torch.Tensor, config: Config
                      ) -> list[tuple[str, torch.Tensor]]:
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
             "attn_q_a_norm": "self_attn.q_a_layernorm",
             "attn_kv_a_norm": "self_attn.kv_a_layernorm", "ffn_gate_inp": "mlp.gate"}
    if kind == "exp_probs_b":
        return [("mlp.gate.e_score_correction_bias", value)]
    if kind in ("attn_k_b", "attn_v_b", "attn_kv_b"):  # kept dense: the absorbed products
        return [("self_attn.kv_b_proj." + {"attn_k_b": "k_b", "attn_v_b": "v_b",
                                            "attn_kv_b": "weight"}[kind], value)]
    return [(f"{names[kind]}.{suffix}", value)] if kind in names else []


def _per_layer(value: Any, layers: int) -> list[Any]:
    return list(value)[:layers] if isinstance(value, (list, tuple)) else [value] * layers


def _gemma4_config(meta: Metadata, shapes: Shapes) -> Config:
    layers = int(meta["block_count"])
    sliding = [bool(s) for s in _per_layer(meta["attention.sliding_window_pattern"], layers)]
    types = ["sliding_attention" if s else "full_attention" for s in sliding]
    full = types.index("full_attention")
    kv = [int(k) for k in _per_layer(meta["attention.head_count_kv"], layers)]
    widths = [int(f) for f in _per_layer(meta["feed_forward_length"], layers)]
    shared = int(meta.get("attention.shared_kv_layers", 0))
    first_shared = layers - shared
    double = any(w != widths[0] for w in widths)
    if double and widths != [widths[0]] * first_shared + [2 * widths[0]] * shared:
        raise ValueError(f"gemma4: MLP widths {sorted(set(widths))} that are not the "
                         "double-wide pattern (twice as wide in the KV-sharing layers)")
    head_full = int(meta["attention.key_length"])
    head_swa = int(meta.get("attention.key_length_swa", head_full))
    if int(meta.get("rope.dimension_count", head_full)) != head_full:
        raise ValueError("gemma4: the global layers rotate part of each head other than by "
                         "proportional RoPE's frequency factors")
    # rope_freqs: a factor per rotary pair of a global head, 1 for the pairs that turn and a
    # huge one (a frequency of ~0) for the rest: proportional RoPE's partial_rotary_factor
    factors = meta.get("rope_freqs")
    turning = sum(1 for f in factors if f == 1.0) if factors is not None else head_full // 2
    k_eq_v = f"blk.{full}.attn_v.weight" not in shapes
    config: Config = {
        "architectures": ["Gemma4ForCausalLM"], "model_type": "gemma4_text",
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": int(meta["embedding_length"]), "num_hidden_layers": layers,
        "intermediate_size": widths[0], "use_double_wide_mlp": double,
        "num_attention_heads": int(meta["attention.head_count"]),
        "num_key_value_heads": kv[sliding.index(True)] if any(sliding) else kv[full],
        "head_dim": head_swa, "global_head_dim": head_full,
        "attention_k_eq_v": k_eq_v, "num_global_key_value_heads": kv[full] if k_eq_v else None,
        "num_kv_shared_layers": shared, "layer_types": types,
        "sliding_window": int(meta.get("attention.sliding_window", 0)) or None,
        "rms_norm_eps": float(meta["attention.layer_norm_rms_epsilon"]),
        "max_position_embeddings": int(meta["context_length"]),
        "final_logit_softcapping": meta.get("final_logit_softcapping"),
        "hidden_size_per_layer_input": int(meta.get("embedding_length_per_layer_input", 0)),
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional",
                               "partial_rotary_factor": 2 * turning / head_full,
                               "rope_theta": float(meta.get("rope.freq_base", 1_000_000.0))},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(meta.get("rope.freq_base_swa", 10_000.0))}},
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": "output.weight" not in
        shapes,
    }
    if "per_layer_token_embd.weight" in shapes:
        config["vocab_size_per_layer_input"] = shapes["per_layer_token_embd.weight"][0]
    if "expert_count" in meta:
        config.update(enable_moe_block=True, num_experts=int(meta["expert_count"]),
                      top_k_experts=int(meta["expert_used_count"]),
                      moe_intermediate_size=int(meta["expert_feed_forward_length"]))
    return config


def _gemma4_tensor(kind: str, suffix: str, value: torch.Tensor, config: Config
                   ) -> list[tuple[str, torch.Tensor]]:
    names = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
             "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
             "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
             "post_ffw_norm_1": "post_feedforward_layernorm_1",
             "post_ffw_norm_2": "post_feedforward_layernorm_2",
             "post_norm": "post_per_layer_input_norm", "attn_q_norm": "self_attn.q_norm",
             "attn_k_norm": "self_attn.k_norm", "ffn_gate_inp": "router.proj"}
    if kind == "layer_output_scale":
        return [("layer_scalar", value.flatten())]
    if (kind, suffix) == ("ffn_gate_inp", "scale"):
        return [("router.scale", value)]
    if (kind, suffix) == ("ffn_down_exps", "scale"):
        return [("router.per_expert_scale", value)]
    return [(f"{names[kind]}.{suffix}", value)] if kind in names else []


def _llama_rows(kind: str, config: Config) -> torch.Tensor | None:
    heads = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}.get(kind)
    return None if heads is None else llama_rows(config[heads] * config["head_dim"],
                                                 config[heads])


@dataclass(frozen=True)
class GgufFamily:
    """How a llama.cpp architecture maps onto one of our models."""

    config: Callable[[Metadata, Shapes], Config]
    known_keys: set[str]
    # GGUF tensor (after "blk.N.") -> our name under "model.layers.N."; the linears here may
    # be kept as blocks (models.gguf_blocks reads this table too), each in its `rows` order
    linears: dict[str, str]
    rows: Callable[[str, Config], torch.Tensor | None]
    # every other tensor of a layer: (kind, suffix, value, config) -> [(our name, value)]
    tensor: Callable[[str, str, torch.Tensor, Config], list[tuple[str, torch.Tensor]]]
    norms_plus_one: bool = False  # the final norm too (the layers' are `tensor`'s)


ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}
EXPERTS = {"ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
           "ffn_down_exps": "mlp.experts.down_proj"}
MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _shared(prefix: str, suffix: str) -> dict[str, str]:
    return {f"ffn_{p}{suffix}": f"{prefix}.{p}_proj" for p in ("gate", "up", "down")}


COMMON_KEYS = {"block_count", "context_length", "embedding_length", "feed_forward_length",
               "attention.head_count", "attention.head_count_kv",
               "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count",
               "expert_count", "expert_used_count", "expert_shared_feed_forward_length",
               "ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.inner_size",
               "ssm.time_step_rank", "vocab_size"}
GRANITE = GgufFamily(
    _granite_config,
    COMMON_KEYS | {"rope.scaling.finetuned", "embedding_scale", "attention.scale",
                   "residual_scale", "logit_scale"},
    {**ATTENTION, **EXPERTS, "ssm_in": "mamba.in_proj", "ssm_out": "mamba.out_proj",
     **_shared("shared_mlp", ""), **_shared("shared_mlp", "_shexp")},
    _granite_rows, _granite_tensor)


def _qwen(architecture: str) -> GgufFamily:
    return GgufFamily(
        _qwen_config(architecture),
        COMMON_KEYS | {"attention.key_length", "attention.value_length",
                       "attention.recurrent_layers", "full_attention_interval",
                       "expert_feed_forward_length", "nextn_predict_layers",
                       # NOTE: multimodal RoPE's sections: for text, plain RoPE
                       "rope.dimension_sections"},
        {**ATTENTION, **EXPERTS, **MLP, **_shared("mlp.shared_expert", "_shexp"),
         "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
         "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
         "ssm_out": "linear_attn.out_proj"},
        _qwen_rows, _qwen_tensor, norms_plus_one=True)


NEMOTRON = GgufFamily(
    _nemotron_config,
    COMMON_KEYS | {"attention.key_length", "attention.value_length", "rope.scaling.finetuned",
                   "expert_feed_forward_length", "expert_shared_count", "expert_group_count",
                   "expert_group_used_count", "expert_weights_norm", "expert_weights_scale",
                   "expert_gating_func", "moe_latent_size", "nextn_predict_layers",
                   "attention.layer_norm_epsilon"},
    {**ATTENTION, "ssm_in": "mixer.in_proj", "ssm_out": "mixer.out_proj",
     "ffn_up": "mixer.up_proj", "ffn_down": "mixer.down_proj",
     "ffn_up_exps": "mixer.experts.up_proj", "ffn_down_exps": "mixer.experts.down_proj",
     "ffn_up_shexp": "mixer.shared_experts.up_proj",
     "ffn_down_shexp": "mixer.shared_experts.down_proj"},
    # NOTE: llama.cpp permutes q / k rows as for Llama's rotary halves though Nemotron-H's
    # attention has no RoPE: undone all the same (an adapter's rows follow the checkpoint's)
    _llama_rows, _nemotron_tensor)
SMOLLM3 = GgufFamily(
    _smollm3_config,
    {"block_count", "context_length", "embedding_length", "feed_forward_length",
     "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
     "attention.key_length", "attention.value_length", "rope.freq_base",
     "rope.dimension_count", "vocab_size"},
    {**ATTENTION, **MLP}, _llama_rows, _llama_norms)
# NOTE: q / k rows as the checkpoint's (the converter does not permute them)
GPT_OSS = GgufFamily(
    _gpt_oss_config,
    {"block_count", "context_length", "embedding_length", "feed_forward_length",
     "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
     "attention.key_length", "attention.value_length", "attention.sliding_window",
     "attention.sliding_window_pattern", "rope.freq_base", "rope.dimension_count",
     "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
     "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow", "expert_count",
     "expert_used_count", "expert_feed_forward_length", "vocab_size"},
    {**ATTENTION, **{f"ffn_{p}_exps": f"mlp.experts.{p}_proj" for p in ("gate", "up", "down")}},
    lambda kind, config: None, _gpt_oss_tensor)
DEEPSEEK2 = GgufFamily(
    _deepseek2_config,
    COMMON_KEYS | {"attention.key_length", "attention.value_length",
                   "attention.key_length_mla", "attention.value_length_mla",
                   "attention.q_lora_rank", "attention.kv_lora_rank", "leading_dense_block_count",
                   "expert_feed_forward_length", "expert_shared_count", "expert_weights_scale",
                   "expert_weights_norm", "expert_gating_func", "expert_group_count",
                   "expert_group_used_count", "rope.scaling.type", "rope.scaling.factor",
                   "rope.scaling.original_context_length", "rope.scaling.yarn_log_multiplier",
                   "rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow",
                   "nextn_predict_layers"},
    {"attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj",
     "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
     "attn_output": "self_attn.o_proj", **MLP, **EXPERTS,
     **_shared("mlp.shared_experts", "_shexp")},
    _mla_rows, _deepseek2_tensor)
GEMMA4 = GgufFamily(
    _gemma4_config,
    COMMON_KEYS | {"attention.key_length", "attention.value_length", "attention.key_length_swa",
                   "attention.value_length_swa", "attention.sliding_window",
                   "attention.sliding_window_pattern", "attention.shared_kv_layers",
                   "embedding_length_per_layer_input", "final_logit_softcapping",
                   "rope.dimension_count_swa", "rope.freq_base_swa",
                   "expert_feed_forward_length"},
    # NOTE: q / k rows as the checkpoint's (the converter does not permute Gemma's)
    {**ATTENTION, **MLP, "ffn_gate_up_exps": "experts.gate_up_proj",
     "ffn_down_exps": "experts.down_proj", "inp_gate": "per_layer_input_gate",
     "proj": "per_layer_projection"},
    lambda kind, config: None, _gemma4_tensor)
FAMILIES = {"granitehybrid": GRANITE, **{a: _qwen(a) for a in QWEN_ARCHITECTURES},
            **{a: NEMOTRON for a in NEMOTRON_ARCHITECTURES}, "smollm3": SMOLLM3,
            "gpt-oss": GPT_OSS, "deepseek2": DEEPSEEK2, "gemma4": GEMMA4}


def family_linears(architecture: str) -> dict[str, str]:
    family = FAMILIES.get(architecture)
    return {} if family is None else family.linears


def row_order(architecture: str, kind: str, config: Config) -> torch.Tensor | None:
    """The file's rows of linear `kind` in our order (None: as they are)."""
    family = FAMILIES.get(architecture)
    return None if family is None else family.rows(kind, config)


def _metadata(reader: Any) -> tuple[str, Metadata]:
    architecture = reader.fields["general.architecture"].contents()
    prefix = architecture + "."
    meta = {key.removeprefix(prefix): field.contents() for key, field in reader.fields.items()
            if key.startswith(prefix)}
    return architecture, meta


DENSE_TYPES = ("F32", "F16", "BF16")
LEFT_IN_FILE = "left_in_gguf.json"  # the converted folder's list of the weights it lacks


def in_file_name(tensor: Any, architecture: str) -> str | None:
    """The HF name of a GGUF tensor that stays out of the converted folder: a family's
    quantized linear weight (the experts' most of all), read from the file when a model loads
    (as blocks, or dequantized one tensor at a time), so that the folder holds what is small;
    None for every other tensor."""
    family = FAMILIES.get(architecture)
    parts = tensor.name.split(".")
    if (family is None or len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight"
            or parts[2] not in family.linears or tensor.tensor_type.name in DENSE_TYPES):
        return None
    return f"model.layers.{parts[1]}.{family.linears[parts[2]]}.weight"


def left_in_file(folder: Path) -> list[str]:
    """The weights a converted folder left in its GGUF file (none for other folders)."""
    listing = folder / LEFT_IN_FILE
    return json.loads(listing.read_text()) if listing.is_file() else []


def dense_value(tensor: Any) -> torch.Tensor:
    from gguf import dequantize
    return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type),
                                     dtype=np.float32))


def _hf_tensors(reader: Any, family: GgufFamily, config: Config, architecture: str
                ) -> Iterator[tuple[str, torch.Tensor]]:
    layers = config["num_hidden_layers"]
    for tensor in reader.tensors:
        if in_file_name(tensor, architecture) is not None or tensor.name in CONFIG_TENSORS:
            continue
        value = dense_value(tensor)
        if tensor.name in TABLES:
            if tensor.name == "output_norm.weight" and family.norms_plus_one:
                value = value - 1.0
            yield TABLES[tensor.name], value
            continue
        _, layer, kind, *rest = tensor.name.split(".")  # ssm_a and ssm_d have no suffix
        if int(layer) >= layers:
            continue  # a multi-token-prediction block
        suffix, prefix = ".".join(rest), f"model.layers.{layer}."
        if kind in family.linears and suffix in ("weight", "bias"):
            order = family.rows(kind, config)
            yield f"{prefix}{family.linears[kind]}.{suffix}", (
                value if order is None else value[order])
            continue
        converted = family.tensor(kind, suffix, value, config)
        if not converted:
            raise ValueError(f"GGUF tensor {tensor.name}: not one this reader knows")
        for name, part in converted:
            yield prefix + name, part


def convert_hybrid_gguf(gguf: Path, staging: Path) -> bool:
    """Write `gguf` as a model folder into `staging` if its architecture is a family here
    (config.json, model.safetensors in float32 without the quantized linear weights, which
    stay in the file: `in_file_name`, listed in LEFT_IN_FILE; the tokenizer); False if it is
    not one."""
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    reader = gguf_reader(gguf)
    architecture, meta = _metadata(reader)
    family = FAMILIES.get(architecture)
    if family is None:
        return False
    unknown = sorted(set(meta) - family.known_keys)
    if unknown:
        raise ValueError(f"{gguf.name}: {architecture} metadata minisgl does not read: "
                         f"{', '.join(unknown)}")
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    meta.update({t.name.removesuffix(".weight"): dense_value(t).flatten().tolist()
                 for t in reader.tensors if t.name in CONFIG_TENSORS})
    config = family.config(meta, shapes)
    tokens = reader.fields
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{field}" in tokens:
            config[key] = int(tokens[f"tokenizer.ggml.{field}"].contents())
    config["dtype"] = "float32"
    state = dict(_hf_tensors(reader, family, config, architecture))
    save_file({k: v.contiguous() for k, v in state.items()}, staging / "model.safetensors",
              metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    left = [name for t in reader.tensors if (name := in_file_name(t, architecture))
            and int(t.name.split(".")[1]) < config["num_hidden_layers"]]
    (staging / LEFT_IN_FILE).write_text(json.dumps(left))
    _, vocabulary, tokenizer_config = get_gguf_tokenizer(str(gguf))
    backend, extra = convert_gguf_tokenizer(architecture, vocabulary)
    PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra
                            ).save_pretrained(staging)
    return True
