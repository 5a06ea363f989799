"""Multi-LoRA terms on CUDA (layers.lora), in Triton, as Punica's BGMV: each token multiplies by
its own adapter slot only, read from a device tensor of slots (-1: no adapter), so the step
needs no host-side layout and a CUDA graph replays it with the slots of any batch.

One launch per linear: program (token, split) computes, for each part of the linear (q / k / v,
gate / up), h = A_part[slot] x[token] (R values, float32), then adds h B^T_part[slot] to the
output columns of the part that fall to its split (blocks split, split + SPLITS, ...), in
place. Each split recomputes the small shrink (R x in) instead of passing h through memory
to a second launch: on a small model the step is bound by launches, not by these products.
A token without an adapter returns at once. The adapter weights are small (rank x width) and
shared by a slot's tokens through L2.

Imports triton at the top: import this module only on a CUDA device (layers.lora does). The
interpreter (TRITON_INTERPRET=1) runs it on CPU tensors for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128
BLOCK_N = 128
MAX_SPLITS = 4  # programs per token: more spread the columns, each repeating the shrink
MAX_PARTS = 3


@triton.jit
def _lora_kernel(x_ptr, a_ptr, slot_ptr, out_ptr, b0_ptr, b1_ptr, b2_ptr, n0, n1, n2, K, R,
                 stride_xm, stride_as, stride_om, PARTS: tl.constexpr, SPLITS: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # NOTE: token * stride may pass 2^31
    split = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        offs_r = tl.arange(0, BLOCK_R)
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = tl.arange(0, BLOCK_N)
        r_mask = offs_r < R
        first_column = 0
        for part in tl.static_range(PARTS):
            b_ptr = b0_ptr if part == 0 else (b1_ptr if part == 1 else b2_ptr)
            n = n0 if part == 0 else (n1 if part == 1 else n2)
            if split * BLOCK_N < n:
                # h = A_part[slot] x: rows part * R .. of the slot's A [P * R, K]
                a_ptrs = (a_ptr + slot * stride_as + (part * R + offs_r)[:, None] * K
                          + offs_k[None, :])
                x_ptrs = x_ptr + token * stride_xm + offs_k
                acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k_mask = offs_k < K - k0
                    x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
                    a = tl.load(a_ptrs, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
                    acc += a.to(tl.float32) * x[None, :]
                    a_ptrs += BLOCK_K
                    x_ptrs += BLOCK_K
                h = tl.sum(acc, axis=1)
                # out[token, part columns] += h B^T_part[slot] ([S, R, n] contiguous)
                b_rows = b_ptr + slot * R * n + offs_r[:, None] * n
                out_row = out_ptr + token * stride_om + first_column
                for n_start in range(split * BLOCK_N, n, SPLITS * BLOCK_N):
                    cols = n_start + offs_n
                    n_mask = cols < n
                    b = tl.load(b_rows + cols[None, :], mask=r_mask[:, None] & n_mask[None, :],
                                other=0.0)
                    term = tl.sum(h[:, None] * b.to(tl.float32), axis=0)
                    base = tl.load(out_row + cols, mask=n_mask, other=0.0).to(tl.float32)
                    tl.store(out_row + cols, (base + term).to(out_ptr.dtype.element_ty),
                             mask=n_mask)
            first_column += n


def lora_add(x: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor, a: torch.Tensor,
             b: list[torch.Tensor], offsets: list[int], rank: int) -> torch.Tensor:
    """out [T, O] += each token's adapter term, in place: x [T, K] (rows contiguous),
    token_slots [T] int32 (-1: none), a [S, P * rank, K], b[p] [S, rank, O_p] (B^T, scaled),
    part p's columns starting at offsets[p] (the parts side by side). Rows of x past
    token_slots (a graph's padding rows) take no adapter."""
    tokens, k = token_slots.numel(), x.shape[1]
    widths = [b_part.shape[2] for b_part in b]
    assert tokens <= x.shape[0] and x.stride(1) == out.stride(1) == 1 and a.is_contiguous()
    assert all(b_part.is_contiguous() for b_part in b) and 0 < len(b) <= MAX_PARTS
    assert offsets == [sum(widths[:p]) for p in range(len(b))]
    splits = min(MAX_SPLITS, triton.cdiv(max(widths), BLOCK_N))
    parts = b + [b[0]] * (MAX_PARTS - len(b))
    sizes = widths + [0] * (MAX_PARTS - len(b))
    _lora_kernel[(tokens, splits)](
        x, a, token_slots, out, *parts, *sizes, k, rank, x.stride(0), a.stride(0),
        out.stride(0), PARTS=len(b), SPLITS=splits, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_K=BLOCK_K, BLOCK_N=BLOCK_N)
    return out
