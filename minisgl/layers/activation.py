import torch
import torch.nn.functional as F

from minisgl.kernels import cpu_kernels, cuda_kernels
from minisgl.layers.base import Layer


class SiluAndMul(Layer):
    """silu(gate) * up over a merged [..., 2 * d] gate/up projection; one kernel on CPU (ours,
    float32 math, one rounding) and on CUDA (FlashInfer's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cuda_kernels(x)
        if fused is not None and x.is_contiguous() and x.shape[-1] * x.element_size() % 32 == 0:
            return fused.silu_and_mul(x)
        kernels = cpu_kernels() if x.device.type == "cpu" and x.is_contiguous() else None
        if kernels is not None:
            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluTanhAndMul(Layer):
    """gelu(gate, tanh approximation) * up over a merged gate/up projection (Gemma's GeGLU);
    FlashInfer's kernel on CUDA, torch elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = getattr(cuda_kernels(x), "gelu_tanh_and_mul", None)
        if fused is not None and x.is_contiguous() and x.shape[-1] * x.element_size() % 32 == 0:
            return fused(x)
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
