import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, with the residual add fused in when one is given."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (normed, residual to carry): the carry is x, plus residual when given."""
        if residual is not None:
            x = x + residual
        return self._norm(x), x

    def forward_plain(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x)
