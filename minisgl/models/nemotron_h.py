"""NVIDIA Nemotron-H (NemotronHForCausalLM: Nemotron-H, Nemotron Nano 2, Nemotron 3 Nano): a
hybrid decoder in which every layer is one block, x + mixer(norm(x)), its mixer one of four
kinds (the config's hybrid_override_pattern, a character per layer, or layers_block_type):
Mamba2 (M, models.granite_hybrid's mixer over the state pool), attention without RoPE (*, over
the paged KV pool), an MLP (-) or experts (E). MLPs and experts have no gate: down(relu(up x)^2).

The experts are routed as DeepSeek-V3 routes: sigmoid scores; an expert is chosen by its score
plus a per-expert correction bias, among the `topk_group` of `n_group` groups whose two best
biased scores sum highest; its weight is the unbiased score (renormalised over the chosen where
norm_topk_prob), times routed_scaling_factor. A shared expert adds to every token.

dt is clamped to time_step_limit, as NVIDIA's own modelling does (transformers' prefill also
floors it at time_step_min, its decode step does not).

Checkpoint names: the Hub's `backbone.` is `model.`; the final norm is `norm_f`, the embedding
`embeddings`; experts per expert (`experts.N.up_proj.weight`) or stacked (`experts.up_proj`).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.attention import AttentionBackend
from minisgl.core import Batch
from minisgl.distributed import all_reduce
from minisgl.layers import ColumnParallelLinear, Layer, NoRotary, RMSNorm, RowParallelLinear
from minisgl.layers.moe import Experts
from minisgl.models.arch import ModelArch
from minisgl.models.granite_hybrid import Mamba2Mixer
from minisgl.models.llama import Attention, LlamaForCausalLM
from minisgl.models.qwen3_next import HybridStack, RowSpans

KINDS = ("linear_attention", "full_attention", "mlp", "moe")
EXPERT_TENSOR = re.compile(r"^(?P<experts>.*\.mixer\.experts)\.(?:(?P<expert>\d+)\.)?"
                           r"(?P<part>up|down)_proj(?:\.weight)?$")
# Config values that change the math, and the ones we compute (a config without the field
# means the first); any other is refused at start
COMPUTED = {"mlp_hidden_act": ("relu2",), "mamba_hidden_act": ("silu",),
            "attention_bias": (False,), "residual_in_fp32": (False,), "n_shared_experts": (1,),
            "moe_latent_size": (None,), "sliding_window": (None,)}


def refused_fields(config: dict[str, Any]) -> list[str]:
    """`field=value` for each config value our decoder does not compute."""
    refused = [f"{name}={config[name]!r}" for name, values in COMPUTED.items()
               if config.get(name, values[0]) not in values]
    use_bias = bool(config.get("use_bias", False))
    if bool(config.get("mamba_proj_bias", use_bias)) != use_bias:
        refused.append(f"mamba_proj_bias={config['mamba_proj_bias']!r} (the projections' bias "
                       f"is use_bias={use_bias})")
    groups = config.get("n_group") or 1
    experts = config.get("n_routed_experts") or 0
    if experts and (experts % groups or experts // groups < 2):
        refused.append(f"n_group={groups} (of {experts} experts: groups of two or more)")
    return refused


class ReluSquared(Layer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In place: x is a projection's fresh output (a prefill chunk's new tensors each cost
        their page faults on CPU)."""
        return F.relu(x, inplace=True).square_()


class Relu2MLP(Layer):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size)
        self.act = ReluSquared()
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class GroupedSigmoidRouter(Layer):
    """See the module's docstring; float32 throughout (the checkpoint keeps its weights so)."""

    def __init__(self, hidden_size: int, config: dict[str, Any]) -> None:
        super().__init__()
        experts = config["n_routed_experts"]
        self.weight = nn.Parameter(torch.empty(experts, hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.empty(experts, dtype=torch.float32),
                                                    requires_grad=False)
        self.top_k = config.get("num_experts_per_tok", 2)
        self.groups, self.top_groups = config.get("n_group") or 1, config.get("topk_group") or 1
        self.renormalize = bool(config.get("norm_topk_prob", True))
        self.scale = float(config.get("routed_scaling_factor", 1.0))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k])."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight))
        biased = scores + self.e_score_correction_bias
        if self.top_groups < self.groups:
            grouped = biased.view(x.shape[0], self.groups, -1)
            best = grouped.topk(2, dim=-1).values.sum(-1)  # [T, groups]
            kept = torch.zeros_like(best, dtype=torch.bool).scatter_(
                1, best.topk(self.top_groups, dim=-1).indices, True)
            biased = grouped.masked_fill(~kept[:, :, None], float("-inf")).view(x.shape[0], -1)
        ids = biased.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return (weights * self.scale).to(x.dtype), ids


class NemotronHMoE(Layer):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        config = arch.config
        self.gate = GroupedSigmoidRouter(arch.hidden_size, config)
        self.experts = Experts(config["n_routed_experts"], arch.hidden_size,
                               config["moe_intermediate_size"], act=ReluSquared())
        self.shared_experts = Relu2MLP(arch.hidden_size,
                                       config["moe_shared_expert_intermediate_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return all_reduce(self.experts(x, weights, ids)) + self.shared_experts(x)


class NemotronHBlock(Layer):
    def __init__(self, arch: ModelArch, kind: str, mixer: Layer) -> None:
        super().__init__()
        self.kind = kind
        self.is_linear = kind == "linear_attention"
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        if kind == "full_attention":  # NOTE: the engine finds KV heads on a layer's self_attn
            self.self_attn = mixer
        else:
            self.mixer = mixer

    @property
    def linear_mixer(self) -> Mamba2Mixer:
        return self.mixer

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                batch: Batch, backend: AttentionBackend, spans: RowSpans
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.norm(x, residual)
        if self.is_linear:
            return self.mixer(x, spans), residual
        if self.kind == "full_attention":
            return self.self_attn(x, positions, batch, backend), residual
        return self.mixer(x), residual


class NemotronHForCausalLM(HybridStack, LlamaForCausalLM):
    # its MLPs' up_proj is a plain projection, not half of a gate/up pair
    STACKED: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}

    def decoder_layers(self, arch: ModelArch) -> nn.ModuleList:
        unknown = sorted(set(arch.layer_types) - set(KINDS))
        refused = refused_fields(arch.config) + [f"layer kind {kind!r}" for kind in unknown]
        if refused:
            raise ValueError(f"{arch.architecture}: the config's {', '.join(refused)} is not "
                             "computed by minisgl's Nemotron-H decoder")
        rotary = NoRotary()
        layers, linear_id, kv_index = [], 0, 0
        for kind in arch.layer_types:
            mixer: Layer
            if kind == "linear_attention":
                mixer, linear_id = Mamba2Mixer(arch, linear_id), linear_id + 1
            elif kind == "full_attention":
                mixer, kv_index = Attention(arch, kv_index, rotary), kv_index + 1
            elif kind == "mlp":
                mixer = Relu2MLP(arch.hidden_size, arch.intermediate_size)
            else:
                mixer = NemotronHMoE(arch)
            layers.append(NemotronHBlock(arch, kind, mixer))
        return nn.ModuleList(layers)

    def our_name(self, name: str) -> str:
        """A checkpoint tensor's name in our modules' naming."""
        if name.startswith("backbone."):
            name = "model." + name.removeprefix("backbone.")
        name = {"model.embeddings.weight": "model.embed_tokens.weight",
                "model.norm_f.weight": "model.norm.weight"}.get(name, name)
        parts = name.split(".")
        if (len(parts) > 3 and parts[1] == "layers" and parts[3] == "mixer"
                and int(parts[2]) < self.arch.num_layers
                and self.arch.layer_types[int(parts[2])] == "full_attention"):
            parts[3] = "self_attn"
        return ".".join(parts)

    def weight_target(self, name: str) -> tuple[nn.Module, str, Any] | None:
        """As Llama's, for the checkpoint's names; an experts tensor's target is the Experts
        module, its part (up, down) and the expert (None: all of them, stacked)."""
        name = self.our_name(name)
        match = EXPERT_TENSOR.match(name)
        if match is None:
            return super().weight_target(name)
        try:
            experts = self.get_submodule(match["experts"].removeprefix("model."))
        except AttributeError:
            return None
        return experts, match["part"], None if match["expert"] is None else int(match["expert"])

    def load_weight(self, name: str, source: Any) -> bool:
        if name.startswith("mtp."):
            return True  # the multi-token-prediction layers are not served
        name = self.our_name(name)
        if EXPERT_TENSOR.match(name) is None or self.skips(name):
            return super().load_weight(name, source)
        target = self.weight_target(name)
        if target is None:
            return False
        experts, part, expert = target
        experts.load(expert, part, source)
        return True

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor of a checkpoint of this model (transformers' naming),
        for --load-format dummy."""
        arch, hidden = self.arch, self.arch.hidden_size
        shapes: dict[str, tuple[int, ...]] = {"model.embeddings.weight": (arch.vocab_size,
                                                                          hidden)}
        for i, kind in enumerate(arch.layer_types):
            p = f"model.layers.{i}."
            shapes[p + "norm.weight"] = (hidden,)
            shapes.update({p + "mixer." + name: shape
                           for name, shape in mixer_shapes(arch, kind).items()})
        shapes["model.norm_f.weight"] = (hidden,)
        if not arch.tie_word_embeddings:
            shapes["lm_head.weight"] = (arch.vocab_size, hidden)
        return shapes


def mixer_shapes(arch: ModelArch, kind: str) -> dict[str, tuple[int, ...]]:
    hidden, config = arch.hidden_size, arch.config
    if kind == "linear_attention":
        s = arch.linear
        shapes: dict[str, tuple[int, ...]] = {
            "in_proj.weight": (s.inner + s.conv_dim + s.heads, hidden),
            "conv1d.weight": (s.conv_dim, 1, s.conv_kernel), "dt_bias": (s.heads,),
            "A_log": (s.heads,), "D": (s.heads,), "norm.weight": (s.inner,),
            "out_proj.weight": (hidden, s.inner)}
        if s.conv_bias:
            shapes["conv1d.bias"] = (s.conv_dim,)
        if s.proj_bias:
            shapes.update({"in_proj.bias": (s.inner + s.conv_dim + s.heads,),
                           "out_proj.bias": (hidden,)})
        return shapes
    if kind == "full_attention":
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        return {"q_proj.weight": (q, hidden), "k_proj.weight": (kv, hidden),
                "v_proj.weight": (kv, hidden), "o_proj.weight": (hidden, q)}
    if kind == "mlp":
        return {"up_proj.weight": (arch.intermediate_size, hidden),
                "down_proj.weight": (hidden, arch.intermediate_size)}
    experts, width = config["n_routed_experts"], config["moe_intermediate_size"]
    shared = config["moe_shared_expert_intermediate_size"]
    return {"gate.weight": (experts, hidden), "gate.e_score_correction_bias": (experts,),
            "experts.up_proj": (experts, width, hidden),
            "experts.down_proj": (experts, hidden, width),
            "shared_experts.up_proj.weight": (shared, hidden),
            "shared_experts.down_proj.weight": (hidden, shared)}
