"""`--quantization w8a8_int8` on CPU: int8 linear weights with one scale per output feature,
multiplied by activations quantized to int8 as they arrive (SGLang's w8a8_int8: per-channel
weights, dynamic activations), through kernels/csrc/int8_matmul.cpp. The activations get a
scale per token and group of 32 inputs rather than SGLang's one per token, for a smaller logit
error at a small kernel cost. Integer dot products (vpdpbusd) are there to beat the prepacked
bf16 GEMM at every row count, decode and prefill alike (figures: BENCHMARKS.md, "W8A8").
"""

from __future__ import annotations

import torch

from minisgl.layers.quant import LANES, vnni_kernels

ACTIVATION_GROUP = 32  # inputs per activation scale (where in_features divides; else per row)


def fits_int8(weight: torch.Tensor) -> bool:
    """Whether int8_matmul takes this [out, in] weight (else the layer stays dense)."""
    out_features, in_features = weight.shape
    return out_features % LANES == 0 and in_features % 16 == 0


class Int8ChannelWeight:
    """w = d * c per output feature (d = max |w| / 127, c in -127..127), in int8_matmul's layout:
    per block of 16 output features, the codes over all inputs as 64-byte vectors whose byte
    4 * lane + j is input 4v + j of output lane `lane` (vector v), stored as c + 128."""

    def __init__(self, weight: torch.Tensor) -> None:
        assert fits_int8(weight), weight.shape
        self.out_features, self.in_features = weight.shape
        dense = weight.float()
        self.scales = (dense.abs().amax(dim=1) / 127).contiguous()
        codes = (dense / self.scales.clamp_min(1e-30)[:, None]).round().clamp(-127, 127) + 128
        blocks, quads = self.out_features // LANES, self.in_features // 4
        self.codes = codes.to(torch.uint8).view(blocks, LANES, quads, 4).transpose(1, 2).reshape(
            blocks, quads, LANES * 4)  # [out / 16, in / 4, 64]
        self.group = ACTIVATION_GROUP if self.in_features % ACTIVATION_GROUP == 0 else (
            self.in_features)
        self.kernels = vnni_kernels()

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.int8_matmul(x.contiguous(), self.codes, self.scales, self.group)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the layout encodes (for tests)."""
        blocks, quads = self.codes.shape[:2]
        codes = self.codes.view(blocks, quads, LANES, 4).transpose(1, 2).reshape(
            self.out_features, self.in_features)
        return (codes.float() - 128) * self.scales[:, None]
