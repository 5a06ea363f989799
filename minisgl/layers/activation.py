import torch
import torch.nn.functional as F
from torch import nn

from minisgl.kernels import cpu_kernels


class SiluAndMul(nn.Module):
    """silu(gate) * up over a merged [..., 2 * d] gate/up projection; on CPU one compiled pass
    (float32 math, one rounding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = cpu_kernels() if x.device.type == "cpu" and x.is_contiguous() else None
        if kernels is not None:
            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
