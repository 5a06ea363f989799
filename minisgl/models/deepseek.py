"""DeepSeek-V2 and V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): multi-head latent
attention (MLA) and routed experts with shared ones.

MLA: each token's keys and values come from one compressed row: a latent c (kv_lora_rank dims,
normed) and a RoPE'd key part k_r (qk_rope_head_dim dims) shared by every head. Per head h,
kv_b_proj expands c to the head's key part W_uk[h] c and value W_uv[h] c. The cache keeps
[c, k_r] alone (kvcache.pool.KVLayout.latent), and the expansion is absorbed into the query and
the output ("absorbed weights"): score_h = (W_uk[h]^T q_nope_h) . c + q_rope_h . k_r, and the
head's output is W_uv[h] applied to the probability-weighted sum of the c's. That is attention
of one KV head of kv_lora_rank + qk_rope_head_dim dims whose values are its first kv_lora_rank
dims, run by the attention backend as any other, for prefill and decode alike. The query comes
from q_proj, or with q_lora_rank through q_a_proj, a norm and q_b_proj. Scores are scaled by
(qk_nope_head_dim + qk_rope_head_dim)^-1/2, times YaRN's mscale(factor, mscale_all_dim)^2
under YaRN.

RoPE: the checkpoints rotate adjacent pairs (x0, x1), (x2, x3), ... (V2 always, V3 with
rope_interleave, its default); the rows that make q's and k's rope parts are permuted at load
(evens, then odds), so the usual rotate-half RoPE gives the same scores.

Experts (layers from first_k_dense_replace on; the first ones keep a dense MLP): a router over
n_routed_experts (V3: sigmoid scores, a correction bias that steers the choice and not the
weights, the top topk_group of n_group groups by their two best; V2: softmax, greedy or
group-limited by each group's best), weights renormalised where norm_topk_prob says so and
scaled by routed_scaling_factor; n_shared_experts shared experts as one MLP beside them.
Tensor parallelism splits the heads and every expert's width; the compressed row is computed
and cached whole on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.attention import AttentionBackend
from minisgl.core import Batch
from minisgl.distributed import all_reduce, get_tp_info
from minisgl.kvcache import KVLayout
from minisgl.layers import (
    ColumnParallelLinear,
    Layer,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
)
from minisgl.layers.linear import divide
from minisgl.layers.moe import Experts
from minisgl.layers.rotary import yarn_mscale
from minisgl.layers.shard import copy_into, read_all, read_rows
from minisgl.models.arch import ModelArch
from minisgl.models.dummy_weights import mlp_shapes
from minisgl.models.llama import MLP, DecoderLayer
from minisgl.models.moe import MoEForCausalLM

V2_ROUTINGS = ("greedy", "group_limited_greedy")


@dataclasses.dataclass(frozen=True)
class MLAShape:
    heads: int
    q_lora_rank: int  # 0: q_proj straight from the hidden state
    kv_lora_rank: int
    nope: int  # qk_nope_head_dim
    rope: int  # qk_rope_head_dim
    value: int  # v_head_dim

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MLAShape:
        return cls(heads=config["num_attention_heads"], q_lora_rank=config.get("q_lora_rank") or 0,
                   kv_lora_rank=config["kv_lora_rank"], nope=config["qk_nope_head_dim"],
                   rope=config["qk_rope_head_dim"], value=config["v_head_dim"])

    @property
    def latent_dim(self) -> int:
        """A cached row: the latent and the rope'd key part."""
        return self.kv_lora_rank + self.rope


def interleaved_to_halves(dims: int) -> torch.Tensor:
    """The order that turns adjacent rotary pairs into the two halves rotate-half expects."""
    return torch.cat((torch.arange(0, dims, 2), torch.arange(1, dims, 2)))


def rope_rows(shape: MLAShape, compressed: bool) -> torch.Tensor:
    """The rows of q's projection (every head: its nope rows, then its rope rows), or of the
    compressed row's (`compressed`: the latent, then the rope rows), with the rope rows'
    adjacent pairs reordered into halves."""
    order = interleaved_to_halves(shape.rope)
    if compressed:
        return torch.cat((torch.arange(shape.kv_lora_rank), shape.kv_lora_rank + order))
    per_head = torch.cat((torch.arange(shape.nope), shape.nope + order))
    return (torch.arange(shape.heads)[:, None] * (shape.nope + shape.rope) + per_head).flatten()


class HeadRows(Layer):
    """kv_b_proj's weight, kept dense for the absorbed products: this rank's heads' rows,
    [heads / tp, nope + value, kv_lora_rank] flattened. It loads whole, or as the two parts a
    llama.cpp file keeps: `k_b` [heads, kv_lora_rank, nope] (transposed) and `v_b`
    [heads, value, kv_lora_rank]."""

    def __init__(self, heads: int, nope: int, value: int, columns: int) -> None:
        super().__init__()
        self.heads = divide(heads, get_tp_info().size, "attention heads")
        self.nope, self.rows = nope, self.heads * (nope + value)
        self.weight = nn.Parameter(torch.empty(self.rows, columns), requires_grad=False)

    def load(self, name: str, source: Any, shard_id: Any = None) -> None:
        first = get_tp_info().rank * self.heads
        if name == "weight":
            copy_into(self.weight.data, read_rows(source, first * (self.rows // self.heads),
                                                  self.rows), name)
            return
        part = read_rows(source, first, self.heads)
        per_head = self.weight.data.view(self.heads, -1, self.weight.shape[1])
        if name == "k_b":
            copy_into(per_head[:, :self.nope], part.transpose(1, 2), name)
        else:
            copy_into(per_head[:, self.nope:], part, name)


class LatentAttention(Layer):
    def __init__(self, arch: ModelArch, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        s = self.shape = MLAShape.from_config(arch.config)
        hidden, qk = arch.hidden_size, s.nope + s.rope
        self.layer_id, self.rotary = layer_id, rotary
        bias = arch.attention_bias
        if s.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, s.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(s.q_lora_rank, arch.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(s.q_lora_rank, s.heads * qk)
        else:
            self.q_proj = ColumnParallelLinear(hidden, s.heads * qk)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, s.latent_dim, bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, arch.rms_norm_eps)
        self.kv_b_proj = HeadRows(s.heads, s.nope, s.value, s.kv_lora_rank)
        self.o_proj = RowParallelLinear(s.heads * s.value, hidden, bias)
        rope = arch.rope
        scale = qk ** -0.5
        if rope.get("rope_type", rope.get("type")) == "yarn" and rope.get("mscale_all_dim"):
            scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
        # the backend scales scores by arch.head_dim^-1/2 (attention_for)
        self.query_scale = scale * arch.head_dim ** 0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: Batch,
                backend: AttentionBackend) -> torch.Tensor:
        s, tokens = self.shape, x.shape[0]
        if s.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm.forward_plain(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(tokens, -1, s.nope + s.rope)
        q_nope, q_rope = q.split([s.nope, s.rope], dim=-1)
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm.forward_plain(compressed[:, :s.kv_lora_rank].contiguous())
        k_rope = compressed[:, None, s.kv_lora_rank:].contiguous()
        q_rope, k_rope = self.rotary(positions, q_rope.contiguous(), k_rope)
        w = self.kv_b_proj.weight.view(-1, s.nope + s.value, s.kv_lora_rank)
        # [tokens, heads, nope] x [heads, nope, latent]: each head's query in latent space
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w[:, :s.nope])
        query = torch.cat((q_latent, q_rope), dim=-1) * self.query_scale
        key = torch.cat((latent[:, None], k_rope), dim=-1)  # [tokens, 1, latent + rope]
        out = backend.forward(query, key, key[..., :s.kv_lora_rank], self.layer_id, batch)
        out = torch.einsum("thl,hvl->thv", out.view(tokens, -1, s.kv_lora_rank), w[:, s.nope:])
        return self.o_proj(out.reshape(tokens, -1))


class DeepseekRouter(Layer):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        config = arch.config
        experts = config["n_routed_experts"]
        self.weight = nn.Parameter(torch.empty(experts, arch.hidden_size), requires_grad=False)
        # NOTE: as transformers reads the configs: V3's router is always sigmoid and grouped
        self.sigmoid = arch.architecture == "DeepseekV3ForCausalLM"
        self.method = "grouped" if self.sigmoid else config.get("topk_method") or "greedy"
        scoring = config.get("scoring_func") or ("sigmoid" if self.sigmoid else "softmax")
        if self.method not in ("grouped", *V2_ROUTINGS) or scoring != (
                "sigmoid" if self.sigmoid else "softmax"):
            raise ValueError(f"{arch.architecture}: routing by topk_method "
                             f"{config.get('topk_method')!r} and scoring_func {scoring!r} is not "
                             "what minisgl computes for it")
        self.e_score_correction_bias = (nn.Parameter(torch.empty(experts), requires_grad=False)
                                        if self.sigmoid else None)
        self.top_k, self.groups = config["num_experts_per_tok"], config.get("n_group") or 1
        self.top_groups = config.get("topk_group") or self.groups
        self.renormalize = bool(config.get("norm_topk_prob"))
        self.scaling = float(config.get("routed_scaling_factor") or 1.0)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)
        choice = scores if self.e_score_correction_bias is None else (
            scores + self.e_score_correction_bias.float())
        if self.method != "greedy":
            grouped = choice.view(x.shape[0], self.groups, -1)
            group_scores = (grouped.topk(2, dim=-1)[0].sum(dim=-1) if self.sigmoid
                            else grouped.max(dim=-1).values)
            best = torch.topk(group_scores, self.top_groups, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            dropped = float("-inf") if self.sigmoid else 0.0
            choice = grouped.masked_fill(~keep[..., None], dropped).view(x.shape[0], -1)
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.scaling).to(x.dtype), ids


class DeepseekMoE(Layer):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        config = arch.config
        width = config["moe_intermediate_size"]
        self.gate = DeepseekRouter(arch)
        self.experts = Experts(config["n_routed_experts"], arch.hidden_size, width)
        shared = config.get("n_shared_experts") or 0
        self.shared_experts = (MLP(dataclasses.replace(arch, intermediate_size=width * shared))
                               if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is None:
            return all_reduce(out)
        return self.shared_experts(x) + all_reduce(out)


class DeepseekV2ForCausalLM(MoEForCausalLM):
    STACKED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def decoder_layers(self, arch: ModelArch) -> nn.ModuleList:
        s = MLAShape.from_config(arch.config)
        rotary = RotaryEmbedding(s.rope, arch.rope_positions, arch.rope)
        dense = arch.config.get("first_k_dense_replace") or 0
        return nn.ModuleList(
            DecoderLayer(arch, i, rotary, attention=LatentAttention(arch, i, rotary),
                         mlp=MLP(arch) if i < dense or not arch.config.get("n_routed_experts")
                         else DeepseekMoE(arch))
            for i in range(arch.num_layers))

    def kv_layout(self) -> KVLayout:
        """One compressed row per token and layer, whole on every rank."""
        s = MLAShape.from_config(self.arch.config)
        return KVLayout(((1, s.latent_dim),) * self.arch.num_layers, latent=s.kv_lora_rank)

    @property
    def interleaved(self) -> bool:
        """Whether the checkpoint's rope rows hold adjacent pairs (V2's always; V3's by
        rope_interleave; a converted GGUF file says false: reordered as it is read)."""
        return self.arch.config.get("rope_interleave", True)

    def load_weight(self, name: str, source: Any) -> bool:
        rope_parts = (".self_attn.q_proj.", ".self_attn.q_b_proj.",
                      ".self_attn.kv_a_proj_with_mqa.")
        if self.interleaved and any(part in name for part in rope_parts) and not self.skips(name):
            rows = rope_rows(MLAShape.from_config(self.arch.config),
                             ".kv_a_proj_with_mqa." in name)
            source = read_all(source).index_select(0, rows)
        return super().load_weight(name, source)


    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor of a checkpoint of this config, the Hub's per-expert
        names (--load-format dummy)."""
        arch, config = self.arch, self.arch.config
        s, hidden = MLAShape.from_config(config), arch.hidden_size
        qk = s.nope + s.rope
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (arch.vocab_size, hidden), "model.norm.weight": (hidden,)}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            shapes.update({p + "input_layernorm.weight": (hidden,),
                           p + "post_attention_layernorm.weight": (hidden,),
                           a + "kv_a_proj_with_mqa.weight": (s.latent_dim, hidden),
                           a + "kv_a_layernorm.weight": (s.kv_lora_rank,),
                           a + "kv_b_proj.weight": (s.heads * (s.nope + s.value), s.kv_lora_rank),
                           a + "o_proj.weight": (hidden, s.heads * s.value)})
            if s.q_lora_rank:
                shapes.update({a + "q_a_proj.weight": (s.q_lora_rank, hidden),
                               a + "q_a_layernorm.weight": (s.q_lora_rank,),
                               a + "q_b_proj.weight": (s.heads * qk, s.q_lora_rank)})
            else:
                shapes[a + "q_proj.weight"] = (s.heads * qk, hidden)
            if not isinstance(layer.mlp, DeepseekMoE):
                shapes.update(mlp_shapes(p + "mlp.", hidden, arch.intermediate_size))
                continue
            experts, width = config["n_routed_experts"], config["moe_intermediate_size"]
            shapes[p + "mlp.gate.weight"] = (experts, hidden)
            if layer.mlp.gate.e_score_correction_bias is not None:
                shapes[p + "mlp.gate.e_score_correction_bias"] = (experts,)
            for e in range(experts):
                shapes.update(mlp_shapes(f"{p}mlp.experts.{e}.", hidden, width))
            if layer.mlp.shared_experts is not None:
                shapes.update(mlp_shapes(p + "mlp.shared_experts.", hidden,
                                         width * config["n_shared_experts"]))
        if not arch.tie_word_embeddings:
            shapes["lm_head.weight"] = (arch.vocab_size, hidden)
        return shapes


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass
