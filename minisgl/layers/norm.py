import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm (float32 accumulation inside the kernel), with the residual add fused in."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, residual to carry): the carry is x, plus residual when given."""
        if residual is not None:
            x = x + residual
        return self._norm(x), x

    def forward_plain(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x)
