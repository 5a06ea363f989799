"""The recurrent-state pool of a hybrid model, beside the paged KV pool: for each request row of
the page table and each linear-attention layer, the layer's convolution window over its last
inputs and its recurrent state. Unlike KV, a request's state does not grow: it lives in the
request's table row, taken with the row at admission and given back with it, so a row's
state is the request's own from its first prefill chunk (which starts it from zero) on.
"""

from __future__ import annotations

import torch


class StatePool:
    def __init__(self, num_layers: int, rows: int, conv_dim: int, conv_kernel: int,
                 state_shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device
                 ) -> None:
        self.rows = rows
        # [layer, row, channel, the last conv_kernel - 1 inputs], in the model's dtype
        self.conv = torch.zeros(num_layers, rows, conv_dim, conv_kernel - 1, dtype=dtype,
                                device=device)
        # [layer, row, head, ...]: the recurrent state (Gated DeltaNet: key x value; Mamba2:
        # head_dim x d_state), float32 as it is updated
        self.recurrent = torch.zeros(num_layers, rows, *state_shape, dtype=torch.float32,
                                     device=device)

    def layer(self, linear_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One linear layer's conv windows and recurrent states, indexed by table row."""
        return self.conv[linear_id], self.recurrent[linear_id]

    @property
    def nbytes(self) -> int:
        return (self.conv.numel() * self.conv.element_size()
                + self.recurrent.numel() * self.recurrent.element_size())
