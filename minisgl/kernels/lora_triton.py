"""Multi-LoRA terms on CUDA (layers.lora), in Triton, as Punica's BGMV: each token multiplies by
its own adapter slot only, read from a device tensor of slots (-1: no adapter), so the step
needs no host-side layout and a CUDA graph replays it with the slots of any batch.

- shrink: h[t] = A[slot[t]] x[t], [P * R] per token (every part's R rows), float32;
- expand: out[t, part columns] += h[t, part rows] B^T[slot[t]], per part, in place.
One program per (token, block of outputs); a token without an adapter returns at once. The
adapter weights are small (rank x width) and shared by a slot's tokens through L2.

Imports triton at the top: import this module only on a CUDA device (layers.lora does). The
interpreter (TRITON_INTERPRET=1) runs it on CPU tensors for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128
BLOCK_OUT = 128


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, h_ptr, N, K, stride_xm, stride_as, stride_an,
                   stride_hm, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # NOTE: token * stride may pass 2^31
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + slot * stride_as + offs_n[:, None] * stride_an + offs_k[None, :]
        x_ptrs = x_ptr + token * stride_xm + offs_k
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(a_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += a.to(tl.float32) * x[None, :]
            a_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        tl.store(h_ptr + token * stride_hm + offs_n, tl.sum(acc, axis=1), mask=n_mask)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, slot_ptr, out_ptr, N, R, stride_hm, stride_bs, stride_br,
                   stride_om, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_r = tl.arange(0, BLOCK_R)
        n_mask, r_mask = offs_n < N, offs_r < R
        h = tl.load(h_ptr + token * stride_hm + offs_r, mask=r_mask, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        term = tl.sum(h[:, None] * b.to(tl.float32), axis=0)
        out_ptrs = out_ptr + token * stride_om + offs_n
        base = tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptrs, (base + term).to(out_ptr.dtype.element_ty), mask=n_mask)


def lora_add(x: torch.Tensor, out: torch.Tensor, token_slots: torch.Tensor, a: torch.Tensor,
             b: list[torch.Tensor], offsets: list[int], rank: int) -> torch.Tensor:
    """out [T, O] += each token's adapter term, in place: x [T, K] (rows contiguous),
    token_slots [T] int32 (-1: none), a [S, P * rank, K], b[p] [S, rank, O_p] (B^T, scaled),
    part p's columns starting at offsets[p]. Rows of x past token_slots (a graph's padding
    rows) take no adapter."""
    tokens, k = token_slots.numel(), x.shape[1]
    assert tokens <= x.shape[0] and x.stride(1) == out.stride(1) == a.stride(2) == 1
    assert all(b_part.stride(2) == 1 for b_part in b)
    n = a.shape[1]
    h = torch.empty((tokens, n), dtype=torch.float32, device=x.device)
    block_n = min(triton.next_power_of_2(n), 64)
    _shrink_kernel[(tokens, triton.cdiv(n, block_n))](
        x, a, token_slots, h, n, k, x.stride(0), a.stride(0), a.stride(1), h.stride(0),
        BLOCK_N=block_n, BLOCK_K=BLOCK_K)
    for part, (b_part, offset) in enumerate(zip(b, offsets)):
        size = b_part.shape[2]
        _expand_kernel[(tokens, triton.cdiv(size, BLOCK_OUT))](
            h[:, part * rank:], b_part, token_slots, out[:, offset:], size, rank, h.stride(0),
            b_part.stride(0), b_part.stride(1), out.stride(0),
            BLOCK_R=triton.next_power_of_2(rank), BLOCK_N=BLOCK_OUT)
    return out
