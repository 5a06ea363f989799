"""LoRA on a linear layer, for a batch whose rows use different adapters (S-LoRA / Punica's
multi-adapter batching).

Each LoRA-capable linear holds `slots` adapters stacked in one buffer: per slot A [P*R, in]
(P parts of R rows: q / k / v of a merged qkv projection, gate / up) and per part B^T
[R, out_p], zero-padded to the largest rank R, the adapter's scaling folded into B. A step
computes each token's term with its own adapter only:
- on CPU, segmented: the adapter tokens sorted by slot, one kernel call per linear
  (kernels/csrc/lora_matmul.cpp) for x A^T and its product with B^T, added in place;
- on CUDA, per token: each token's slot in a device tensor (-1: none), Triton kernels reading
  only that slot's A and B (kernels/lora_triton.py); a CUDA graph captures them over a static
  slot tensor the replay fills (engine.graph);
- elsewhere (a CPU without the compiled kernels), masked: x A^T for every slot the step uses in
  one GEMM, the columns of other slots zeroed by a one-hot [tokens, slots] mask, then B^T.
The step's layout (`LoraStep`) is shared by every linear of the model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from minisgl.kernels import cpu_kernels


@functools.lru_cache(maxsize=1)
def _triton_kernels() -> Any:
    from minisgl.kernels import lora_triton  # imports triton: CUDA only
    return lora_triton


@dataclass
class LoraStep:
    """Which adapter slot each token of a step uses, over the slots [0, width) it needs:
    `rows` (the adapter tokens, sorted by slot) and `ends` (int32, each slot's end in them)
    for the segmented path; `token_slots` [tokens] int32 (-1: the base model) for the
    per-token one; `mask` [tokens, width] one-hot (a zero row: the base model) for the masked
    one."""

    width: int
    rows: torch.Tensor | None = None
    ends: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    token_slots: torch.Tensor | None = None


class LoraContext:
    """The one object every LoRA linear of a model reads its step from; the engine sets it on
    the thread (stream) that runs the forward, just before it."""

    def __init__(self) -> None:
        self.step: LoraStep | None = None


class LoraSlots:
    """One linear's stacked adapter buffers (this rank's shard)."""

    def __init__(self, context: LoraContext, slots: int, rank: int, in_features: int,
                 parts: list[int], dtype: torch.dtype, device: torch.device) -> None:
        self.context, self.rank, self.parts = context, rank, parts
        self.a = torch.zeros(slots, len(parts) * rank, in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(slots, rank, size, dtype=dtype, device=device) for size in parts]
        self.offsets = [sum(parts[:i]) for i in range(len(parts))]  # each part's first column

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        for b in self.b:
            b[slot].zero_()

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Adapter weights of one part: a [r, in], b [out_p, r] (scaled), r <= rank."""
        r = a.shape[0]
        self.a[slot, part * self.rank:part * self.rank + r].copy_(a)
        self.b[part][slot, :r].copy_(b.t())

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's base projection) plus each token's adapter term."""
        step = self.context.step
        if step is None:
            return out
        if step.rows is not None:
            return self._add_segmented(x, out, step)
        if step.token_slots is not None:
            return _triton_kernels().lora_add(x, out, step.token_slots, self.a, self.b,
                                              self.offsets, self.rank)
        k, rank = step.width, self.rank
        hidden = (x @ self.a[:k].view(k * len(self.parts) * rank, -1).t()).view(
            x.shape[0], k, len(self.parts), rank) * step.mask.view(-1, k, 1, 1)
        for part, (offset, size) in enumerate(zip(self.offsets, self.parts)):
            out[:, offset:offset + size] += torch.einsum("tkr,kro->to", hidden[:, :, part],
                                                         self.b[part][:k])
        return out

    def _add_segmented(self, x: torch.Tensor, out: torch.Tensor, step: LoraStep
                       ) -> torch.Tensor:
        cpu_kernels().lora_add(x, out, step.rows, step.ends, self.a, self.b, self.offsets)
        return out
