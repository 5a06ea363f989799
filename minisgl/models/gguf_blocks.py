"""The blocks of a GGUF file's linear weights, as they are in the file (`--quantization gguf`),
under their Hugging Face names. Where the AVX-512 VNNI kernel runs them, Q4_0, Q4_1 and Q8_0
become layers.quant.WeightBlocks; every other type the AVX2 kernel takes (Q5_0, Q5_1, the
k-quants Q4_K, Q5_K, Q6_K, and all of them on a CPU without VNNI) becomes layers.gguf_weight.
GgufBlocks (models.gguf_decode), as do the token embedding and the LM head, and the VNNI
types of a layer that also holds other types. Without either kernel, Q4_0 / Q4_1 take
torch's int4 one. Other tensors (norms, Q2_K, Q3_K, IQ types) come from the converted
safetensors folder, dequantized.

Block layouts (ggml): Q4_0 = fp16 scale d, 16 bytes of codes, w = (q - 8) * d; Q4_1 = fp16 d,
fp16 min m, 16 bytes, w = q * d + m; byte j holds value j (low nibble) and j + 16 (high).
Q8_0 = fp16 d, 32 int8 values q, w = q * d.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from minisgl.layers.gguf_weight import KINDS, GgufBlocks, block_kernels
from minisgl.layers.gguf_weight import LANES as GGUF_LANES
from minisgl.layers.quant import GROUP, LANES, WeightBlocks, vnni_kernels
from minisgl.models.gguf_decode import read_gguf_blocks
from minisgl.models.gguf_hybrid import (dense_value, family_linears, in_file_name, llama_rows,
                                        row_order)

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
           # a mixture of experts' weights, every expert's stacked in one tensor (models.moe)
           "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
           "ffn_down_exps": "mlp.experts.down_proj"}
# NOTE: llama.cpp's converter permutes the rows of Llama's q / k projections (rotary halves
# interleaved); transformers, and so our dense weights, undo it. The families of
# models.gguf_hybrid give their own row orders; other architectures: none.
LLAMA_PERMUTED = {"attn_q": "num_heads", "attn_k": "num_kv_heads"}


# the token embedding and the LM head (absent when tied to the embedding)
TABLES = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str, architecture: str) -> str | None:
    """model.layers.{i}.<linear>.weight for a GGUF linear weight (or the embedding / LM head's
    name); None for anything else."""
    if gguf_name in TABLES:
        return TABLES[gguf_name]
    linears = family_linears(architecture) or LINEARS
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[3] != "weight" or parts[2] not in linears:
        return None
    return f"model.layers.{parts[1]}.{linears[parts[2]]}.weight"


def decode_blocks(kind: str, raw: np.ndarray, out_features: int, in_features: int
                  ) -> WeightBlocks:
    blocks = np.ascontiguousarray(raw).reshape(out_features, in_features // GROUP,
                                               BLOCK_BYTES[kind])
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q8_0":
        values = torch.from_numpy(blocks[..., 2:].copy().view(np.int8)).to(torch.int16)
        return WeightBlocks((values + 128).to(torch.uint8).reshape(out_features, in_features),
                            scales, torch.zeros_like(scales), bits=8)
    if kind == "Q4_1":
        mins = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
        zeros, packed = mins + 8 * scales, torch.from_numpy(blocks[..., 4:].copy())
    else:
        zeros, packed = torch.zeros_like(scales), torch.from_numpy(blocks[..., 2:].copy())
    codes = torch.cat([packed & 15, packed >> 4], dim=-1).reshape(out_features, in_features)
    return WeightBlocks(codes, scales, zeros)


def kernel_for(kind: str, out_features: int, table: bool, dtype: torch.dtype) -> str | None:
    """Which kernel runs a tensor of GGUF type `kind`: "vnni" or "torch" (WeightBlocks, in
    bfloat16), "avx2" (GgufBlocks), or None (it stays dense)."""
    vnni_runs = (vnni_kernels() is not None and out_features % LANES == 0
                 and dtype == torch.bfloat16)
    if kind in BLOCK_BYTES and vnni_runs:
        return "vnni"
    if block_kernels() is not None and kind in KINDS and out_features % GGUF_LANES == 0:
        return "avx2"
    return "torch" if kind in ("Q4_0", "Q4_1") and not table and dtype == torch.bfloat16 else None


@dataclass
class PendingBlocks:
    """One GGUF tensor's blocks, decoded when its layer loads them: the file's decoded codes
    (a byte a weight) are never all held at once, only one tensor's at a time."""

    kernel: str  # kernel_for's answer
    bits: int
    experts: bool  # a list of one WeightBlocks per expert
    read: Callable[[], WeightBlocks | GgufBlocks | list[WeightBlocks]]


def read_block_linears(path: Path, config: dict[str, Any], skips: Callable[[str], bool],
                       dtype: torch.dtype) -> tuple[dict[str, PendingBlocks], dict[str, str]]:
    """(the linear weights a kernel runs, by HF name, {HF name: GGUF type} of the other linear
    weights, which stay dense), leaving out the names `skips` (the model's: layers past a
    layer-count override). `config`: the model's, with num_heads and num_kv_heads. The
    embedding / LM head tables come as GgufBlocks only."""
    from minisgl.models.gguf_reader import gguf_reader

    reader = gguf_reader(path)
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    blocks, dense = {}, {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None or skips(name):
            continue
        kind = tensor.tensor_type.name
        in_features, out_features = (int(n) for n in tensor.shape[:2])
        experts = len(tensor.shape) == 3
        kernel = kernel_for(kind, out_features, tensor.name in TABLES, dtype)
        if kernel is None:
            if tensor.name not in TABLES:
                dense[name] = kind
            continue
        order = None if tensor.name in TABLES else _rows(arch, tensor.name.split(".")[2],
                                                          out_features, config)
        read = functools.partial(_decode_tensor, tensor, kernel, experts, order)
        blocks[name] = PendingBlocks(kernel, KINDS[kind][0], experts, read)
    return blocks, dense


def _rows(architecture: str, kind: str, rows: int, config: dict[str, Any]
          ) -> torch.Tensor | None:
    if architecture == "llama":
        heads = LLAMA_PERMUTED.get(kind)
        return None if heads is None else llama_rows(rows, config[heads])
    return row_order(architecture, kind, config)


def file_linears(path: Path, config: dict[str, Any], names: set[str]
                 ) -> dict[str, Callable[[], torch.Tensor]]:
    """Linear weights `names` that a hybrid family's converted folder left in the GGUF file
    (gguf_hybrid.in_file_name), by HF name: each a reader of the float32 weight, rows in our
    order (experts: [E, out, in])."""
    from minisgl.models.gguf_reader import gguf_reader

    reader = gguf_reader(path)
    arch = reader.fields["general.architecture"].contents()
    readers = {}
    for tensor in reader.tensors:
        name = in_file_name(tensor, arch)
        if name in names:
            order = _rows(arch, tensor.name.split(".")[2], int(tensor.shape[1]), config)
            readers[name] = functools.partial(_dense_rows, tensor, order)
    return readers


def _dense_rows(tensor: Any, order: torch.Tensor | None) -> torch.Tensor:
    value = dense_value(tensor)
    return value if order is None else value[..., order, :]


def _decode_tensor(tensor: Any, kernel: str, experts: bool, order: torch.Tensor | None
                   ) -> WeightBlocks | GgufBlocks | list[WeightBlocks]:
    kind = tensor.tensor_type.name
    in_features, out_features = (int(n) for n in tensor.shape[:2])
    decode = read_gguf_blocks if kernel == "avx2" else decode_blocks
    if experts:  # [experts, out, in]: one weight per expert
        raw = np.asarray(tensor.data).reshape(int(tensor.shape[2]), -1)
        return [decode(kind, e, out_features, in_features) for e in raw]
    weight = decode(kind, tensor.data, out_features, in_features)
    return weight if order is None else weight[order]


def stage_block_linears(model: torch.nn.Module, path: Path, config: dict[str, Any],
                        dtype: torch.dtype) -> tuple[dict[str, PendingBlocks], dict[str, str]]:
    """Prepare every layer whose checkpoint tensors are all blocks a kernel runs to take them
    (`expect_blocks`, `expect_gguf_blocks`; a layer with parts for both kernels runs them all
    on the AVX2 one); returns those tensors by HF name, and the GGUF types of the linear
    weights that stay dense (a layer with any of them stays dense whole). Any GGUF type
    loads: the dense ones come dequantized from the converted folder."""
    blocks, dense = read_block_linears(path, config, model.skips, dtype)
    names_by_module: dict[torch.nn.Module, list[str]] = {}
    for name in [*blocks, *dense]:
        names_by_module.setdefault(model.weight_target(name)[0], []).append(name)
    staged, kept = {}, {}
    for module, names in names_by_module.items():
        parts = [blocks.get(name) for name in names]
        if all(p is not None and p.kernel != "avx2" for p in parts) and (
                len(widths := {p.bits for p in parts}) == 1):
            module.expect_blocks(widths.pop())
        elif all(p is not None for p in parts) and block_kernels() is not None:
            # NOTE: a layer with parts for both kernels (llama.cpp's Q4_K_M: q / k Q5_0 and v
            # Q8_0) runs every part on the one that takes all types
            parts = [p if p.kernel == "avx2" else
                     dataclasses.replace(p, kernel="avx2",
                                         read=functools.partial(_as_gguf_blocks_of, p.read))
                     for p in parts]
            module.expect_gguf_blocks()
        else:
            kept.update((name, dense[name] if name in dense else
                         "blocks for two kernels in one layer") for name in names)
            continue
        staged.update(zip(names, parts))
    return staged, kept


def _as_gguf_blocks_of(read: Callable[[], WeightBlocks | list[WeightBlocks]]
                       ) -> GgufBlocks | list[GgufBlocks]:
    blocks = read()
    return ([as_gguf_blocks(b) for b in blocks] if isinstance(blocks, list)
            else as_gguf_blocks(blocks))


def as_gguf_blocks(blocks: WeightBlocks) -> GgufBlocks:
    """The same weights in GgufBlocks' terms: w = scale (code - center) + zero = d' c + m'
    (8-bit: the signed code c = code - center, m' = zero)."""
    if blocks.bits == 8:
        codes = (blocks.codes.to(torch.int16) - blocks.center).to(torch.int8)
        return GgufBlocks("Q8_0", codes, torch.stack([blocks.scales, blocks.zeros], dim=-1), None)
    offsets = blocks.zeros - blocks.center * blocks.scales
    return GgufBlocks("Q4_1", blocks.codes, torch.stack([blocks.scales, offsets], dim=-1), None)

