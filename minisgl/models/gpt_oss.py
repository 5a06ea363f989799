"""OpenAI's gpt-oss (GptOssForCausalLM): the Llama decoder with
- attention sinks (a learned logit per query head in each softmax's denominator), biased q/k/v
  and o projections, a window on the layers `layer_types` marks sliding (ModelArch);
- experts in every layer: a biased router whose softmax over the top-k logits weights them,
  biased gate/up and down projections, and the clamped SwiGLU
  (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).

Checkpoint: the experts stacked as the model multiplies them, input-major: `gate_up_proj`
[E, hidden, 2 I] with gate and up interleaved (columns 0::2 and 1::2), `down_proj`
[E, I, hidden], their biases `gate_up_proj_bias` / `down_proj_bias`; the router `mlp.router`.
A GGUF file's experts (models.gguf_hybrid) come as `{gate,up,down}_proj.{weight,bias}`,
stacked output-major [E, out, in], gate and up apart. The released checkpoints' MXFP4 experts
(quant_method mxfp4, models.hf_quant) come as blocks per expert, output-major, gate and up
rows interleaved.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from minisgl.distributed import all_reduce
from minisgl.layers import Layer
from minisgl.layers.moe import Experts, TopKRouter
from minisgl.layers.shard import read_all
from minisgl.models.arch import ModelArch
from minisgl.models.llama import LlamaForCausalLM

EXPERT_TENSOR = re.compile(r"^(?P<experts>.*\.mlp\.experts)\.(?P<part>gate_up_proj|down_proj)"
                           r"(?P<bias>_bias)?$")
# a GGUF file's experts, output-major like a linear's weight, gate and up apart
GGUF_EXPERT_TENSOR = re.compile(r"^(?P<experts>.*\.mlp\.experts)\.(?P<part>gate|up|down)_proj"
                                r"\.(?P<kind>weight|bias)$")


class ClampedSwiGLU(Layer):
    """gpt-oss's expert activation over [rows, 2 n]: gate's n columns, then up's."""

    def __init__(self, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


class GptOssMoE(Layer):
    def __init__(self, arch: ModelArch) -> None:
        super().__init__()
        moe, config = arch.moe, arch.config
        assert moe is not None
        self.gate = TopKRouter(arch.hidden_size, moe.num_experts, moe.top_k, renormalize=True,
                               bias=True)
        self.experts = Experts(moe.num_experts, arch.hidden_size, moe.intermediate_size,
                               act=ClampedSwiGLU(config.get("swiglu_alpha", 1.702),
                                                 config.get("swiglu_limit", 7.0)),
                               gated=True, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return all_reduce(self.experts(x, weights, ids))


def deinterleaved(tensor: torch.Tensor) -> torch.Tensor:
    """[E, ..., 2 n] with gate and up interleaved in the last dimension -> [E, 2 n, ...] (a
    matrix transposed to output-major) with gate's n then up's."""
    if tensor.dim() == 3:
        tensor = tensor.transpose(1, 2)  # [E, 2 n, hidden]
    return torch.cat((tensor[:, 0::2], tensor[:, 1::2]), dim=1)


class GptOssForCausalLM(LlamaForCausalLM):
    STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
               "v_proj": ("qkv_proj", "v")}

    def layer_mlp(self, arch: ModelArch, layer_id: int) -> Layer:
        return GptOssMoE(arch)

    def weight_target(self, name: str) -> tuple[nn.Module, str, Any] | None:
        """As Llama's; an experts tensor's target is the Experts module and its part (gate_up,
        gate, up or down, or one of their biases: `..._bias`), every expert at once."""
        match = EXPERT_TENSOR.match(name)
        gguf = GGUF_EXPERT_TENSOR.match(name)
        if match is None and gguf is None:
            return super().weight_target(name.replace(".mlp.router.", ".mlp.gate."))
        try:
            experts = self.get_submodule((match or gguf)["experts"].removeprefix("model."))
        except AttributeError:
            return None
        if gguf is not None:
            return experts, gguf["part"] + ("_bias" if gguf["kind"] == "bias" else ""), None
        part = {"gate_up_proj": "gate_up", "down_proj": "down"}[match["part"]]
        return experts, part + (match["bias"] or ""), None

    def load_weight(self, name: str, source: Any) -> bool:
        hub = EXPERT_TENSOR.match(name) is not None
        if (not hub and GGUF_EXPERT_TENSOR.match(name) is None) or self.skips(name):
            return super().load_weight(name.replace(".mlp.router.", ".mlp.gate."), source)
        target = self.weight_target(name)
        if target is None:
            return False
        experts, part, _ = target
        if isinstance(source, list):  # MXFP4 blocks per expert, output-major
            if part == "gate_up":
                experts.load(None, "gate", [blocks[0::2] for blocks in source])
                experts.load(None, "up", [blocks[1::2] for blocks in source])
            else:
                experts.load(None, part, source)
            return True
        if hub:  # input-major, gate and up interleaved
            source = read_all(source)
            if part.startswith("gate_up"):
                source = deinterleaved(source)
            elif part == "down":
                source = source.transpose(1, 2)  # [E, hidden, I]
        experts.load(None, part, source)
        return True

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every tensor of a checkpoint of this model (its bfloat16 form),
        for --load-format dummy."""
        arch, hidden = self.arch, self.arch.hidden_size
        moe = arch.moe
        assert moe is not None
        experts, inter = moe.num_experts, moe.intermediate_size
        q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab_size,
                                                                            hidden)}
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "input_layernorm.weight": (hidden,),
                p + "post_attention_layernorm.weight": (hidden,),
                p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.weight": (kv, hidden), p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.v_proj.bias": (kv,),
                p + "self_attn.o_proj.weight": (hidden, q),
                p + "self_attn.o_proj.bias": (hidden,),
                p + "self_attn.sinks": (arch.num_heads,),
                p + "mlp.router.weight": (experts, hidden), p + "mlp.router.bias": (experts,),
                p + "mlp.experts.gate_up_proj": (experts, hidden, 2 * inter),
                p + "mlp.experts.gate_up_proj_bias": (experts, 2 * inter),
                p + "mlp.experts.down_proj": (experts, inter, hidden),
                p + "mlp.experts.down_proj_bias": (experts, hidden)})
        shapes["model.norm.weight"] = (hidden,)
        if not arch.tie_word_embeddings:
            shapes["lm_head.weight"] = (arch.vocab_size, hidden)
        return shapes
