"""LoRA on a linear layer, for a batch whose rows use different adapters (S-LoRA / Punica's
multi-adapter batching).

Each LoRA-capable linear holds `slots` adapters stacked in one buffer: per slot A [P*R, in]
(P parts of R rows: q / k / v of a merged qkv projection, gate / up) and per part B^T [R, out_p],
zero-padded to the largest rank R, the adapter's scaling folded into B. One forward computes
x @ A^T for every slot in use with one GEMM, zeroes the columns of the slots a token does not
use (a one-hot [tokens, slots] mask, shared by every layer of the step), and adds
(masked) @ B^T. A decode step reads each adapter's weights once, as a per-adapter (segmented)
GEMM would; the extra multiply-adds on zeroed columns are what the one GEMM costs instead of a
launch per adapter.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LoraStepMask:
    """Which adapter slot each token of a step uses: `mask` [tokens, width] one-hot (a row of
    zeros: the base model), over the slots [0, width) the step needs."""

    mask: torch.Tensor
    width: int


class LoraContext:
    """The one object every LoRA linear of a model reads its step's mask from; the engine
    sets it on the thread (stream) that runs the forward, just before it."""

    def __init__(self) -> None:
        self.step: LoraStepMask | None = None


class LoraSlots:
    """One linear's stacked adapter buffers (this rank's shard)."""

    def __init__(self, context: LoraContext, slots: int, rank: int, in_features: int,
                 parts: list[int], dtype: torch.dtype, device: torch.device) -> None:
        self.context, self.rank, self.parts = context, rank, parts
        self.a = torch.zeros(slots, len(parts) * rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(slots, rank, size, dtype=dtype, device=device) for size in parts]

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()

    def write(self, slot: int, part: int, a: torch.Tensor, b_t: torch.Tensor) -> None:
        """Adapter weights of one part: a [r, in], b_t [r, out_p] (scaled), r <= rank."""
        r = a.shape[0]
        self.a[slot, part * self.rank:part * self.rank + r].copy_(a)
        self.b[part][slot, :r].copy_(b_t)

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's base projection) plus each token's adapter term."""
        step = self.context.step
        if step is None:
            return out
        k, rank, parts = step.width, self.rank, len(self.parts)
        a = self.a[:k].view(k * parts * rank, -1)
        hidden = (x @ a.t()).view(-1, k, parts, rank) * step.mask.view(-1, k, 1, 1)
        if parts == 1:
            return out.addmm_(hidden.view(-1, k * rank), self.b[0][:k].view(k * rank, -1))
        offset = 0
        for part, size in enumerate(self.parts):
            b = self.b[part][:k].view(k * rank, size)
            out[:, offset:offset + size] += hidden[:, :, part].reshape(-1, k * rank) @ b
            offset += size
        return out
