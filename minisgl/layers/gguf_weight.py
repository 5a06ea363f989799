"""GGUF linear weights of every block type the AVX2 kernel runs (kernels/csrc/block_matmul.cpp):
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 ("flat": a scale per 32 values), MXFP4 (e2m1 codes, a power of
two per 32 values) and the k-quants Q4_K, Q5_K, Q6_K (super-blocks of 256 values with 6- or
8-bit sub-scales), kept in their codes.

`GgufBlocks` is one tensor's blocks decoded but not dequantized (models.gguf_decode reads
them); it slices like the dense weight (whole groups / super-blocks of columns), so the
tensor-parallel loaders shard it unchanged. A layer's weight may come in parts of different
types (llama.cpp's Q4_K_M gives q / k Q5_0 and v Q8_0): `BlockSlots` collects the parts in
place of the weight and `finish` packs each run of one type (`GgufWeight`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from minisgl.kernels import cpu_kernels
from minisgl.layers.quant import terms_now

GROUP = 32
SUPER = 256
LANES = 8  # output features per block of the kernel's layout
FLAT, MINS, SIX_BIT, SYMMETRIC, LUT = 0, 1, 2, 3, 4  # the kernel's scale modes
# LUT (MXFP4): code c stands for E2M1[c]; the kernel reads 2 E2M1[c] + 12 (a byte in [0, 24])
# with d' = half the block's scale and m' = -12 d'
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
LUT_OFFSET = 12
LUT_CODES = torch.tensor([int(2 * v) + LUT_OFFSET for v in E2M1], dtype=torch.uint8)
# kind -> (code bits, scale mode)
# ("W4": an int4 checkpoint's groups of 32 to 128 inputs, a zero point each: models.hf_quant)
KINDS = {"Q4_0": (4, SYMMETRIC), "Q4_1": (4, FLAT), "Q5_0": (5, SYMMETRIC), "Q5_1": (5, FLAT),
         "Q8_0": (8, SYMMETRIC), "Q4_K": (4, MINS), "Q5_K": (5, MINS), "Q6_K": (6, SIX_BIT),
         "MXFP4": (4, LUT), "W4": (4, MINS)}
# With one activation term these kinds' m' (a fixed multiple of d') is folded into the integer
# dot product: the whole weight times the rounded activations, as llama.cpp computes them;
# the others multiply d' * code by the rounded activations and m' by the exact ones.
OFFSET_FOLDED = frozenset(kind for kind, (_, mode) in KINDS.items()
                          if mode in (SYMMETRIC, SIX_BIT, LUT))
# NOTE: past this many rows the dequantized weight and a GEMM beat the integer dot products
# (the crossovers: BENCHMARKS.md, "k-quants on VNNI" against a bfloat16 GEMM and "The AVX2
# block kernel's int16 products" against a float32 one)
KERNEL_MAX_ROWS = 128  # VNNI
ONE_TERM_MAX_ROWS = 2**40  # VNNI, one-term activations: the kernel keeps up at any batch
AVX2_KERNEL_MAX_ROWS = 512


@functools.lru_cache(maxsize=1)
def native_bf16_gemm() -> bool:
    return torch.backends.mkldnn.is_available() and bool(
        torch.ops.mkldnn._is_mkldnn_bf16_supported())


def block_kernels():
    kernels = cpu_kernels()
    return kernels if kernels is not None and kernels.block_kernel_available() else None


@dataclass
class GgufBlocks:
    """w[o, i] = d'[o, i] * codes[o, i] + m'[o, i], where
    flat kinds: (d', m') = scales[o, i // 32] (Q4_0: m' = -8 d', Q5_0: -16 d', Q8_0: 0);
    Q4_K, Q5_K, W4: d' = scales[o, i // S, 0] * subs[o, i // 32, 0],
                m' = scales[o, i // S, 1] * subs[o, i // 32, 1] (scales[..., 1] = -dmin),
                S = 256 (W4: the checkpoint's group size);
    Q6_K: d' = scales[o, i // 256, 0] * subs[o, i // 32, (i // 16) % 2] (int8), m' = -32 d';
    MXFP4: codes index E2M1, read through LUT_CODES (d' = half the scale, m' = -12 d').
    Every value is exact in float32 (float16 scales times small integers)."""

    kind: str
    codes: torch.Tensor  # [out, in]: uint8, Q8_0 int8
    scales: torch.Tensor  # [out, in / 32 (flat) or in / 256, 2] float32
    subs: torch.Tensor | None  # [out, in / 32, 2] int16 (k-quants)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def data(self) -> GgufBlocks:  # NOTE: stands in for a Parameter: `param.data` is itself
        return self

    @property
    def columns_per_scale(self) -> int:
        return self.shape[1] // self.scales.shape[1]

    def __getitem__(self, index: slice | tuple[slice, slice]) -> GgufBlocks:
        """Rows (`b[a:z]`) or whole groups / super-blocks of columns (`b[:, a:z]`)."""
        if not isinstance(index, tuple):
            return GgufBlocks(self.kind, self.codes[index], self.scales[index],
                              None if self.subs is None else self.subs[index])
        rows, cols = index
        start, stop = cols.start or 0, self.shape[1] if cols.stop is None else cols.stop
        step = self.columns_per_scale
        if start % step or stop % step:
            raise ValueError(f"a shard of a {self.kind} weight must cut at multiples of {step} "
                             f"input features (its blocks or groups), not [{start}, {stop}): "
                             "a tensor-parallel size that splits no group is needed")
        subs = None if self.subs is None else self.subs[rows, start // GROUP:stop // GROUP]
        return GgufBlocks(self.kind, self.codes[rows, cols],
                          self.scales[rows, start // step:stop // step], subs)

    def scale_and_offset(self) -> tuple[torch.Tensor, torch.Tensor]:
        """d' and m' per weight, [out, in] float32."""
        out, in_features = self.shape
        if self.subs is None:
            d, m = self.scales.repeat_interleave(GROUP, dim=1).unbind(-1)
            return d, m
        supers = self.scales.repeat_interleave(self.columns_per_scale, dim=1)
        subs = self.subs.float().repeat_interleave(GROUP, dim=1)
        if self.kind == "Q6_K":
            half = (torch.arange(in_features) // 16) % 2
            d = supers[..., 0] * torch.where(half.bool(), subs[..., 1], subs[..., 0])
            return d, -32 * d
        return supers[..., 0] * subs[..., 0], supers[..., 1] * subs[..., 1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        d, m = self.scale_and_offset()
        codes = LUT_CODES[self.codes.long()] if self.kind == "MXFP4" else self.codes
        return (d * codes.float() + m).to(dtype)


def cat_rows(parts: list[GgufBlocks]) -> GgufBlocks:
    subs = None if parts[0].subs is None else torch.cat([p.subs for p in parts])
    return GgufBlocks(parts[0].kind, torch.cat([p.codes for p in parts]),
                      torch.cat([p.scales for p in parts]), subs)


class GgufWeight:
    """One type's blocks in block_matmul.cpp's layout (see there)."""

    def __init__(self, blocks: GgufBlocks) -> None:
        out, in_features = blocks.shape
        if out % LANES or in_features % GROUP:
            raise ValueError(f"a {blocks.kind} weight of shape {blocks.shape} does not fit the "
                             f"kernel's blocks of {LANES} x {GROUP}")
        self.kind, self.out_features, self.in_features = blocks.kind, out, in_features
        self.bits, self.mode = KINDS[blocks.kind]
        if self.mode in (SYMMETRIC, LUT):  # the kernel takes m' as a multiple of d', not stored
            offset = (LUT_OFFSET if self.mode == LUT else 0 if self.bits == 8
                      else 1 << (self.bits - 1))
            if not torch.equal(blocks.scales[..., 1], -offset * blocks.scales[..., 0]):
                raise ValueError(f"{blocks.kind} blocks with offsets other than {-offset} d")
        rows, groups = out // LANES, in_features // GROUP
        codes = blocks.codes.view(torch.uint8).view(rows, LANES, groups, 8, 4)
        quads = codes.permute(0, 2, 3, 1, 4).reshape(rows, groups, 8, 4 * LANES)
        if self.bits == 8:
            vectors = [quads]
        else:
            low = quads & 15
            vectors = [low[:, :, 0::2] | (low[:, :, 1::2] << 4)]
            high = (quads >> 4).to(torch.int32)
            if self.bits == 5:
                vectors.append(sum(high[:, :, t] << t for t in range(8))[:, :, None])
            elif self.bits == 6:
                vectors.append(torch.stack([sum(high[:, :, 4 * h + u] << (2 * u)
                                                for u in range(4)) for h in range(2)], dim=2))
        self.codes = torch.cat([v.to(torch.uint8) for v in vectors], dim=2).reshape(
            rows, groups, -1).contiguous()
        self.scales = _lanes_last(blocks.scales, rows).to(torch.float16).contiguous()
        self.subs = (torch.empty(0, dtype=torch.uint8) if blocks.subs is None else
                     _lanes_last(blocks.subs, rows).to(torch.int8).view(torch.uint8).contiguous())
        self.kernels = block_kernels()
        vnni = self.kernels is not None and self.kernels.block_kernel_vnni()
        self.terms = terms_now() if vnni else 2  # AVX2: one int16 term, counted as two
        self.kernel_max_rows = (AVX2_KERNEL_MAX_ROWS if not vnni else KERNEL_MAX_ROWS
                                if self.terms == 2 else ONE_TERM_MAX_ROWS)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.subs))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > self.kernel_max_rows * self.in_features:
            # NOTE: without AVX-512 BF16 a bfloat16 GEMM is emulated, ~250x slower: float32
            bf16 = x.dtype == torch.bfloat16 and native_bf16_gemm()
            weight_t = self.kernels.block_dequantize_t(self.codes, self.scales, self.subs,
                                                       self.bits, self.mode, bf16)
            return x @ weight_t if bf16 else (x.float() @ weight_t).to(x.dtype)
        return self.kernels.block_matmul(x.contiguous(), self.codes, self.scales, self.subs,
                                         self.bits, self.mode, self.terms)

    def rows(self, index: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `index` of the weight (all by default) as float32 [len, in]."""
        picked = torch.empty(0, dtype=torch.long) if index is None else index.reshape(-1)
        return self.kernels.block_dequantize(self.codes, self.scales, self.subs, self.bits,
                                             self.mode, picked)


class GroupedGgufWeights:
    """Experts' weights of one part (gate/up or down), all GgufWeight of one type and shape:
    rows grouped by expert run as one kernel call (block_matmul_grouped), equal to the bit to
    one call per expert."""

    def __init__(self, weights: list[GgufWeight]) -> None:
        first = weights[0]
        self.codes = [w.codes for w in weights]
        self.scales = [w.scales for w in weights]
        self.subs = [w.subs for w in weights]
        self.bits, self.mode, self.terms = first.bits, first.mode, first.terms
        self.kernel_max_rows, self.kernels = first.kernel_max_rows, first.kernels

    @classmethod
    def of(cls, weights: list) -> GroupedGgufWeights | None:
        """None where some weight is not a GgufWeight like the first (another form, a stacked
        one, another type or shape) or the kernels are not built."""
        first = weights[0]
        if not isinstance(first, GgufWeight) or first.kernels is None:
            return None
        same = all(type(w) is GgufWeight and (w.kind, w.out_features, w.in_features, w.terms)
                   == (first.kind, first.out_features, first.in_features, first.terms)
                   for w in weights)
        return cls(weights) if same else None

    def matmul(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor | None:
        """x's rows (group e: counts[e] rows, in order) times their experts' weights; None
        where a group is past the rows the kernel takes (the caller runs those as GgufWeight
        does)."""
        if max(counts) > self.kernel_max_rows:
            return None
        return self.kernels.block_matmul_grouped(x.contiguous(), self.codes, self.scales,
                                                 self.subs, self.bits, self.mode, self.terms,
                                                 counts)


def _lanes_last(per_row: torch.Tensor, blocks: int) -> torch.Tensor:
    """[out, n, 2] -> [out / 8, n, 2, 8]."""
    out, n, two = per_row.shape
    return per_row.view(blocks, LANES, n, two).permute(0, 2, 3, 1)


class StackedWeight:
    """Row ranges of one layer held in different block types: each runs its own kernel."""

    def __init__(self, parts: list[GgufWeight]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p.matmul(x) for p in self.parts], dim=-1)


class BlockSlots:
    """Stands in for a linear layer's weight while its GGUF blocks load: the TP loaders
    `narrow` it to a row range and `copy_` a part in, as into the dense weight."""

    def __init__(self, out_features: int, in_features: int, start: int = 0,
                 parts: dict[int, GgufBlocks] | None = None) -> None:
        self.shape = (out_features, in_features)
        self.start = start
        self.parts = {} if parts is None else parts

    @property
    def data(self) -> BlockSlots:
        return self

    def narrow(self, dim: int, start: int, length: int) -> BlockSlots:
        assert dim == 0
        return BlockSlots(length, self.shape[1], self.start + start, self.parts)

    def copy_(self, part: GgufBlocks) -> None:
        """`part`: GgufBlocks, or (a checkpoint's fp8 weight on CUDA) layers.gpu_blocks'."""
        if isinstance(part, torch.Tensor):
            raise ValueError("a layer loading GGUF blocks was given a dense tensor for part of it")
        self.parts[self.start] = part

    @property
    def covered_rows(self) -> int:
        return sum(part.shape[0] for part in self.parts.values())

    @property
    def complete(self) -> bool:
        return self.covered_rows == self.shape[0]

    def ordered_parts(self) -> list[GgufBlocks]:
        """The parts by their first row, once they cover the layer."""
        if not self.complete:
            raise ValueError(f"GGUF blocks filled {self.covered_rows} of {self.shape[0]} rows "
                             "of a layer")
        return [self.parts[start] for start in sorted(self.parts)]

    def finish(self) -> GgufWeight | StackedWeight:
        runs: list[list[GgufBlocks]] = []
        for part in self.ordered_parts():
            if runs and runs[-1][0].kind == part.kind:
                runs[-1].append(part)
            else:
                runs.append([part])
        weights = [GgufWeight(cat_rows(run)) for run in runs]
        return weights[0] if len(weights) == 1 else StackedWeight(weights)
