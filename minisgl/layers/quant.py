"""Weight-only 4-bit linear weights: GGUF's Q4_0 / Q4_1 blocks, kept as they are in the file.

A weight row of `in_features` values is cut into groups of 32, each a 4-bit code per value with
one scale and one zero: w = (code - 8) * scale + zero (Q4_1: zero = min + 8 * scale; Q4_0: zero
= 0). `WeightBlocks` holds them while the checkpoint loads (it slices like the dense weight it
stands for, so the tensor-parallel loaders of layers.linear shard it unchanged); `block_weight`
then packs them for the fastest kernel this CPU has (BENCHMARKS.md, "Quantized weights"):
- `VnniWeight`: minisgl's own kernel (kernels/csrc/quant_matmul.cpp: integer dot products on
  AVX-512 VNNI, as llama.cpp runs Q4 x Q8, with activations kept to ~15 bits, or to 8 as
  llama.cpp's with `activation_terms(1)`), at every batch size; `int8_weight` puts a dense
  weight (the LM head) in its 8-bit form;
- `TorchInt4Weight`, on CPUs without it: torch's packed-int4 kernel for small batches and a
  dequantized bfloat16 GEMM for large ones.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch
import torch.nn.functional as F

from minisgl.kernels import cpu_kernels

GROUP = 32
LANES = 16  # output features per block of the VNNI layout
# NOTE: past this many rows, dequantizing the layer to bfloat16 and running the GEMM beats the
# integer dot products of two-term activations (the crossover on the project's CPU:
# BENCHMARKS.md); with one term the kernel stays ahead at any batch.
VNNI_MAX_ROWS = 384
# NOTE: past this many rows the int4 kernel's per-row dequantization costs more than
# dequantizing the layer once and running the GEMM (the crossover: BENCHMARKS.md).
KERNEL_MAX_ROWS = 192
_terms_now = 2  # what the VNNI weights built now take (`activation_terms`)


@dataclass
class WeightBlocks:
    codes: torch.Tensor  # [out, in] uint8, 0 .. 2^bits - 1
    scales: torch.Tensor  # [out, in / 32] float32
    zeros: torch.Tensor  # [out, in / 32] float32
    bits: int = 4  # w = (code - 2^(bits - 1)) * scale + zero

    @classmethod
    def empty(cls, out_features: int, in_features: int, bits: int = 4) -> WeightBlocks:
        if in_features % GROUP:
            raise ValueError(f"{bits}-bit weights need input features divisible by {GROUP}, "
                             f"got {in_features}")
        groups = in_features // GROUP
        return cls(torch.zeros(out_features, in_features, dtype=torch.uint8),
                   torch.zeros(out_features, groups), torch.zeros(out_features, groups), bits)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def data(self) -> WeightBlocks:  # NOTE: stands in for a Parameter: `param.data` is itself
        return self

    @property
    def center(self) -> int:
        return 1 << (self.bits - 1)

    def __getitem__(self, index: slice | torch.Tensor | tuple[slice, slice]) -> WeightBlocks:
        """Rows (`b[a:z]`, `b[order]`) or whole groups of columns (`b[:, a:z]`), as the TP
        loaders read."""
        if not isinstance(index, tuple):
            return WeightBlocks(self.codes[index], self.scales[index], self.zeros[index],
                                self.bits)
        rows, cols = index
        start, stop = cols.start or 0, self.shape[1] if cols.stop is None else cols.stop
        if start % GROUP or stop % GROUP:
            raise ValueError(f"a shard of a {self.bits}-bit weight must cut at multiples of "
                             f"{GROUP} input features, not [{start}, {stop})")
        groups = slice(start // GROUP, stop // GROUP)
        return WeightBlocks(self.codes[rows, cols], self.scales[rows, groups],
                            self.zeros[rows, groups], self.bits)

    def narrow(self, dim: int, start: int, length: int) -> WeightBlocks:
        assert dim == 0
        return self[start:start + length]

    def copy_(self, other: WeightBlocks) -> None:
        if not isinstance(other, WeightBlocks) or other.bits != self.bits:
            raise ValueError(f"a {self.bits}-bit layer was given another kind of weight for "
                             "part of it")
        self.codes.copy_(other.codes)
        self.scales.copy_(other.scales)
        self.zeros.copy_(other.zeros)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out, groups = self.scales.shape
        codes = self.codes.view(out, groups, GROUP).float() - self.center
        weight = codes * self.scales[..., None] + self.zeros[..., None]
        return weight.view(out, groups * GROUP).to(dtype)


class BlockWeight(Protocol):
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int: ...

    def matmul(self, x: torch.Tensor) -> torch.Tensor: ...


@contextmanager
def activation_terms(terms: int) -> Iterator[None]:
    """The VNNI weights built inside (VnniWeight, and GgufWeight on a VNNI CPU) quantize their
    activations to `terms` int8 terms a value: 2, ~15 bits (the default); 1, llama.cpp's 8-bit
    numerics (--cpu-int8-activations: half the integer dot products)."""
    global _terms_now
    saved, _terms_now = _terms_now, terms
    try:
        yield
    finally:
        _terms_now = saved


def terms_now() -> int:
    return _terms_now


def vnni_kernels() -> Any | None:
    kernels = cpu_kernels()
    return kernels if kernels is not None and kernels.vnni_available() else None


def block_weight(blocks: WeightBlocks, dtype: torch.dtype) -> BlockWeight:
    if vnni_kernels() is not None and dtype == torch.bfloat16 and blocks.shape[0] % LANES == 0:
        return VnniWeight(blocks.codes, blocks.scales,
                          blocks.zeros - blocks.center * blocks.scales, blocks.bits)
    assert blocks.bits == 4, "8-bit blocks run on the VNNI kernel only (models.gguf_blocks)"
    return TorchInt4Weight(blocks, dtype)


def int8_weight(weight: torch.Tensor) -> VnniWeight:
    """8-bit codes of a dense weight per group of 32 inputs (as GGUF's Q8_0: a float16 scale
    per group; w = d * (code - 128)), for the VNNI kernel."""
    out, in_features = weight.shape
    groups = weight.float().view(out, in_features // GROUP, GROUP)
    scales = (groups.abs().amax(dim=-1) / 127).half().float()
    codes = (groups / scales.clamp_min(1e-30)[..., None]).round().clamp(-127, 127) + 128
    return VnniWeight(codes.to(torch.uint8).view(out, in_features), scales, -128 * scales,
                      bits=8)


class VnniWeight:
    """Codes of `bits` bits with a scale d and an offset m per output feature and group of 32
    inputs (w = d * code + m), in the layout of kernels/csrc/quant_matmul.cpp: per block of
    16 output features and group, the codes as 64-byte vectors (byte 4 * lane + j: 4-bit,
    vector p holds inputs 8p + j in the low nibbles and 8p + 4 + j in the high ones; 8-bit,
    inputs 4p + j), then 16 float16 scales and 16 float16 offsets. GGUF stores its scales and
    mins as float16, so this is exact for its blocks."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
                 bits: int) -> None:
        out, in_features = codes.shape
        groups, blocks = in_features // GROUP, out // LANES
        self.out_features, self.in_features, self.bits = out, in_features, bits
        if bits == 4:
            nibbles = codes.view(blocks, LANES, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
            packed = nibbles[..., 0] | (nibbles[..., 1] << 4)
        else:
            packed = codes.view(blocks, LANES, groups, 8, 4).permute(0, 2, 3, 1, 4)
        self.codes = packed.reshape(blocks, groups, -1).contiguous()
        self.scales_and_offsets = torch.stack(
            [t.view(blocks, LANES, groups).transpose(1, 2) for t in (scales, offsets)],
            dim=2).to(torch.float16).contiguous()  # [out / 16, in / 32, 2, 16]
        self.kernels = vnni_kernels()
        self.terms = terms_now()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales_and_offsets))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.terms == 2 and x.numel() > VNNI_MAX_ROWS * self.in_features:
            return x @ self.kernels.quant_dequantize_t(self.codes, self.scales_and_offsets)
        return self.kernels.quant_matmul(x.contiguous(), self.codes, self.scales_and_offsets,
                                         self.terms)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the layout encodes (for tests)."""
        return self.rows()

    def rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `index` of the weight (all by default) as float32 [len, in]: a vocabulary
        table held in this layout is looked up here."""
        index = torch.arange(self.out_features) if index is None else index.reshape(-1)
        return self.kernels.quant_rows(self.codes, self.scales_and_offsets, index)


class TorchInt4Weight:
    """An `WeightBlocks` weight packed for torch's int4 CPU kernel (bfloat16 activations)."""

    def __init__(self, blocks: WeightBlocks, dtype: torch.dtype) -> None:
        out, groups = blocks.scales.shape
        self.out_features, self.in_features, self.dtype = out, groups * GROUP, dtype
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            blocks.codes.to(torch.int32), 1)
        # [in / 32, out, 2]: (scale, zero) per group, the kernel's layout
        self.scales_and_zeros = torch.stack([blocks.scales.t(), blocks.zeros.t()], dim=-1).to(
            dtype).contiguous()
        # NOTE: the dequantizing path reads the codes back from the packed tensor when its
        # layout is the one unpack_codes knows (checked here); else it keeps its own copy.
        self.nibbles = None
        if not torch.equal(unpack_codes(self.packed, out, self.in_features), blocks.codes):
            pairs = blocks.codes.view(out, -1, 2)
            self.nibbles = (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous()

    @property
    def nbytes(self) -> int:
        tensors = [self.packed, self.scales_and_zeros] + ([self.nibbles] if self.nibbles is not
                                                          None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] <= KERNEL_MAX_ROWS:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP,
                                                              self.scales_and_zeros)
        else:
            out = F.linear(rows, self.dequantized())
        return out.view(*x.shape[:-1], self.out_features)

    def codes(self) -> torch.Tensor:
        if self.nibbles is None:
            return unpack_codes(self.packed, self.out_features, self.in_features)
        return torch.stack([self.nibbles & 15, self.nibbles >> 4], dim=-1).view(
            self.out_features, self.in_features)

    def dequantized(self) -> torch.Tensor:
        codes = self.codes().to(self.dtype).view(self.out_features, -1, GROUP) - 8
        scales, zeros = self.scales_and_zeros.permute(2, 1, 0)  # [out, in / 32] each
        weight = codes * scales[..., None] + zeros[..., None]
        return weight.view(self.out_features, self.in_features)


def unpack_codes(packed: torch.Tensor, out: int, in_features: int) -> torch.Tensor:
    """The codes [out, in] of torch's CPU int4 packing (torch 2.13) when `out` is a multiple
    of 64: blocks of 64 output rows; per input column, 32 bytes, byte j holding row j (low
    nibble) and row j + 32 (high nibble). Anything else: an empty tensor."""
    if out % 64 or packed.numel() * 2 != out * in_features:
        return torch.empty(0, dtype=torch.uint8)
    blocks = packed.view(out // 64, in_features, 32)
    codes = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # [out / 64, in, 64]
    return codes.permute(0, 2, 1).reshape(out, in_features)
