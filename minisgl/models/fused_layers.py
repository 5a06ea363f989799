"""A Llama-family model's decoder layers as one C++ call a step on CPU, when every linear is in
GGUF blocks (layers.gguf_weight): kernels/csrc/fused_layers.cpp calls the kernels the modules
call, in the same order, so the outputs are equal to the bit.

Why: between two block-kernel calls, each streaming its weight through the caches, the
interpreter's working set falls out of them, and each of a layer's many Python-level calls
costs several times its warm cost (BENCHMARKS.md, "The decoder layers in one call"). The one
call also releases the GIL once a step, where the modules released and retook it per kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from minisgl.attention import AttentionBackend
from minisgl.attention.torch_backend import KernelMetadata, TorchBackend
from minisgl.core import Batch
from minisgl.layers import SiluAndMul
from minisgl.layers.gguf_weight import GgufWeight, StackedWeight
from minisgl.models.llama import MLP, Attention, DecoderLayer


class FusedLayers:
    def __init__(self, program: Any, max_rows: int) -> None:
        self.program, self.max_rows = program, max_rows

    def runs(self, batch: Batch, positions: torch.Tensor) -> bool:
        """Whether this batch takes the fused call: the kernel's attention metadata, and few
        enough tokens that every linear takes the block kernel (as GgufWeight.matmul picks)."""
        return (isinstance(batch.attn_metadata, KernelMetadata)
                and positions.shape[0] <= self.max_rows and positions.dtype == torch.int64)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, batch: Batch,
                 backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        locations, lens, rows = batch.attn_metadata.view(0, backend.page_table)
        out, residual = self.program.run(x, positions, batch.out_loc, locations, lens, rows)
        return out, residual  # NOTE: run() answers a list


def fuse_layers(model: Any, backend: AttentionBackend, tp_size: int) -> FusedLayers | None:
    """The fused call for `model`'s layers, or None where they are not all plain Llama layers
    (no biases, QK-norm, LoRA, windows or soft-capping) over GGUF blocks, one rank, on CPU."""
    layers = getattr(model, "layers", None)
    if (not layers or not isinstance(backend, TorchBackend) or backend.kernels is None
            or backend.softcap > 0 or any(backend.window(i) for i in range(len(layers)))
            or tp_size > 1):
        return None
    parts = [_layer_parts(layer) for layer in layers]
    if any(p is None for p in parts):
        return None
    attn: Attention = layers[0].self_attn
    rotary = attn.rotary
    if rotary.cos.dtype != torch.float32:
        return None
    qkv = attn.qkv_proj
    program = backend.kernels.FusedLayers(qkv.num_heads, qkv.num_kv_heads, qkv.head_dim,
                                  layers[0].input_layernorm.eps, backend.scale, rotary.cos,
                                  rotary.sin)
    for layer, (weights, kinds, _) in zip(layers, parts):
        k_cache, v_cache = backend.kv_pool.layer(layer.self_attn.layer_id)
        program.add_layer(layer.input_layernorm.weight.detach(),
                          layer.post_attention_layernorm.weight.detach(), weights, kinds,
                          k_cache, v_cache)
    return FusedLayers(program, min(max_rows for _, _, max_rows in parts))


def _layer_parts(layer: Any) -> tuple[list[list[torch.Tensor]], list[list[int]], int] | None:
    """A plain layer's four linears as the program's (tensors, kinds) and the most rows they
    all run the block kernel at; None for any other layer."""
    if (type(layer) is not DecoderLayer or type(layer.self_attn) is not Attention
            or type(layer.mlp) is not MLP or type(layer.mlp.act) is not SiluAndMul
            or layer.self_attn.q_norm is not None or layer.self_attn.query_scale != 1.0):
        return None
    linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
               layer.mlp.down_proj)
    weights, kinds, max_rows = [], [], []
    for linear in linears:
        if linear.bias is not None or linear.lora is not None:
            return None
        quantized = linear.quantized
        parts = (quantized.parts if isinstance(quantized, StackedWeight)
                 else [quantized] if isinstance(quantized, GgufWeight) else None)
        if parts is None or not all(isinstance(p, GgufWeight) for p in parts):
            return None
        weights.append([t for p in parts for t in (p.codes, p.scales, p.subs)])
        kinds.append([v for p in parts for v in (p.bits, p.mode, p.terms)])
        max_rows.extend(p.kernel_max_rows for p in parts)
    return weights, kinds, min(max_rows)
