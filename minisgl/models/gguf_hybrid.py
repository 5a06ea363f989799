"""GGUF files of the hybrid families, which transformers' GGUF reader does not take: llama.cpp's
`granitehybrid` (Granite 4.0-H). The config comes from the file's metadata; every tensor is
renamed to the checkpoint name our model loads, with what llama.cpp's converter changed undone:
A stored as -exp(A_log), the convolution's weight squeezed to [channels, K], D as [heads, 1],
the gated norm's weight as [groups, inner / groups], q / k rows permuted as for Llama, and the
fused gate / up projections split (the parts, not the fused tensor, are what we load: a part
kept as blocks has the same name here and in models.gguf_blocks).

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

logger = logging.getLogger(__name__)

Metadata = dict[str, Any]  # the family's keys, without the "<architecture>." prefix
Shapes = dict[str, tuple[int, ...]]  # tensor name -> numpy shape (rows first)


def _granite_config(meta: Metadata, shapes: Shapes) -> dict[str, Any]:
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


GRANITE_KEYS = {  # every granitehybrid key _granite_config reads or may leave
    "block_count", "attention.head_count_kv", "embedding_length", "ssm.inner_size",
    "ssm.time_step_rank", "expert_count", "expert_used_count", "attention.head_count",
    "feed_forward_length", "expert_shared_feed_forward_length", "attention.layer_norm_rms_epsilon",
    "rope.freq_base", "rope.scaling.finetuned", "context_length", "embedding_scale",
    "attention.scale", "residual_scale", "logit_scale", "ssm.state_size", "ssm.group_count",
    "ssm.conv_kernel", "vocab_size", "rope.dimension_count"}


@dataclass(frozen=True)
class GgufFamily:
    """How a llama.cpp architecture maps onto one of our models."""

    config: Callable[[Metadata, Shapes], dict[str, Any]]
    known_keys: set[str]
    mixer: str  # the checkpoint's module name of a layer's state-space mixer
    # GGUF tensor (after "blk.N.") -> our name under "model.layers.N."; linears here may be
    # kept as blocks (models.gguf_blocks reads this table too)
    linears: dict[str, str]
    others: dict[str, str]
    permuted: dict[str, str]  # q / k tensors whose rows llama.cpp permuted -> num_(kv_)heads


def _granite_linears(experts: bool) -> dict[str, str]:
    shared = "_shexp" if experts else ""
    return {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ssm_in": "mamba.in_proj", "ssm_out": "mamba.out_proj",
            f"ffn_gate{shared}": "shared_mlp.gate_proj", f"ffn_up{shared}": "shared_mlp.up_proj",
            f"ffn_down{shared}": "shared_mlp.down_proj",
            "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj"}


GRANITE_LINEARS = {**_granite_linears(False), **_granite_linears(True)}
FAMILIES = {
    "granitehybrid": GgufFamily(
        _granite_config, GRANITE_KEYS, "mamba", GRANITE_LINEARS,
        {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "ffn_gate_inp": "mlp.gate", "ssm_conv1d": "mamba.conv1d", "ssm_dt": "mamba.dt",
         "ssm_norm": "mamba.norm", "ssm_a": "mamba.A_log", "ssm_d": "mamba.D"},
        {"attn_q": "num_heads", "attn_k": "num_kv_heads"}),
}
TABLES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
          "output_norm.weight": "model.norm.weight"}


def family_linears(architecture: str) -> dict[str, str]:
    family = FAMILIES.get(architecture)
    return {} if family is None else family.linears


def unpermute_rows(rows: Any, heads: int) -> Any:
    """Undo llama.cpp's q / k row permutation (rotary halves interleaved) of a tensor or of
    blocks (row order only: blocks run along the input)."""
    count = rows.shape[0]
    order = torch.arange(count).view(heads, 2, count // heads // 2).transpose(1, 2).reshape(-1)
    # NOTE: HF row r sits at GGUF row order[r] (the converter's permutation, inverted)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(count)
    return rows[inverse]


def _metadata(reader: Any) -> tuple[str, Metadata]:
    architecture = reader.fields["general.architecture"].contents()
    prefix = architecture + "."
    meta = {key.removeprefix(prefix): field.contents() for key, field in reader.fields.items()
            if key.startswith(prefix)}
    return architecture, meta


def _hf_tensors(reader: Any, family: GgufFamily, config: dict[str, Any]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import dequantize
    heads = {"num_heads": config["num_attention_heads"],
             "num_kv_heads": config["num_key_value_heads"]}
    for tensor in reader.tensors:
        value = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type),
                                          dtype=np.float32))
        if tensor.name in TABLES:
            yield TABLES[tensor.name], value
            continue
        _, layer, kind, *rest = tensor.name.split(".")  # ssm_a and ssm_d have no suffix
        suffix = rest[0] if rest else ""
        prefix = f"model.layers.{layer}."
        if kind in family.linears:
            if kind in family.permuted:
                value = unpermute_rows(value, heads[family.permuted[kind]])
            yield f"{prefix}{family.linears[kind]}.{suffix}", value
        elif kind not in family.others:
            raise ValueError(f"GGUF tensor {tensor.name}: not one this reader knows")
        elif kind == "ssm_a":
            yield f"{prefix}{family.others[kind]}", (-value.flatten()).log()
        elif kind == "ssm_d":
            yield f"{prefix}{family.others[kind]}", value.flatten()
        elif kind == "ssm_dt":
            yield f"{prefix}{family.others[kind]}_bias", value
        elif kind == "ssm_conv1d" and suffix == "weight":
            yield f"{prefix}{family.others[kind]}.weight", value.unsqueeze(1)
        elif kind == "ssm_norm":
            yield f"{prefix}{family.others[kind]}.weight", value.flatten()
        else:
            yield f"{prefix}{family.others[kind]}.{suffix}", value


def convert_hybrid_gguf(gguf: Path, staging: Path) -> bool:
    """Write `gguf` as a model folder into `staging` if its architecture is a family here
    (config.json, model.safetensors in float32, the tokenizer); False if it is not one."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    reader = GGUFReader(str(gguf))
    architecture, meta = _metadata(reader)
    family = FAMILIES.get(architecture)
    if family is None:
        return False
    unknown = sorted(set(meta) - family.known_keys)
    if unknown:
        raise ValueError(f"{gguf.name}: {architecture} metadata minisgl does not read: "
                         f"{', '.join(unknown)}")
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}
    config = family.config(meta, shapes)
    tokens = reader.fields
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("pad_token_id", "padding_token_id")):
        if f"tokenizer.ggml.{field}" in tokens:
            config[key] = int(tokens[f"tokenizer.ggml.{field}"].contents())
    config["dtype"] = "float32"
    state = dict(_hf_tensors(reader, family, config))
    save_file({k: v.contiguous() for k, v in state.items()}, staging / "model.safetensors",
              metadata={"format": "pt"})
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    _, vocabulary, tokenizer_config = get_gguf_tokenizer(str(gguf))
    backend, extra = convert_gguf_tokenizer(architecture, vocabulary)
    PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra
                            ).save_pretrained(staging)
    return True
