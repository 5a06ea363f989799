import torch
import torch.nn.functional as F
from torch import nn

from minisgl.kernels import cpu_kernels, cuda_kernels
from minisgl.layers.base import Layer


class RMSNorm(Layer):
    """RMSNorm with float32 math and the residual add fused in; one kernel on CPU (ours) and on
    CUDA (FlashInfer's)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _kernels(self, x: torch.Tensor):  # noqa: ANN202 - the extension module or None
        return cpu_kernels() if x.device.type == "cpu" and x.is_contiguous() else None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, residual to carry): the carry is x, plus residual when given.
        NOTE: with the CPU kernel the sum is written into `residual` in place; with the CUDA
        kernel too, and the normed values into `x`."""
        fused = cuda_kernels(x)
        contiguous = x.is_contiguous() and (residual is None or residual.is_contiguous())
        if fused is not None and contiguous:
            if residual is None:
                return fused.rmsnorm(x, self.weight, self.eps), x
            fused.fused_add_rmsnorm(x, residual, self.weight, self.eps)
            return x, residual
        kernels = self._kernels(x)
        if kernels is not None:
            normed, carry = kernels.rms_norm(x, residual, self.weight, self.eps)
            return normed, carry
        if residual is not None:
            x = x + residual
        return self.forward_plain(x), x

    def forward_plain(self, x: torch.Tensor) -> torch.Tensor:
        """Over the last dim of x (2-D, or 3-D per head as QK-norm uses it); x is not changed."""
        fused = cuda_kernels(x)
        if fused is not None and x.dim() in (2, 3) and x.stride(-1) == 1:
            return fused.rmsnorm(x, self.weight, self.eps)
        kernels = self._kernels(x)
        if kernels is not None:
            return kernels.rms_norm(x, None, self.weight, self.eps)[0]
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
