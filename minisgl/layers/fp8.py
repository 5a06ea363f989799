"""`--quantization fp8` on CUDA: linear weights as float8 e4m3 with one float32 scale per output
feature (scale = max |w| / 448 over the feature's inputs), quantized from the checkpoint's
weights once they are loaded; activations stay in the serving dtype (weight-only), so the only
rounding added is the weights' (3 mantissa bits, relative error at most 1/16 per value).

Decode batches of up to KERNEL_MAX_ROWS rows run kernels/fp8_matmul (Triton), which reads 1 byte
per weight instead of 2: at a few rows a step is bound by those bytes. Larger batches widen the
weight (scales applied) to the activations' dtype in one pass for cuBLAS. At many rows both lose
to cuBLAS on bf16 weights: fp8 weight-only is for latency at few streams (and for memory), not
for throughput at many (figures: BENCHMARKS.md, "GPU, second session").
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# above: widen + cuBLAS, the faster of the two there
KERNEL_MAX_ROWS = 64
MIN_CAPABILITY = (8, 9)  # Ada / Hopper: float8 conversions in hardware (Triton needs them)


def fp8_unavailable(device: torch.device) -> str | None:
    """Why fp8 cannot run on `device`, or None."""
    if device.type != "cuda":
        return "it runs on CUDA GPUs only"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        return (f"it needs compute capability 8.9 or newer (Ada, Hopper); this GPU has "
                f"{capability[0]}.{capability[1]}")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "it needs triton (pip install triton; CUDA builds of torch ship it)"
    return None


@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    from minisgl.kernels import fp8_matmul  # imports triton: CUDA only
    return fp8_matmul


class Fp8ChannelWeight:
    """w ~= codes * scales[:, None]: codes [out, in] float8 e4m3fn, scales [out] float32."""

    def __init__(self, weight: torch.Tensor) -> None:
        dense = weight.float()
        self.out_features, self.in_features = dense.shape
        self.scales = (dense.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12).contiguous()
        self.codes = (dense / self.scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        if rows.shape[0] <= KERNEL_MAX_ROWS:
            out = _kernels().fp8_matmul(rows, self.codes, self.scales)
        else:
            out = F.linear(rows, self.widened(rows.dtype))
        return out.view(*x.shape[:-1], self.out_features)

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        """codes * scales in `dtype` (a temporary: prefill's GEMM input)."""
        return _kernels().fp8_dequantize(self.codes, self.scales, dtype)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the codes encode (for tests)."""
        return self.codes.float() * self.scales[:, None]
