"""A quantized checkpoint's linear weights on CUDA (models.hf_quant reads them), exactly as the
checkpoint stores them:
- int4 (AWQ, GPTQ, compressed-tensors): `Int4GroupWeight`, the codes packed 8 to an int32 word
  along the inputs, a float16 scale and a uint8 zero point per output and group,
  w = (q - z) * s. Batches of up to KERNEL_MAX_ROWS rows run kernels/int4_matmul (Triton),
  which reads half a byte per weight; larger ones widen the weight in one pass for cuBLAS (as
  layers.fp8). Staged while loading as layers.gguf_weight's "W4" blocks.
- fp8: layers.fp8's weight with the checkpoint's scales (block-wise: per output and block of
  128 inputs), staged as `Fp8Blocks`.
Both stage as blocks that slice like the dense weight, so tensor parallelism shards them as
the CPU kernel's, and the parts of a merged layer (q / k / v) are joined by rows at the end
(`gpu_block_weight`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.layers.fp8 import Fp8ChannelWeight, kernel_or_widened
from minisgl.layers.gguf_weight import GROUP, BlockSlots, GgufBlocks, cat_rows

# Above it, dequantize + cuBLAS: the kernel's tiles lose to widening from a few rows on
# (BENCHMARKS.md, "GPU (H100 / H200)")
KERNEL_MAX_ROWS = 2


@dataclass
class Fp8Blocks:
    """A float8 checkpoint weight while it loads: w = codes * scales[:, i // group] (group 0:
    scales [out], one per output feature)."""

    codes: torch.Tensor  # [out, in] float8_e4m3fn
    scales: torch.Tensor  # [out] or [out, ceil(in / group)] float32
    group: int = 0
    kind = "FP8"

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def data(self) -> Fp8Blocks:  # NOTE: stands in for a Parameter, as GgufBlocks does
        return self

    def __getitem__(self, index: slice | tuple[slice, slice]) -> Fp8Blocks:
        """Rows (`b[a:z]`) or whole blocks of columns (`b[:, a:z]`)."""
        if not isinstance(index, tuple):
            return Fp8Blocks(self.codes[index], self.scales[index], self.group)
        rows, cols = index
        if self.group == 0:
            return Fp8Blocks(self.codes[rows, cols], self.scales[rows], 0)
        start, stop = cols.start or 0, self.shape[1] if cols.stop is None else cols.stop
        if start % self.group or (stop % self.group and stop != self.shape[1]):
            raise ValueError(f"a shard of a block-wise fp8 weight must cut at multiples of "
                             f"{self.group} input features, not [{start}, {stop}): a "
                             "tensor-parallel size that splits no block is needed")
        return Fp8Blocks(self.codes[rows, cols],
                         self.scales[rows, start // self.group:-(-stop // self.group)],
                         self.group)


def finished_weight(slots: BlockSlots, device: torch.device) -> Any:
    """A layer's staged blocks as the weight its kernel runs on `device`: the CPU kernels'
    (BlockSlots.finish), or the CUDA forms here."""
    return slots.finish() if device.type == "cpu" else gpu_block_weight(slots, device)


def gpu_block_weight(slots: BlockSlots, device: torch.device
                     ) -> Int4GroupWeight | Fp8ChannelWeight | DenseWeight:
    """One layer's staged parts (rows in order) as one weight for its CUDA kernel."""
    parts = slots.ordered_parts()
    kinds = {part.kind for part in parts}
    if kinds == {"W4"}:
        return Int4GroupWeight(cat_rows(parts), device)
    if kinds == {"MXFP4"}:  # NOTE: no CUDA kernel for it yet: the values, in bfloat16
        return DenseWeight(cat_rows(parts).dequantize(torch.bfloat16).to(device))
    if len(kinds) == 1 and isinstance(parts[0], Fp8Blocks):
        groups = {part.group for part in parts}
        if len(groups) > 1:
            raise ValueError("the parts of one layer mix block-wise and per-channel fp8 scales")
        codes = torch.cat([part.codes for part in parts]).to(device)
        scales = torch.cat([part.scales for part in parts]).to(device)
        return Fp8ChannelWeight.from_codes(codes, scales, groups.pop())
    raise ValueError(f"weights of kinds {sorted(kinds)} have no GPU kernel in one layer "
                     "(int4 or fp8 checkpoints' only)")


class DenseWeight:
    """A weight whose blocks have no kernel on this device, held dequantized."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.weight.dtype) @ self.weight.t()).to(x.dtype)


@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    from minisgl.kernels import int4_matmul  # imports triton: CUDA only
    return int4_matmul


class Int4GroupWeight:
    """words [out, in / 8] int32, scales [out, in / g] float16, zeros [out, in / g] uint8."""

    def __init__(self, blocks: GgufBlocks, device: torch.device) -> None:
        if blocks.kind != "W4":
            raise ValueError(f"{blocks.kind} blocks have no GPU kernel (int4 checkpoints' only)")
        self.out_features, self.in_features = blocks.shape
        group = blocks.columns_per_scale
        codes = blocks.codes.to(torch.int64).view(self.out_features, -1, 8)
        words = sum(codes[..., j] << (4 * j) for j in range(8))
        self.words = ((words + 2**31) % 2**32 - 2**31).to(torch.int32).to(device)
        self.scales = blocks.scales[..., 0].to(torch.float16).to(device).contiguous()
        self.zeros = blocks.subs[:, ::group // GROUP, 1].to(torch.uint8).to(device).contiguous()

    @property
    def group(self) -> int:
        return self.in_features // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.words, self.scales, self.zeros))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_or_widened(x, self, KERNEL_MAX_ROWS, lambda rows: _kernels().int4_matmul(
            rows, self.words, self.scales, self.zeros))

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in `dtype` (a temporary: prefill's GEMM input)."""
        return _kernels().int4_dequantize(self.words, self.scales, self.zeros, dtype)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] (for tests)."""
        shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=self.words.device)
        codes = ((self.words.unsqueeze(-1) >> shifts) & 15).flatten(1)
        zeros = self.zeros.to(torch.int32).repeat_interleave(self.group, dim=1)
        return (codes - zeros).float() * self.scales.float().repeat_interleave(self.group, dim=1)
