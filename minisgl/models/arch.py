"""The handful of numbers a decoder needs, read from a Hugging Face config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from minisgl.layers.rotary import LongRopeSwitch, long_rope_switch

# What sets a family apart from the Llama decoder, whatever its config says; a config matches
# a family by its model_type or by its architectures entry.
FAMILY_TRAITS: dict[tuple[str, str], dict[str, bool]] = {
    ("qwen2", "Qwen2ForCausalLM"): {"attention_bias": True},  # a bias on the q/k/v projections
    ("qwen2_5_vl_text", "Qwen2_5_VLForCausalLM"): {"attention_bias": True},
    # a per-head RMSNorm on queries and keys before RoPE
    ("qwen3", "Qwen3ForCausalLM"): {"qk_norm": True},
    ("qwen3_vl_text", "Qwen3VLForCausalLM"): {"qk_norm": True},
    ("gemma3_text", "Gemma3ForCausalLM"): {"qk_norm": True},
    ("qwen3_moe", "Qwen3MoeForCausalLM"): {"qk_norm": True},
    # a learned logit per query head in each softmax's denominator, biased q/k/v and o
    ("gpt_oss", "GptOssForCausalLM"): {"attention_sinks": True, "harmony": True},
}


# Config fields that change the decoder's math, with the values our decoder computes: any other
# value is refused at start (models.registry.check_supported), never silently ignored.
COMPUTED_VALUES: dict[str, tuple[Any, ...]] = {
    "hidden_act": ("silu", "swish"),
    "mlp_bias": (False,),
    "hidden_activation": ("gelu_pytorch_tanh",),  # Gemma's GeGLU
    # Gemma 4's "vision": image tokens see each other both ways; text stays causal
    "use_bidirectional_attention": (False, "vision"),
}


# Gemma's modelling reads its activation from hidden_activation; its Hub configs also carry a
# hidden_act that nothing reads
IGNORED_FIELDS = {"gemma2": ("hidden_act",), "gemma3_text": ("hidden_act",)}

# Gemma 2's soft-capping, where a Hub config leaves it out (transformers' defaults)
SOFTCAP_DEFAULTS = {"gemma2": {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}}


def uncomputed_fields(config: dict[str, Any]) -> tuple[str, ...]:
    """`field=value` for each config value in COMPUTED_VALUES' fields that we do not compute."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    ignored = IGNORED_FIELDS.get(config.get("model_type", ""), ())
    return tuple(f"{name}={where[name]!r}" for where in (config, rope)
                 for name, values in COMPUTED_VALUES.items()
                 if where.get(name) is not None and where[name] not in values
                 and name not in ignored)


def softcap(config: dict[str, Any], name: str) -> float:
    """A soft-capping value of the config (0: none)."""
    defaults = SOFTCAP_DEFAULTS.get(config.get("model_type", ""), {})
    return float((config[name] if name in config else defaults.get(name)) or 0.0)


# model types whose attention applies the config's sliding_window to every layer
WINDOWED_FAMILIES = ("mistral", "mixtral", "phi3")
# model types that window the layers from max_window_layers on, where use_sliding_window says
# so (with no max_window_layers split: every layer)
SWITCHED_FAMILIES = {"qwen2": True, "qwen3": True, "qwen2_moe": True, "qwen3_moe": False,
                     "qwen2_5_vl_text": True}


def layer_windows(config: dict[str, Any]) -> tuple[int, ...]:
    """Per layer, the attention window in tokens (0: full attention), as transformers applies
    the config: the layers an explicit `layer_types` marks (transformers 5), else all but every
    n-th with Gemma 3's `sliding_window_pattern` n (Gemma 2: every other one), else with
    `use_sliding_window` those from `max_window_layers` on (Qwen), else every layer for the
    families whose attention takes the window (Mistral, Mixtral, Phi-3); other families
    (Llama) ignore a sliding_window."""
    window, layers = config.get("sliding_window") or 0, config["num_hidden_layers"]
    types = config.get("layer_types")
    if types is not None:
        return tuple(window if kind == "sliding_attention" else 0 for kind in types[:layers])
    model_type = config.get("model_type", "")
    pattern = config.get("sliding_window_pattern") or (2 if model_type == "gemma2" else None)
    if pattern:
        return tuple(window if (i + 1) % pattern else 0 for i in range(layers))
    if model_type in SWITCHED_FAMILIES:
        first = layers
        if config.get("use_sliding_window"):
            split = SWITCHED_FAMILIES[model_type]
            first = (config.get("max_window_layers") or 0) if split else 0
    else:
        first = 0 if model_type in WINDOWED_FAMILIES else layers
    return tuple(window if i >= first else 0 for i in range(layers))


@dataclass(frozen=True)
class MoEShape:
    """A mixture-of-experts config: `num_experts` experts of width `intermediate_size`, the top
    `top_k` per token (weights renormalised to sum to one where `renormalize`), in the layers
    `sparse_layers` (the others keep a dense MLP of the config's intermediate_size)."""
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    sparse_layers: tuple[int, ...]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MoEShape | None:
        """Either spelling: the Hub's `num_experts` (Qwen3-MoE) or `num_local_experts`
        (Mixtral, and transformers 5 for both)."""
        experts = config.get("num_local_experts") or config.get("num_experts") or 0
        if not experts:
            return None
        # NOTE: Mixtral's, Qwen3.5's and gpt-oss's routers always renormalise; the others say so
        always = config.get("model_type") in ("mixtral", "qwen3_5_moe", "qwen3_5_moe_text",
                                              "granitemoehybrid", "gpt_oss", "gemma4_text")
        step = config.get("decoder_sparse_step") or 1
        dense = set(config.get("mlp_only_layers") or ())
        return cls(
            num_experts=experts,
            top_k=config.get("num_experts_per_tok") or config.get("top_k_experts") or 2,
            intermediate_size=config.get("moe_intermediate_size") or config["intermediate_size"],
            renormalize=always or bool(config.get("norm_topk_prob", False)),
            sparse_layers=tuple(i for i in range(config["num_hidden_layers"])
                                if i not in dense and (i + 1) % step == 0))


@dataclass(frozen=True)
class LinearAttnShape:
    """A hybrid's linear-attention (Gated DeltaNet) layers: key and value heads and their
    sizes, the width of the causal convolution over q, k and v, and how the checkpoint lays
    out the input projections (`grouped`: Qwen3-Next's in_proj_qkvz and in_proj_ba, grouped
    by key head; else Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a), and
    `tiled`: the output projection takes the value heads tiled over the key heads (k0 k1 ..
    k0 k1 ..) as llama.cpp's Qwen3.5 files lay it out, not grouped by key head (k0 k0 .. k1).
    Both keys are the config's, our own where a GGUF file is converted (models.gguf_hybrid)."""
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    grouped: bool
    tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return self.num_v_heads, self.k_head_dim, self.v_head_dim

    def split(self, ranks: int) -> LinearAttnShape:
        """One rank's share under tensor parallelism: whole key heads, each with its value
        heads; ValueError if they do not split evenly."""
        if self.num_k_heads % ranks:
            raise ValueError(f"--tp-size {ranks}: the {self.num_k_heads} linear-attention key "
                             "heads do not split evenly over the ranks")
        if self.tiled and ranks > 1:
            raise ValueError(f"--tp-size {ranks}: a Qwen3.5 GGUF file's output projections "
                             "take the value heads tiled, which do not split by key head")
        return dataclasses.replace(self, num_k_heads=self.num_k_heads // ranks,
                                   num_v_heads=self.num_v_heads // ranks)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LinearAttnShape:
        return cls(num_k_heads=config["linear_num_key_heads"],
                   num_v_heads=config["linear_num_value_heads"],
                   k_head_dim=config["linear_key_head_dim"],
                   v_head_dim=config["linear_value_head_dim"],
                   conv_kernel=config.get("linear_conv_kernel_dim", 4),
                   grouped=config.get("linear_projections_grouped",
                                      config.get("model_type") == "qwen3_next"),
                   tiled=config.get("linear_value_heads_tiled", False))


@dataclass(frozen=True)
class MambaShape:
    """A hybrid's Mamba2 layers: `heads` heads of `head_dim` channels, each with a
    [head_dim, d_state] state; B and C in `groups` groups; the convolution over x, B and C."""
    heads: int
    head_dim: int
    d_state: int
    groups: int
    conv_kernel: int
    inner: int  # heads x head_dim: the width of x and of the gate
    conv_bias: bool
    proj_bias: bool
    dt_limit: tuple[float, float]

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.d_state

    @property
    def state_shape(self) -> tuple[int, int, int]:
        return self.heads, self.head_dim, self.d_state

    def split(self, ranks: int) -> MambaShape:
        """One rank's share under tensor parallelism: whole groups of B and C, with their
        heads; ValueError if they do not split evenly."""
        if self.groups % ranks or self.heads % ranks:
            raise ValueError(f"--tp-size {ranks}: the Mamba2 layers' {self.groups} groups "
                             f"of {self.heads} heads do not split evenly over the ranks")
        return dataclasses.replace(self, heads=self.heads // ranks,
                                   groups=self.groups // ranks, inner=self.inner // ranks)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MambaShape:
        """Granite's spelling (mamba_n_heads, ...) or Nemotron-H's (mamba_num_heads, ...)."""
        def either(granite: str, nemotron: str, default: Any = None) -> Any:
            return config.get(granite, config.get(nemotron, default))

        heads, head_dim = either("mamba_n_heads", "mamba_num_heads"), either("mamba_d_head",
                                                                             "mamba_head_dim")
        limit = either("time_step_limit", "mamba_dt_limit") or (0.0, float("inf"))
        limit = [json_float(v) for v in limit]
        # NOTE: Nemotron-H's projections take their bias from use_bias, not mamba_proj_bias
        proj_bias = (config.get("use_bias", False) if config.get("model_type") == "nemotron_h"
                     else config.get("mamba_proj_bias", False))
        return cls(heads=heads, head_dim=head_dim,
                   d_state=either("mamba_d_state", "ssm_state_size"),
                   groups=either("mamba_n_groups", "n_groups", 1),
                   conv_kernel=either("mamba_d_conv", "conv_kernel", 4), inner=heads * head_dim,
                   conv_bias=bool(either("mamba_conv_bias", "use_conv_bias", True)),
                   proj_bias=bool(proj_bias), dt_limit=(limit[0], limit[1]))


def json_float(value: Any) -> float:
    """A number of a config.json; transformers writes infinities as {"__float__": "Infinity"}."""
    return float(value["__float__"] if isinstance(value, dict) else value)


# Hub configs of Granite 4's and Nemotron-H's hybrids name their layers in layers_block_type
BLOCK_TYPES = {"mamba": "linear_attention", "attention": "full_attention"}
# Nemotron-H's hybrid_override_pattern, a character per layer; its "mlp" and "moe" layers are
# an MLP or experts alone, with neither KV nor a recurrent state
PATTERN_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
STATELESS_TYPES = ("mlp", "moe")


def layer_types(config: dict[str, Any]) -> tuple[str, ...]:
    """Per layer its kind (`layer_types` in transformers 5's words or, as Granite 4.0-H's Hub
    configs write it, "mamba" and "attention"; or the Hub's layers_block_type or
    hybrid_override_pattern)."""
    layers = config.get("num_hidden_layers")
    blocks = config.get("layer_types") or config.get("layers_block_type") or [
        PATTERN_TYPES.get(char, char) for char in config.get("hybrid_override_pattern") or ""]
    return tuple(BLOCK_TYPES.get(kind, kind) for kind in blocks)[:layers]


def linear_shape(config: dict[str, Any]) -> LinearAttnShape | MambaShape | None:
    """The shape of a hybrid's linear layers (Mamba2 where the config has mamba fields, else
    Gated DeltaNet); None for a model of attention layers only."""
    if "linear_attention" not in layer_types(config):
        return None
    if config.get("mamba_n_heads") or config.get("mamba_num_heads"):
        return MambaShape.from_config(config)
    return LinearAttnShape.from_config(config)


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
    rope: dict[str, Any]  # with the config's max_position_embeddings (YaRN, LongRoPE read it)
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    layer_windows: tuple[int, ...] = ()  # see layer_windows(); () or all 0: none windowed
    rotary_dim: int = 0  # the first rotary_dim dims of each head rotate (partial_rotary_factor)
    served_context: int = 0  # the context the engine serves (Engine sets it; 0: the model's)
    attn_logit_softcap: float = 0.0  # > 0: attention scores s -> cap * tanh(s / cap)
    attention_sinks: bool = False  # a learned logit per query head joins each softmax
    harmony: bool = False  # its chat answers are in OpenAI's harmony format
    final_logit_softcap: float = 0.0  # > 0: the same on the output logits
    moe: MoEShape | None = None  # None: a dense model
    # per layer "full_attention" (or "sliding_attention") or "linear_attention" (a hybrid's
    # Gated DeltaNet, shaped by `linear`); () for a model of attention layers only
    layer_types: tuple[str, ...] = ()
    linear: LinearAttnShape | MambaShape | None = None
    uncomputed: tuple[str, ...] = ()  # see uncomputed_fields()
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # as read

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArch:
        if isinstance(config.get("text_config"), dict):
            # NOTE: a multimodal config (Qwen2.5-VL, Llama 4, Mistral 3) keeps its text model's
            # numbers there: read them, under the checkpoint's own architecture, so that
            # check_supported names it rather than a missing field failing first
            config = {**config["text_config"],
                      **{k: v for k, v in config.items() if k != "text_config"}}
        if "num_hidden_layers" not in config and layer_types(config):
            # NOTE: transformers' NemotronH config counts its layers by layers_block_type
            config = {**config, "num_hidden_layers": len(layer_types(config))}
        archs = config.get("architectures") or [""]
        model_type = config.get("model_type", "")
        heads = config["num_attention_heads"]
        rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        if config.get("original_max_position_embeddings"):  # Phi-3 keeps it here: it wins
            rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
        rope["max_position_embeddings"] = config.get("max_position_embeddings", 4096)
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        partial = config.get("partial_rotary_factor") or rope.get("partial_rotary_factor") or 1.0
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
            head_dim=head_dim,
            rms_norm_eps=config.get("rms_norm_eps", config.get("layer_norm_epsilon", 1e-6)),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            rope=rope,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=traits.get("attention_bias",
                                      bool(config.get("attention_bias", False))),
            qk_norm=traits.get("qk_norm", False),
            eos_token_ids=eos_ids,
            layer_windows=layer_windows(config),
            rotary_dim=int(head_dim * partial),
            attn_logit_softcap=softcap(config, "attn_logit_softcapping"),
            attention_sinks=traits.get("attention_sinks", False),
            harmony=traits.get("harmony", False),
            final_logit_softcap=softcap(config, "final_logit_softcapping"),
            moe=MoEShape.from_config(config),
            layer_types=layer_types(config),
            linear=linear_shape(config),
            uncomputed=uncomputed_fields(config),
            config=dict(config),
        )

    @property
    def rope_positions(self) -> int:
        """The positions a RoPE table covers: the served context."""
        return self.served_context or self.max_position_embeddings

    @property
    def long_rope(self) -> LongRopeSwitch | None:
        """LongRoPE served past its original context: which sequences rotate how."""
        return long_rope_switch(self.rope, self.rope_positions)

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a fixed-size recurrent state instead of KV (kvcache.state_pool)."""
        return self.linear is not None

    @property
    def linear_layers(self) -> int:
        return sum(kind == "linear_attention" for kind in self.layer_types)

    @property
    def kv_layers(self) -> int:
        """Layers whose K and V the KV pool holds (not those that attend to an earlier
        layer's: Gemma 4's num_kv_shared_layers)."""
        stateless = sum(kind in STATELESS_TYPES for kind in self.layer_types)
        shared = self.config.get("num_kv_shared_layers") or 0
        return self.num_layers - self.linear_layers - stateless - shared

    @property
    def largest_head_dim(self) -> int:
        """The largest head size attention runs at in any layer (Gemma 4's global layers have
        one of their own: `global_head_dim`, or transformers 5's `per_layer_config`; latent
        attention runs at the compressed row's, kv_lora_rank + qk_rope_head_dim)."""
        config = self.config
        per_layer = ({} if "global_head_dim" in config
                     else config.get("per_layer_config") or {}).values()
        latent = (config.get("kv_lora_rank") or 0) + (config.get("qk_rope_head_dim") or 0)
        return max(self.head_dim, config.get("global_head_dim") or 0, latent,
                   *(layer.get("head_dim") or 0 for layer in per_layer))

    @property
    def sliding_window(self) -> int | None:
        """The window of the windowed layers, None where every layer attends to everything."""
        return max(self.layer_windows, default=0) or None

    def context_limit(self, requested: int | None) -> int:
        """The context to serve: `requested` (--context-length), at most the model's positions,
        else the model's."""
        if requested and requested > self.max_position_embeddings:
            raise ValueError(f"--context-length {requested} is longer than the model's "
                             f"{self.max_position_embeddings} positions (max_position_embeddings"
                             "; --json-model-override-args can raise it for a RoPE scaling "
                             "that allows more)")
        return requested or self.max_position_embeddings
