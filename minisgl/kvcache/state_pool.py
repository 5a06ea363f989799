"""The recurrent-state pool of a hybrid model, beside the paged KV pool: for each request row of
the page table and each linear-attention layer, the layer's convolution window over its last
inputs and its recurrent state. Unlike KV, a request's state does not grow: it lives in the
request's table row, taken with the row at admission and given back with it, so a row's
state is the request's own from its first prefill chunk (which starts it from zero, or from a
snapshot the prefix cache held) on.

Past the request rows, `snapshots` more rows hold states copied out at a known length: the
prefix cache's snapshots (kvcache.state_cache), addressed by their index in the same tensors.
With speculative decoding, `scratch` more rows per request row follow them: a verify step saves
the state after each of a row's tokens but the last there, and the row keeps the one after its
accepted tokens (engine.speculation).
"""

from __future__ import annotations

import torch


class StatePool:
    def __init__(self, num_layers: int, rows: int, conv_dim: int, conv_kernel: int,
                 state_shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
                 snapshots: int = 0, scratch: int = 0,
                 state_dtype: torch.dtype = torch.float32) -> None:
        self.rows, self.snapshots, self.scratch = rows, snapshots, scratch
        total = rows + snapshots + rows * scratch
        # [layer, row, channel, the last conv_kernel - 1 inputs], in the model's dtype
        self.conv = torch.zeros(num_layers, total, conv_dim, conv_kernel - 1, dtype=dtype,
                                device=device)
        # [layer, row, head, ...]: the recurrent state (Gated DeltaNet: key x value; Mamba2:
        # head_dim x d_state), float32 (as it is updated) or bfloat16 (--mamba-ssm-dtype)
        self.recurrent = torch.zeros(num_layers, total, *state_shape, dtype=state_dtype,
                                     device=device)

    def layer(self, linear_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One linear layer's conv windows and recurrent states, indexed by table row (then
        snapshot index)."""
        return self.conv[linear_id], self.recurrent[linear_id]

    def copy(self, sources: list[int] | torch.Tensor, targets: list[int] | torch.Tensor
             ) -> None:
        """Every layer's state of each source row into its target row."""
        if not len(sources):
            return
        device = self.conv.device
        src = torch.as_tensor(sources, device=device)
        dst = torch.as_tensor(targets, device=device)
        self.conv[:, dst] = self.conv[:, src]
        self.recurrent[:, dst] = self.recurrent[:, src]

    def clear(self, rows: list[int]) -> None:
        """Every layer's state of each row back to zero (a request's first prefill chunk)."""
        if rows:
            index = torch.as_tensor(rows, device=self.conv.device)
            self.conv[:, index] = 0
            self.recurrent[:, index] = 0

    def scratch_row(self, row: int | torch.Tensor, index: int | torch.Tensor
                    ) -> int | torch.Tensor:
        """Request row `row`'s scratch state `index` (< scratch)."""
        return self.rows + self.snapshots + row * self.scratch + index

    @property
    def bytes_per_state(self) -> int:
        return (self.conv[:, 0].numel() * self.conv.element_size()
                + self.recurrent[:, 0].numel() * self.recurrent.element_size())

    @property
    def nbytes(self) -> int:
        return (self.conv.numel() * self.conv.element_size()
                + self.recurrent.numel() * self.recurrent.element_size())
