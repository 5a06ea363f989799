"""The Llama family decoder (Llama 2/3, SmolLM2), also Qwen2 and Qwen3 (their traits: ModelArch).

Runs over a flat batch of tokens: input_ids [T], positions [T]; attention reads and writes the
paged KV pool through the attention backend, which knows where each request's tokens live.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from minisgl.attention import AttentionBackend
from minisgl.core import Batch
from minisgl.layers import (
    Layer,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    SiluAndMul,
    VocabParallelEmbedding,
)
from minisgl.layers.shard import load_head_rows
from minisgl.models.arch import ModelArch

LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


class Attention(Layer):
    """With `arch.attention_sinks` (gpt-oss): a learned logit per query head in each softmax,
    and the output projection biased as q/k/v are."""

    def __init__(self, arch: ModelArch, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_heads,
                                          arch.num_kv_heads, bias=arch.attention_bias)
        self.o_proj = RowParallelLinear(arch.num_heads * arch.head_dim, arch.hidden_size,
                                        bias=arch.attention_sinks)
        # this rank's query heads' sink logits
        self.sinks = (nn.Parameter(torch.empty(self.qkv_proj.num_heads), requires_grad=False)
                      if arch.attention_sinks else None)
        self.rotary = rotary
        self.query_scale = 1.0  # Gemma: its query_pre_attn_scalar over the backend's head_dim
        if arch.qk_norm:
            self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
            self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, batch: Batch,
                backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(q.shape[0], -1, self.head_dim)
        k = k.view(k.shape[0], -1, self.head_dim)
        v = v.view(v.shape[0], -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm.forward_plain(q), self.k_norm.forward_plain(k)
        q, k = self.rotary(positions, q, k)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        return self.o_proj(backend.forward(q, k, v, self.layer_id, batch, self.sinks))

    def load(self, name: str, source: Any, shard_id: Any = None) -> None:
        """sinks: this rank's query heads'."""
        load_head_rows(getattr(self, name), source, name)


class MLP(Layer):
    def __init__(self, arch: ModelArch, act: Layer | None = None) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            arch.hidden_size, [arch.intermediate_size] * 2, bias=False)
        self.act = act or SiluAndMul()
        self.down_proj = RowParallelLinear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(Layer):
    """`mlp` and `attention` stand in for the Llama MLP and attention where given."""

    def __init__(self, arch: ModelArch, layer_id: int, rotary: RotaryEmbedding,
                 mlp: Layer | None = None, attention: Layer | None = None) -> None:
        super().__init__()
        self.self_attn = attention if attention is not None else Attention(arch, layer_id, rotary)
        self.mlp = mlp if mlp is not None else MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                batch: Batch, backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, batch, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def with_image_embeddings(x: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The input embeddings with an image's placeholders' rows replaced by its encoder's
    output (Batch.input_embeds), in place."""
    if batch.input_embeds is not None:  # NOTE: values may carry more per row (Qwen3-VL's)
        rows, values = batch.input_embeds
        x[rows] = values[:, :x.shape[1]]
    return x


class LlamaForCausalLM(Layer):
    # checkpoint projection name -> (our merged module, shard id)
    STACKED = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = VocabParallelEmbedding(arch.vocab_size, arch.hidden_size)
        self.layers = self.decoder_layers(arch)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        tied = self.embed_tokens if arch.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(arch.vocab_size, arch.hidden_size, tied,
                                      arch.final_logit_softcap)
        self.fused_layers: Any = None  # the layers as one call on CPU (models.fused_layers)

    def decoder_layers(self, arch: ModelArch) -> nn.ModuleList:
        rotary = RotaryEmbedding(arch.head_dim, arch.rope_positions, arch.rope, arch.rotary_dim)
        return nn.ModuleList(DecoderLayer(arch, i, rotary, self.layer_mlp(arch, i))
                             for i in range(arch.num_layers))

    def layer_mlp(self, arch: ModelArch, layer_id: int) -> Layer | None:
        """What stands in for layer `layer_id`'s dense MLP (None: the MLP itself)."""
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Batch,
                backend: AttentionBackend, logit_rows: torch.Tensor | None) -> torch.Tensor:
        """Logits [len(logit_rows), vocab] for the chosen token rows (all rows when None)."""
        return self.lm_head(self.hidden_states(input_ids, positions, batch, backend, logit_rows))

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: Batch,
                      backend: AttentionBackend, rows: torch.Tensor | None) -> torch.Tensor:
        """Final hidden states [len(rows), hidden] of the chosen token rows (all when None)."""
        x, residual = with_image_embeddings(self.embed(input_ids), batch), None
        if self.fused_layers is not None and self.fused_layers.runs(batch, positions):
            x, residual = self.fused_layers(x, positions, batch, backend)
        else:
            for layer in self.layers:
                x, residual = layer(x, residual, positions, batch, backend)
        x, _ = self.norm(x, residual)
        return x if rows is None else x.index_select(0, rows)

    def skips(self, name: str) -> bool:
        """Checkpoint tensors (HF naming) that are ours but have no place here: a tied head,
        rotary buffers, and the layers past num_layers. Every loader asks this one place, so a
        layer-count override (`{"num_hidden_layers": 2}`) serves the checkpoint's first
        layers whatever the format."""
        name = name.removeprefix("model.")
        layer = LAYER_INDEX.match(name)
        return (name == "lm_head.weight" and self.arch.tie_word_embeddings) or \
            "rotary_emb" in name or (layer is not None and int(layer[1]) >= self.arch.num_layers)

    def weight_target(self, name: str) -> tuple[nn.Module, str, Any] | None:
        """(module, parameter name, shard id) a checkpoint tensor (HF naming) loads into, or
        None if it has none."""
        module_path, _, param = name.removeprefix("model.").rpartition(".")
        parent_path, _, leaf = module_path.rpartition(".")
        shard_id = None
        if leaf in self.STACKED:
            leaf, shard_id = self.STACKED[leaf]
        try:
            module = self.get_submodule(f"{parent_path}.{leaf}" if parent_path else leaf)
        except AttributeError:
            return None
        return module, param, shard_id

    def load_weight(self, name: str, source: Any) -> bool:
        """Copy one checkpoint tensor (HF naming) into its shard; False if it is not ours."""
        if self.skips(name):
            return True
        target = self.weight_target(name)
        if target is None:
            return False
        module, param, shard_id = target
        if hasattr(module, "load"):
            module.load(param, source, shard_id)
        else:
            from minisgl.layers.shard import copy_into, read_all
            copy_into(getattr(module, param).data, read_all(source), name)
        return True
