"""A decoder's layers as one C++ call a step on CPU, when every linear is in GGUF blocks
(layers.gguf_weight's, or layers.quant's VnniWeight): kernels/csrc/fused_layers.cpp calls the
kernels the modules call, in the same order, so the outputs are equal to the bit. It knows
plain Llama layers, Granite 4.0-H's (Mamba2 or attention without RoPE, a shared MLP, the
residual multiplier), dense Qwen3.5's (Gated DeltaNet or gated attention with QK-norm and
partial RoPE) and Nemotron-H's blocks (Mamba2, attention without RoPE, a relu² MLP, or its
mixture of experts: a block is one norm and one of these). A step of one decode row through
Llama layers in bfloat16 (VnniWeight's layout or GgufWeight's blocks) runs as one parallel
region on buffers kept between steps (kernels/csrc/fused_one_row.cpp), again to the bit.

Why: between two block-kernel calls, each streaming its weight through the caches, the
interpreter's working set falls out of them, and each of a layer's many Python-level calls
costs several times its warm cost (BENCHMARKS.md, "The decoder layers in one call"). The one
call also releases the GIL once a step, where the modules released and retook it per kernel.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.attention import AttentionBackend
from minisgl.attention.torch_backend import KernelMetadata, TorchBackend
from minisgl.core import Batch
from minisgl.layers import NoRotary, SiluAndMul
from minisgl.layers.gguf_weight import GgufWeight, StackedWeight
from minisgl.layers.norm import RMSNorm
from minisgl.layers.quant import VNNI_MAX_ROWS, VnniWeight
from minisgl.models.granite_hybrid import GraniteHybridLayer, Mamba2Mixer
from minisgl.models.llama import MLP, Attention, DecoderLayer
from minisgl.layers.moe import SparseMoE
from minisgl.models.nemotron_h import (GroupedSigmoidRouter, NemotronHBlock, NemotronHMoE,
                                        Relu2MLP)
from minisgl.models.qwen3_next import (GatedAttention, GatedDeltaNet, HybridDecoderLayer,
                                       SharedExpertMoE, state_step_kernels)

NO_SPANS = torch.zeros(0, dtype=torch.long)
NO_SUBS = torch.empty(0, dtype=torch.uint8)
QUANT_LAYOUT = -1  # a part's mode for quant_matmul's layout (FusedLayers::kQuantLayout)
ANY_ROWS = 1 << 30


class FusedLayers:
    def __init__(self, program: Any, max_rows: int) -> None:
        self.program, self.max_rows = program, max_rows

    def runs(self, batch: Batch, positions: torch.Tensor) -> bool:
        """Whether this batch takes the fused call: the kernel's attention metadata, and few
        enough tokens that every linear takes the block kernel (as GgufWeight.matmul picks)."""
        return (isinstance(batch.attn_metadata, KernelMetadata) and positions.dim() == 1
                and positions.shape[0] <= self.max_rows and positions.dtype == torch.int64)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, batch: Batch,
                 backend: AttentionBackend,
                 spans: tuple[torch.Tensor, torch.Tensor] = (NO_SPANS, NO_SPANS)
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """`spans`: a hybrid batch's state rows and token counts (models.qwen3_next.RowSpans,
        with no snapshot to take part-way)."""
        locations, lens, rows = batch.attn_metadata.view(0, backend.page_table)
        out, residual = self.program.run(x, positions, batch.out_loc, locations, lens, rows,
                                         *spans)
        return out, residual  # NOTE: run() answers a list


Mixer = Attention | GatedAttention | Mamba2Mixer | GatedDeltaNet


@dataclass
class MixerParts:
    """A token mixer the program knows: its norm, the mixer, its in and out linears (each one
    linear or several whose outputs the program concatenates), and the factor on its
    output."""

    norm: RMSNorm
    mixer: Mixer
    linears: tuple[tuple[Any, ...], ...]
    residual_multiplier: float = 1.0


@dataclass
class MlpParts:
    """An MLP alone (a Nemotron-H block: relu² of up, then down), or a mixture of experts
    (`moe`: its router and experts; `linears`: its shared expert's, or none; `shared_gate`:
    the shared expert's sigmoid gate weight, or None) after a mixer or alone."""

    norm: RMSNorm
    linears: tuple[tuple[Any, ...], ...]
    moe: Any = None  # a SparseMoE or NemotronHMoE
    relu2: bool = False
    shared_gate: torch.Tensor | None = None
    residual_multiplier: float = 1.0


Parts = MixerParts | MlpParts


def fuse_layers(model: Any, backend: AttentionBackend, tp_size: int) -> FusedLayers | None:
    """The fused call for `model`'s layers, or None where some layer is not one the program
    knows (biases, a Llama layer's QK-norm, LoRA, windows, soft-capping, other experts, other
    layer types), a linear is not in GGUF blocks, there is more than one rank, or not on CPU."""
    layers = getattr(model, "layers", None)
    if (not layers or not isinstance(backend, TorchBackend) or backend.kernels is None
            or backend.softcap > 0 or any(backend.window(i) for i in range(len(layers)))
            or tp_size > 1):
        return None
    per_layer = [_layer_parts(layer) for layer in layers]
    if any(p is None for p in per_layer):
        return None
    parts = [p for layer_parts in per_layer for p in layer_parts]
    blocks = [[_blocks(*linears) for linears in p.linears] for p in parts]
    experts = [_expert_blocks(p.moe) for p in parts if isinstance(p, MlpParts) and p.moe]
    if any(b is None for linears in blocks + [experts] for b in linears):
        return None
    attention = [p.mixer for p in parts
                 if isinstance(p, MixerParts) and isinstance(p.mixer, (Attention, GatedAttention))]
    rotaries = {id(a.rotary): a.rotary for a in attention if not isinstance(a.rotary, NoRotary)}
    shared = {(_query_scale(a), type(a)) for a in attention}
    multipliers = {p.residual_multiplier for p in parts}
    eps = {p.norm.eps for p in parts} | {a.q_norm.eps for a in attention if a.q_norm is not None}
    if not attention or len(shared) > 1 or len(rotaries) > 1 or len(multipliers) > 1 or len(
            eps) > 1:
        return None
    first = attention[0]
    cos = sin = None  # NoPE in every layer
    if rotaries:
        rotary = rotaries.popitem()[1]
        cos, sin = rotary.cos, rotary.sin
        if cos.dtype != torch.float32:
            return None
    gated = isinstance(first, GatedAttention)
    qkv = first.qkv_proj
    program = backend.kernels.FusedLayers(
        qkv.num_heads // 2 if gated else qkv.num_heads, qkv.num_kv_heads, qkv.head_dim,
        eps.pop(), backend.scale, cos, sin, _query_scale(first), multipliers.pop())
    experts_of = iter(experts)
    for p, linears in zip(parts, blocks):
        weights = [w for w, _, _ in linears]
        kinds = [k for _, k, _ in linears]
        norm = _weight(p.norm)
        if isinstance(p, MlpParts):
            if p.moe is None:
                program.add_mlp(norm, weights, kinds, p.relu2)
                continue
            router = p.moe.gate
            grouped_sigmoid = isinstance(router, GroupedSigmoidRouter)
            bias = router.e_score_correction_bias if grouped_sigmoid else router.bias
            program.add_moe(norm, router.weight.detach(), _detached(bias),
                            not grouped_sigmoid, router.top_k,
                            *((router.groups, router.top_groups) if grouped_sigmoid else (1, 1)),
                            router.renormalize, router.scale if grouped_sigmoid else 1.0,
                            *next(experts_of)[:2], p.relu2, weights, kinds, p.shared_gate)
            continue
        m = p.mixer
        if isinstance(m, (Attention, GatedAttention)):
            layer_id = m.kv_index if gated else m.layer_id
            qk_norms = ((m.q_norm.weight.detach(), m.k_norm.weight.detach())
                        if m.q_norm is not None else (None, None))
            program.add_attention(norm, weights, kinds, *backend.kv_pool.layer(layer_id),
                                  *backend.kv_pool.layer_scales(layer_id), *qk_norms, gated,
                                  not isinstance(m.rotary, NoRotary))
        elif isinstance(m, GatedDeltaNet):
            program.add_delta_net(norm, weights, kinds, m.conv1d.weight.detach(),
                                    *m.states.layer(m.linear_id), *m.per_head(),
                                    m.norm.weight.detach(), m.shape.num_k_heads, m.norm.eps,
                                    m.shape.tiled)
        else:
            conv_states, ssm_states = m.states.layer(m.linear_id)
            program.add_mamba2(norm, weights, kinds, m.conv1d.weight.detach(),
                                     _detached(m.conv1d.bias), conv_states, ssm_states,
                                     *m.per_head(), m.norm.weight.detach(), m.shape.groups,
                                     *m.shape.dt_limit, m.eps)
    max_rows = min([rows for linears in blocks for _, _, rows in linears]
                   + [rows for _, _, rows in experts])
    return FusedLayers(program, max_rows)


def _query_scale(attention: Attention | GatedAttention) -> float:
    return getattr(attention, "query_scale", 1.0)


def _detached(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach()


def _weight(norm: RMSNorm) -> torch.Tensor:
    return norm.weight.detach()


def _plain_mlp(mlp: Any) -> bool:
    return type(mlp) is MLP and type(mlp.act) is SiluAndMul


def _plain_attention(attn: Any) -> bool:
    return type(attn) is Attention and attn.q_norm is None and attn.sinks is None


def _layer_parts(layer: Any) -> list[Parts] | None:
    """A layer's sublayers: its mixer and its MLP or mixture (a Nemotron-H block: one)."""
    if type(layer) is NemotronHBlock:
        part = _nemotron_parts(layer)
        return None if part is None else [part]
    if type(layer) not in (DecoderLayer, GraniteHybridLayer, HybridDecoderLayer):
        return None
    multiplier = getattr(layer, "residual_multiplier", 1.0)
    mixer = _mixer_parts(layer)
    mlp = _mlp_parts(layer, layer.post_attention_layernorm)
    if mixer is None or mlp is None:
        return None
    return [MixerParts(layer.input_layernorm, *mixer, multiplier),
            dataclasses.replace(mlp, residual_multiplier=multiplier)]


def _mixer_parts(layer: Any) -> tuple[Mixer, tuple[tuple[Any, ...], ...]] | None:
    """A layer's token mixer and its in and out linears."""
    mixer = (layer.linear_attn if type(layer) is HybridDecoderLayer and layer.is_linear
             else layer.mamba if type(layer) is GraniteHybridLayer and layer.is_linear
             else layer.self_attn)
    if type(layer) is DecoderLayer and _query_scale(mixer) != 1.0:
        return None  # NOTE: Granite's query multiplier is the program's query_scale
    linears = _mixer_linears(mixer)
    return None if linears is None else (mixer, linears)


def _mixer_linears(mixer: Any) -> tuple[tuple[Any, ...], ...] | None:
    """A mixer the program knows: its in and out linears (Qwen3.5's Gated DeltaNet takes its
    q/k/v, z, b and a apart, not Qwen3-Next's grouped ones)."""
    if type(mixer) is GatedDeltaNet:
        conv_states, _ = mixer.states.layer(mixer.linear_id)
        if mixer.shape.grouped or state_step_kernels(conv_states, mixer.conv1d.weight) is None:
            return None
        return ((mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a),
                (mixer.out_proj,))
    if type(mixer) is Mamba2Mixer:
        conv_states, _ = mixer.states.layer(mixer.linear_id)
        if state_step_kernels(conv_states, mixer.conv1d.weight, mixer.conv1d.bias) is None:
            return None
        return (mixer.in_proj,), (mixer.out_proj,)
    if type(mixer) is GatedAttention or _plain_attention(mixer):
        return (mixer.qkv_proj,), (mixer.o_proj,)
    return None


def _mlp_parts(layer: Any, norm: RMSNorm) -> MlpParts | None:
    """A layer's plain MLP, or its mixture of experts with its shared expert (Granite's shared
    MLP, Qwen3.5's gated shared expert) or none."""
    if type(layer) is GraniteHybridLayer:
        if not _plain_mlp(layer.shared_mlp):
            return None
        shared = ((layer.shared_mlp.gate_up_proj,), (layer.shared_mlp.down_proj,))
        if layer.mlp is None:
            return MlpParts(norm, shared)
        return MlpParts(norm, shared, layer.mlp) if type(layer.mlp) is SparseMoE else None
    mlp = layer.mlp
    if _plain_mlp(mlp):
        return MlpParts(norm, ((mlp.gate_up_proj,), (mlp.down_proj,)))
    if type(mlp) is SparseMoE:
        return MlpParts(norm, (), mlp)
    if type(mlp) is SharedExpertMoE and _plain_mlp(mlp.shared_expert):
        shared = mlp.shared_expert
        return MlpParts(norm, ((shared.gate_up_proj,), (shared.down_proj,)), mlp,
                        shared_gate=mlp.shared_expert_gate.weight.detach())
    return None


def _nemotron_parts(block: NemotronHBlock) -> Parts | None:
    """A block's one norm and its mixer, its relu² MLP, or its mixture of experts (relu²
    experts, the grouped sigmoid router, a relu² shared expert)."""
    if block.kind in ("linear_attention", "full_attention"):
        mixer = block.mixer if block.is_linear else block.self_attn
        linears = _mixer_linears(mixer)
        if linears is None or _query_scale(mixer) != 1.0:
            return None
        return MixerParts(block.norm, mixer, linears)
    mixer = block.mixer
    mlp = mixer.shared_experts if type(mixer) is NemotronHMoE else mixer
    if type(mlp) is not Relu2MLP:
        return None
    linears = ((mlp.up_proj,), (mlp.down_proj,))
    return MlpParts(block.norm, linears, mixer if type(mixer) is NemotronHMoE else None,
                    relu2=True)


def _expert_blocks(moe: SparseMoE | NemotronHMoE
                   ) -> tuple[list[list[torch.Tensor]], list[list[int]], int] | None:
    """The experts' up and down as the program's (each expert's tensors, the part's kind) and
    the most rows they run the block kernel at; None unless both parts are GGUF blocks of one
    type (GroupedGgufWeights) with no biases or LoRA."""
    experts = moe.experts
    quantized = experts.quantized
    if (quantized is None or experts.lora is not None or experts.gate_up_bias is not None
            or experts.down_bias is not None):
        return None
    parts = [quantized.grouped[part] for part in ("gate_up", "down")]
    if any(p is None for p in parts):
        return None
    return ([[t for e in zip(p.codes, p.scales, p.subs) for t in e] for p in parts],
            [[p.bits, p.mode, p.terms] for p in parts],
            min(p.kernel_max_rows for p in parts))


def _blocks(*linears: Any) -> tuple[list[torch.Tensor], list[int], int] | None:
    """Linears' parts, in order, as the program's (tensors, kinds) and the most rows they all
    run their kernel at; None unless each is GGUF blocks (block_matmul's or quant_matmul's
    layout) with no bias or LoRA."""
    parts = []
    for linear in linears:
        if linear.bias is not None or linear.lora is not None:
            return None
        quantized = linear.quantized
        parts += (quantized.parts if isinstance(quantized, StackedWeight) else [quantized])
    if not all(isinstance(p, (GgufWeight, VnniWeight)) for p in parts):
        return None
    return ([t for p in parts for t in _tensors(p)], [v for p in parts for v in _kind(p)],
            min(_max_rows(p) for p in parts))


def _tensors(part: GgufWeight | VnniWeight) -> tuple[torch.Tensor, ...]:
    if isinstance(part, VnniWeight):
        return part.codes, part.scales_and_offsets, NO_SUBS
    return part.codes, part.scales, part.subs


def _kind(part: GgufWeight | VnniWeight) -> tuple[int, int, int]:
    mode = QUANT_LAYOUT if isinstance(part, VnniWeight) else part.mode
    return part.bits, mode, part.terms


def _max_rows(part: GgufWeight | VnniWeight) -> int:
    """The most rows `part` multiplies with its kernel (VnniWeight.matmul: with one term at
    any count)."""
    if isinstance(part, VnniWeight):
        return VNNI_MAX_ROWS if part.terms == 2 else ANY_ROWS
    return part.kernel_max_rows
