"""The handful of numbers a decoder needs, read from a Hugging Face config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# What sets a family apart from the Llama decoder, whatever its config says; a config matches
# a family by its model_type or by its architectures entry.
FAMILY_TRAITS: dict[tuple[str, str], dict[str, bool]] = {
    ("qwen2", "Qwen2ForCausalLM"): {"attention_bias": True},  # a bias on the q/k/v projections
    # a per-head RMSNorm on queries and keys before RoPE
    ("qwen3", "Qwen3ForCausalLM"): {"qk_norm": True},
}


def family_traits(model_type: str, architecture: str) -> dict[str, bool]:
    traits: dict[str, bool] = {}
    for (family_type, family_architecture), family in FAMILY_TRAITS.items():
        if model_type == family_type or architecture == family_architecture:
            traits.update(family)
    return traits


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: dict[str, Any]
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArch:
        archs = config.get("architectures") or [""]
        model_type = config.get("model_type", "")
        heads = config["num_attention_heads"]
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        eos = config.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        traits = family_traits(model_type, archs[0])
        return cls(
            architecture=archs[0],
            model_type=model_type,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            rope=rope,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=traits.get("attention_bias",
                                      bool(config.get("attention_bias", False))),
            qk_norm=traits.get("qk_norm", False),
            eos_token_ids=eos_ids,
        )
