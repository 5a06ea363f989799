"""Gemma 4 (text): Gemma 3's layer (four norms around attention and MLP, q/k norms, GeGLU,
embeddings scaled by sqrt(hidden), a local and a global RoPE by layer type), with
- norms that multiply by w (not 1 + w); values normed too, without a weight; attention scores
  unscaled (the q/k norms set their size);
- global (full-attention) layers with a head size and KV heads of their own
  (`global_head_dim`, `num_global_key_value_heads`; transformers 5 writes them per layer in
  `per_layer_config`), rotated by "proportional" RoPE (layers.rotary), and with
  `attention_k_eq_v` values taken from the key projection (before its norm and RoPE);
- KV shared across layers: the last `num_kv_shared_layers` compute no K/V and attend to the
  KV of the last earlier layer of their type. The KV pool holds the producing layers only,
  one buffer per shape (kvcache.pool.KVLayout); a sharing layer passes its producer's new
  K/V with the producer's KV index, so the backend rewrites the same values where they are;
- per-layer inputs (PLE): a second embedding of every token (`embed_tokens_per_layer`, a slice
  per layer) mixed with a normed projection of the first, gated into each layer's output;
  with `use_double_wide_mlp` the KV-sharing layers' MLP is twice as wide;
- with `enable_moe_block` (26B-A4B): experts beside the dense MLP in every layer, each branch
  normed on its own, routed from the residual stream by a router that norms its input, scales
  it per feature and weights each expert by a learned scale;
- a learned scalar per layer on its output; final logits soft-capped (ModelArch).

A multimodal checkpoint (`Gemma4ForConditionalGeneration`) is served as its text model:
models.weights reads its `text_config`; its vision and audio towers are skipped.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.attention import AttentionBackend
from minisgl.attention.torch_backend import KernelMetadata, TorchBackend
from minisgl.core import Batch
from minisgl.distributed import all_reduce
from minisgl.kvcache import KVLayout
from minisgl.layers import (
    ColumnParallelLinear,
    GeluTanhAndMul,
    Layer,
    QKVParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minisgl.layers.moe import Experts
from minisgl.models.arch import ModelArch
from minisgl.models.gemma import layer_ropes
from minisgl.models.llama import LAYER_INDEX, MLP, LlamaForCausalLM
from minisgl.models.weights import text_model_name

# a multimodal checkpoint's towers
TOWER_PREFIXES = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.",
                  "model.embed_audio.", "vision_tower.", "audio_tower.", "embed_vision.",
                  "embed_audio.")
# the checkpoint's stacked experts (a GGUF file's with a .weight suffix)
EXPERT_TENSOR = re.compile(r"^(?P<experts>.*\.experts)\.(?P<part>gate_up|down)_proj(\.weight)?$")
# a KV-sharing layer's tensors that the checkpoints carry and nothing reads
UNREAD_SHARED = ("k_proj", "v_proj", "k_norm", "v_norm")


@dataclasses.dataclass(frozen=True)
class Gemma4Layout:
    """Per layer of a Gemma 4 config: its type, KV heads and head size (all ranks), and the
    layer whose K/V it attends to (itself unless it shares). The global layers' sizes come
    from the Hub's spelling where the config has it (also an override of a multimodal
    config, which transformers converts to per_layer_config), else from per_layer_config."""
    types: tuple[str, ...]
    kv_heads: tuple[int, ...]
    head_dims: tuple[int, ...]
    sources: tuple[int, ...]

    @classmethod
    def from_config(cls, config: dict[str, Any], types: tuple[str, ...]) -> Gemma4Layout:
        layers = len(types)
        hub = "global_head_dim" in config or "num_global_key_value_heads" in config
        per_layer = {} if hub else {int(k): v for k, v in
                                    (config.get("per_layer_config") or {}).items()}
        global_heads = (config.get("num_global_key_value_heads")
                        if config.get("attention_k_eq_v") else None)
        kv_heads, head_dims = [], []
        for i, kind in enumerate(types):
            own: dict[str, Any] = per_layer.get(i, {})
            if not per_layer and kind == "full_attention":
                own = {"head_dim": config.get("global_head_dim") or 512,
                       "num_key_value_heads": global_heads}
            kv_heads.append(own.get("num_key_value_heads") or config["num_key_value_heads"])
            head_dims.append(own.get("head_dim") or config["head_dim"])
        first_shared = layers - (config.get("num_kv_shared_layers") or 0)
        sources = list(range(layers))
        for i in range(first_shared, layers):
            earlier = [j for j in range(first_shared) if types[j] == types[i]]
            if not earlier:
                raise ValueError(f"Gemma 4: layer {i} shares the KV of an earlier "
                                 f"{types[i]} layer, and there is none")
            sources[i] = earlier[-1]
        return cls(types, tuple(kv_heads), tuple(head_dims), tuple(sources))

    def shares(self, layer_id: int) -> bool:
        return self.sources[layer_id] != layer_id

    @property
    def first_shared(self) -> int:
        """The first layer that shares an earlier one's K/V (the layer count: none)."""
        return next((i for i in range(len(self.types)) if self.shares(i)), len(self.types))


def attends_rows(backend: AttentionBackend, batch: Batch) -> bool:
    """Whether some token rows of `batch` can run alone: `backend` attends them so (the CPU
    kernel's), and no row takes a LoRA adapter (a step's adapter layout covers every row)."""
    slots = batch.lora_slots
    return (isinstance(backend, TorchBackend) and backend.kernels is not None
            and isinstance(batch.attn_metadata, KernelMetadata)
            and (slots is None or max(slots[:batch.size], default=-1) < 0))


def mlp_width(arch: ModelArch, layout: Gemma4Layout, layer_id: int) -> int:
    """The dense MLP's width: twice the config's in a KV-sharing layer where
    use_double_wide_mlp says so."""
    wide = arch.config.get("use_double_wide_mlp") and layout.shares(layer_id)
    return (2 if wide else 1) * arch.intermediate_size


def unit_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in float32."""
    return F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


class Gemma4Attention(Layer):
    def __init__(self, arch: ModelArch, layer_id: int, layout: Gemma4Layout,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.kind = layout.types[layer_id]
        self.kv_index = layout.sources[layer_id]  # the producing layer's KV
        self.head_dim = head_dim = layout.head_dims[layer_id]
        self.eps = arch.rms_norm_eps
        self.rotary = rotary
        bias, heads = arch.attention_bias, arch.num_heads
        self.qkv_proj: QKVParallelLinear | None = None
        self.q_proj: ColumnParallelLinear | None = None
        if layout.shares(layer_id):
            self.q_proj = ColumnParallelLinear(arch.hidden_size, heads * head_dim, bias)
        else:
            k_eq_v = bool(arch.config.get("attention_k_eq_v")) and self.kind == "full_attention"
            self.qkv_proj = QKVParallelLinear(arch.hidden_size, head_dim, heads,
                                              layout.kv_heads[layer_id], bias, values=not k_eq_v)
            self.k_norm = RMSNorm(head_dim, self.eps)
        self.q_norm = RMSNorm(head_dim, self.eps)
        self.o_proj = RowParallelLinear(heads * head_dim, arch.hidden_size, bias)
        # the backend scales scores by arch.head_dim^-1/2; Gemma 4 does not scale them
        self.query_scale = arch.head_dim ** 0.5

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: Batch,
                backend: AttentionBackend, shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
                query_rows: torch.Tensor | None = None) -> torch.Tensor:
        """`query_rows`: x holds only these token rows of the batch (a sharing layer's)."""
        tokens, d = x.shape[0], self.head_dim
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj.split(self.qkv_proj(x))
            q, k, v = q.view(tokens, -1, d), k.view(tokens, -1, d), v.view(tokens, -1, d)
            v = unit_rms_norm(v, self.eps)  # NOTE: before k's norm: v may be k's projection
            q, k = self.q_norm.forward_plain(q), self.k_norm.forward_plain(k)
            q, k = self.rotary(positions, q, k)
            shared_kv[self.kind] = k, v
        else:
            q = self.q_norm.forward_plain(self.q_proj(x).view(tokens, -1, d))
            k, v = shared_kv[self.kind]
            q = self.rotary.rotate_queries(positions, q)
        q = q * self.query_scale
        if query_rows is not None:  # the producer stored these K/V already
            return self.o_proj(backend.attend_rows(q, self.kv_index, batch, query_rows))
        return self.o_proj(backend.forward(q, k, v, self.kv_index, batch))


class Gemma4Router(Layer):
    """Softmax over the experts' logits of the normed, per-feature scaled residual stream; the
    top k renormalised, each times its expert's learned scale."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, eps: float) -> None:
        super().__init__()
        self.proj = ReplicatedLinear(hidden, num_experts, bias=False)
        self.scale = nn.Parameter(torch.empty(hidden), requires_grad=False)
        self.per_expert_scale = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        self.top_k, self.eps = top_k, eps

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = unit_rms_norm(h, self.eps) * self.scale * h.shape[-1] ** -0.5
        probs = torch.softmax(self.proj(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[ids]
        return weights.to(h.dtype), ids


class Gemma4DecoderLayer(Layer):
    def __init__(self, arch: ModelArch, layer_id: int, layout: Gemma4Layout,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        config, hidden, eps = arch.config, arch.hidden_size, arch.rms_norm_eps
        self.self_attn = Gemma4Attention(arch, layer_id, layout, rotary)
        self.mlp = MLP(dataclasses.replace(arch, intermediate_size=mlp_width(arch, layout,
                                                                             layer_id)),
                       GeluTanhAndMul())
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(hidden, eps))
        self.router: Gemma4Router | None = None
        if arch.moe is not None:
            moe = arch.moe
            self.router = Gemma4Router(hidden, moe.num_experts, moe.top_k, eps)
            self.experts = Experts(moe.num_experts, hidden, moe.intermediate_size,
                                   act=GeluTanhAndMul(), gated=True)
            for name in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):
                setattr(self, name, RMSNorm(hidden, eps))
        self.per_layer_width = config.get("hidden_size_per_layer_input") or 0
        if self.per_layer_width:
            self.per_layer_input_gate = ReplicatedLinear(hidden, self.per_layer_width, False)
            self.per_layer_projection = ReplicatedLinear(self.per_layer_width, hidden, False)
            self.post_per_layer_input_norm = RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.empty(1), requires_grad=False)

    def forward(self, h: torch.Tensor, per_layer_input: torch.Tensor | None,
                positions: torch.Tensor, batch: Batch, backend: AttentionBackend,
                shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
                query_rows: torch.Tensor | None = None) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm.forward_plain(h), positions, batch, backend,
                           shared_kv, query_rows)
        x, h = self.pre_feedforward_layernorm(self.post_attention_layernorm.forward_plain(x), h)
        y = self.mlp(x)
        if self.router is not None:
            y = self.post_feedforward_layernorm_1.forward_plain(y)
            weights, ids = self.router(h)
            routed = all_reduce(self.experts(self.pre_feedforward_layernorm_2.forward_plain(h),
                                             weights, ids))
            y = y + self.post_feedforward_layernorm_2.forward_plain(routed)
        h = h + self.post_feedforward_layernorm.forward_plain(y)
        if per_layer_input is not None:
            gated = F.gelu(self.per_layer_input_gate(h), approximate="tanh") * per_layer_input
            h = h + self.post_per_layer_input_norm.forward_plain(self.per_layer_projection(gated))
        return h * self.layer_scalar


class Gemma4ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: ModelArch) -> None:
        types = arch.layer_types or tuple("sliding_attention" if w else "full_attention"
                                          for w in arch.layer_windows)
        self.layout = Gemma4Layout.from_config(arch.config, types)
        super().__init__(arch)
        width = arch.config.get("hidden_size_per_layer_input") or 0
        if width:
            vocab = arch.config.get("vocab_size_per_layer_input") or arch.vocab_size
            self.embed_tokens_per_layer = VocabParallelEmbedding(vocab, arch.num_layers * width)
            self.per_layer_model_projection = ReplicatedLinear(
                arch.hidden_size, arch.num_layers * width, False)
            self.per_layer_projection_norm = RMSNorm(width, arch.rms_norm_eps)

    def decoder_layers(self, arch: ModelArch) -> nn.ModuleList:
        ropes = layer_ropes(arch.config)
        rotaries: dict[tuple[str, int], RotaryEmbedding] = {}
        layers = []
        for i, kind in enumerate(self.layout.types):
            key = kind, self.layout.head_dims[i]
            if key not in rotaries:  # NOTE: "proportional" RoPE turns over the whole head
                rotaries[key] = RotaryEmbedding(key[1], arch.rope_positions, ropes[kind])
            layers.append(Gemma4DecoderLayer(arch, i, self.layout, rotaries[key]))
        return nn.ModuleList(layers)

    def kv_layout(self) -> KVLayout:
        """The producing layers' KV shapes on this rank (engine.model_loading.kv_layout)."""
        attentions = [layer.self_attn for i, layer in enumerate(self.layers)
                      if not self.layout.shares(i)]
        assert [a.kv_index for a in attentions] == list(range(len(attentions)))
        return KVLayout(tuple((a.qkv_proj.num_kv_heads, a.head_dim) for a in attentions))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.arch.hidden_size ** 0.5, dtype=x.dtype)

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor
                         ) -> torch.Tensor | None:
        """[tokens, layers, width]: each token's own slice per layer, mixed with a normed
        projection of its embedding."""
        if not hasattr(self, "embed_tokens_per_layer"):
            return None
        tokens, layers = input_ids.shape[0], self.arch.num_layers
        own = self.embed_tokens_per_layer(input_ids)
        width = own.shape[-1] // layers
        own = (own * torch.tensor(width ** 0.5, dtype=own.dtype)).view(tokens, layers, width)
        mixed = self.per_layer_model_projection(embeds) * self.arch.hidden_size ** -0.5
        mixed = self.per_layer_projection_norm.forward_plain(mixed.view(tokens, layers, width))
        return (mixed + own) * 2 ** -0.5

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Batch,
                      backend: AttentionBackend, rows: torch.Tensor | None) -> torch.Tensor:
        h = self.embed(input_ids)
        per_layer = self.per_layer_inputs(input_ids, h)
        shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        query_rows = None
        for i, layer in enumerate(self.layers):
            if i == self.layout.first_shared and rows is not None and rows.numel() < h.shape[0] \
                    and attends_rows(backend, batch):
                # NOTE: from here on no layer writes K/V: only the rows read out need the rest
                query_rows = rows
                h, positions = h.index_select(0, rows), positions.index_select(0, rows)
                per_layer = None if per_layer is None else per_layer.index_select(0, rows)
            h = layer(h, None if per_layer is None else per_layer[:, i], positions, batch,
                      backend, shared_kv, query_rows)
        x = self.norm.forward_plain(h)
        return x if rows is None or query_rows is not None else x.index_select(0, rows)

    def skips(self, name: str) -> bool:
        layer = LAYER_INDEX.search(name)
        if (layer is not None and int(layer[1]) < self.arch.num_layers
                and self.layout.shares(int(layer[1]))
                and any(f".self_attn.{part}." in name for part in UNREAD_SHARED)):
            return True
        return name.startswith(TOWER_PREFIXES) or super().skips(name)

    def weight_target(self, name: str) -> tuple[nn.Module, str, Any] | None:
        name = text_model_name(name)
        experts = EXPERT_TENSOR.match(name)
        if experts is not None:
            try:
                return self.get_submodule(experts["experts"].removeprefix("model.")), \
                    experts["part"], None
            except AttributeError:
                return None
        layer = LAYER_INDEX.search(name)
        if ".self_attn.q_proj." in name and layer is not None and \
                int(layer[1]) < self.arch.num_layers and self.layout.shares(int(layer[1])):
            attention = self.layers[int(layer[1])].self_attn
            return attention.q_proj, name.rpartition(".")[2], None
        return super().weight_target(name)

    def load_weight(self, name: str, source: Any) -> bool:
        name = text_model_name(name)
        if self.skips(name):
            return True
        target = self.weight_target(name)
        if target is not None and isinstance(target[0], Experts):
            target[0].load(None, target[1], source)
            return True
        return super().load_weight(name, source)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor of a Gemma4ForCausalLM checkpoint of this config
        (--load-format dummy)."""
        arch, layout = self.arch, self.layout
        hidden, heads = arch.hidden_size, arch.num_heads
        config = arch.config
        width = config.get("hidden_size_per_layer_input") or 0
        shapes: dict[str, tuple[int, ...]] = {
            "model.embed_tokens.weight": (arch.vocab_size, hidden), "model.norm.weight": (hidden,)}
        if width:
            vocab = config.get("vocab_size_per_layer_input") or arch.vocab_size
            shapes.update({
                "model.embed_tokens_per_layer.weight": (vocab, arch.num_layers * width),
                "model.per_layer_model_projection.weight": (arch.num_layers * width, hidden),
                "model.per_layer_projection_norm.weight": (width,)})
        for i in range(arch.num_layers):
            p, d = f"model.layers.{i}.", layout.head_dims[i]
            a = p + "self_attn."
            shapes.update({a + "q_proj.weight": (heads * d, hidden), a + "q_norm.weight": (d,),
                           a + "o_proj.weight": (hidden, heads * d)})
            if not layout.shares(i):
                kv = layout.kv_heads[i] * d
                shapes.update({a + "k_proj.weight": (kv, hidden), a + "k_norm.weight": (d,)})
                if self.layers[i].self_attn.qkv_proj.values:
                    shapes[a + "v_proj.weight"] = (kv, hidden)
            wide = mlp_width(arch, layout, i)
            shapes.update({p + "mlp.gate_proj.weight": (wide, hidden),
                           p + "mlp.up_proj.weight": (wide, hidden),
                           p + "mlp.down_proj.weight": (hidden, wide), p + "layer_scalar": (1,)})
            norms = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"]
            if arch.moe is not None:
                experts, moe_inter = arch.moe.num_experts, arch.moe.intermediate_size
                norms += ["post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                          "pre_feedforward_layernorm_2"]
                shapes.update({p + "router.proj.weight": (experts, hidden),
                               p + "router.scale": (hidden,),
                               p + "router.per_expert_scale": (experts,),
                               p + "experts.gate_up_proj": (experts, 2 * moe_inter, hidden),
                               p + "experts.down_proj": (experts, hidden, moe_inter)})
            if width:
                norms.append("post_per_layer_input_norm")
                shapes.update({p + "per_layer_input_gate.weight": (width, hidden),
                               p + "per_layer_projection.weight": (hidden, width)})
            shapes.update({f"{p}{norm}.weight": (hidden,) for norm in norms})
        if not arch.tie_word_embeddings:
            shapes["lm_head.weight"] = (arch.vocab_size, hidden)
        return shapes
