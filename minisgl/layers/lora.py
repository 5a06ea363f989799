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
    `token_slots` [tokens] (-1: the base model; int32 for the per-token path, which reads
    it); `rows` (the adapter tokens, sorted by slot) and `ends` (int32, each slot's end in
    them) for the segmented path; `mask` [tokens, width] one-hot (a zero row: the base model)
    for the masked one."""

    width: int
    rows: torch.Tensor | None = None
    ends: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    token_slots: torch.Tensor | None = None


def slot_layout(token_slots: torch.Tensor, width: int, layout: str, dtype: torch.dtype
                ) -> LoraStep:
    """The LoraStep of `layout` (segmented, per_token or masked) for tokens' slots [tokens]
    (-1: none) on the step's device, slots below `width`."""
    if layout == "per_token":
        return LoraStep(width, token_slots=token_slots.to(torch.int32))
    if layout != "segmented":
        mask = (token_slots[:, None] == torch.arange(width, device=token_slots.device))
        return LoraStep(width, mask=mask.to(dtype), token_slots=token_slots)
    order = torch.argsort(token_slots, stable=True)
    rows = order[(token_slots[order] >= 0)]
    ends = torch.bincount(token_slots[rows], minlength=width).cumsum(0).to(torch.int32)
    return LoraStep(width, rows=rows, ends=ends, token_slots=token_slots)


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

    def add(self, x: torch.Tensor, out: torch.Tensor, step: LoraStep | None = None
            ) -> torch.Tensor:
        """out (x's base projection) plus each token's adapter term (rows of `step`, by
        default the context's)."""
        step = step or self.context.step
        if step is None:
            return out
        if step.rows is not None:
            return self._add_segmented(x, out, step)
        if step.mask is None:
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


class ExpertLora:
    """LoRA on a layer's experts (layers.moe), this rank's shard: per adapter slot and expert,
    a gate/up term of rank 2R (the gate's rows then the up's, or one fused gate_up adapter's)
    and a down term of rank R, kept as LoraSlots whose slot s * E + e holds slot s at expert e.
    Each (token, expert) pair of a step takes its token's slot at its expert. A part no
    target asks for has no buffers (None)."""

    def __init__(self, context: LoraContext, slots: int, rank: int, num_experts: int,
                 hidden_size: int, shard: int, parts: set[str], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.context, self.num_experts = context, num_experts
        count = slots * num_experts
        self.gate_up = (LoraSlots(context, count, 2 * rank, hidden_size, [2 * shard], dtype,
                                  device) if parts & {"gate", "up"} else None)
        self.down = (LoraSlots(context, count, rank, shard, [hidden_size], dtype, device)
                     if "down" in parts else None)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every A and B buffer it holds."""
        return [t for part in (self.gate_up, self.down) if part is not None
                for t in (part.a, *part.b)]

    def clear(self, slot: int) -> None:
        for tensor in self.tensors:
            tensor[slot * self.num_experts:(slot + 1) * self.num_experts].zero_()

    def write(self, slot: int, part: tuple[int, str], a: torch.Tensor, b: torch.Tensor
              ) -> None:
        """part: (expert, "gate_up" or "down"); a [r, in], b [out, r] (scaled)."""
        expert, which = part
        assert 0 <= expert < self.num_experts, expert
        getattr(self, which).write(slot * self.num_experts + expert, 0, a, b)

    def pair_step(self, rows: torch.Tensor, experts: torch.Tensor) -> LoraStep | None:
        """The layout of a step's (token, expert) pairs: pair i is token rows[i] at expert
        experts[i]."""
        step = self.context.step
        if step is None:
            return None
        slots = step.token_slots.index_select(0, rows).long()
        pairs = torch.where(slots >= 0, slots * self.num_experts + experts, -1)
        if step.rows is not None:
            layout = "segmented"
        # NOTE: on CUDA never masked: a GEMM over every (slot, expert) would dwarf the experts
        elif step.mask is None or pairs.is_cuda:
            layout = "per_token"
        else:
            layout = "masked"
        dtype = (self.gate_up or self.down).a.dtype
        return slot_layout(pairs, step.width * self.num_experts, layout, dtype)

    def add(self, which: str, x: torch.Tensor, out: torch.Tensor, step: LoraStep
            ) -> torch.Tensor:
        buffers = getattr(self, which)
        return out if buffers is None else buffers.add(x, out, step)
