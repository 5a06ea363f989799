"""`--quantization fp8` on CUDA: linear weights as float8 e4m3 with one float32 scale per output
feature (scale = max |w| / 448 over the feature's inputs), quantized from the checkpoint's
weights once they are loaded; activations stay in the serving dtype (weight-only), so the only
rounding added is the weights' (3 mantissa bits, relative error at most 1/16 per value).

Decode batches of up to KERNEL_MAX_ROWS rows run kernels/fp8_matmul (Triton), which reads 1 byte
per weight instead of 2: at a few rows a step is bound by those bytes. Larger batches widen the
weight (scales applied) to the activations' dtype in one pass for cuBLAS. At many rows both lose
to cuBLAS on bf16 weights: fp8 weight-only is for latency at few streams (and for memory), not
for throughput at many (figures: BENCHMARKS.md, "GPU (H100 / H200)").
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
# above: widen + cuBLAS, the faster of the two there
KERNEL_MAX_ROWS = 64
MIN_CAPABILITY = (8, 9)  # Ada / Hopper: float8 conversions in hardware (Triton needs them)


def fp8_unavailable(device: torch.device, min_capability: tuple[int, int] = MIN_CAPABILITY
                    ) -> str | None:
    """Why fp8 (or, with min_capability 8.0, the int4 kernels) cannot run on `device`, or
    None."""
    if device.type != "cuda":
        return "it runs on CUDA GPUs only"
    capability = torch.cuda.get_device_capability(device)
    if capability < min_capability:
        return (f"it needs compute capability {min_capability[0]}.{min_capability[1]} or newer; "
                f"this GPU has {capability[0]}.{capability[1]}")
    try:
        import triton  # noqa: F401
    except ImportError:
        return "it needs triton (pip install triton; CUDA builds of torch ship it)"
    return None


def kernel_or_widened(x: torch.Tensor, weight: Any, max_rows: int,
                      kernel: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x @ weight.T for a compact CUDA weight (this one, layers.gpu_blocks'): its kernel on up
    to `max_rows` rows (rows contiguous), else cuBLAS on `weight.widened(dtype)`."""
    rows = x.reshape(-1, weight.in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if rows.shape[0] <= max_rows:
        out = kernel(rows)
    else:
        out = F.linear(rows, weight.widened(rows.dtype))
    return out.view(*x.shape[:-1], weight.out_features)


@functools.lru_cache(maxsize=1)
def _kernels() -> Any:
    from minisgl.kernels import fp8_matmul  # imports triton: CUDA only
    return fp8_matmul


class Fp8ChannelWeight:
    """w ~= codes * scales[:, None]: codes [out, in] float8 e4m3fn, scales [out] float32; or,
    from a block-wise fp8 checkpoint (`from_codes`), w = codes * scales[:, i // scale_group],
    scales [out, ceil(in / scale_group)]."""

    def __init__(self, weight: torch.Tensor) -> None:
        dense = weight.float()
        self.out_features, self.in_features = dense.shape
        self.scales = (dense.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12).contiguous()
        self.codes = (dense / self.scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        self.scale_group = 0

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, scale_group: int = 0
                   ) -> Fp8ChannelWeight:
        """A checkpoint's float8 codes with their float32 scales, kept as they are."""
        weight = cls.__new__(cls)
        weight.out_features, weight.in_features = codes.shape
        weight.codes, weight.scales = codes.contiguous(), scales.float().contiguous()
        weight.scale_group = scale_group
        return weight

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scales.numel() * self.scales.element_size()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return kernel_or_widened(x, self, KERNEL_MAX_ROWS, lambda rows: _kernels().fp8_matmul(
            rows, self.codes, self.scales, self.scale_group))

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        """codes * scales in `dtype` (a temporary: prefill's GEMM input)."""
        return _kernels().fp8_dequantize(self.codes, self.scales, dtype, self.scale_group)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] the codes encode (for tests)."""
        if self.scale_group == 0:
            return self.codes.float() * self.scales[:, None]
        per_input = self.scales.repeat_interleave(self.scale_group, dim=1)
        return self.codes.float() * per_input[:, :self.in_features]
