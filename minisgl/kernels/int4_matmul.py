"""x @ w.T for int4 weights in groups along the inputs (AWQ, GPTQ and compressed-tensors
checkpoints, layers.int4_gpu), in Triton: w[n, k] = (q - z[n, g]) * s[n, g], g = k // GROUP,
with the codes q packed 8 to an int32 word along the inputs (code j of word i: input 8 i + j,
bits 4 j .. 4 j + 3), float16 scales s and uint8 zero points z per (output, group).

The matmul kernel's two inner loops, chosen per launch by the autotuner as in fp8_matmul;
each loads a weight word once:
- 16- to 64-row tiles through tensor cores (`DOT`): the codes unpacked to a [BLOCK_N, BLOCK_K]
  tile of the integers q - z (exact in bfloat16 / float16), its product scaled in float32 after
  it; a tile never spans two groups (the configs are pruned to BLOCK_K dividing GROUP, or one
  group per row), so it takes one scale and zero point per output.
- a GEMV of one row per program: the activations split in registers into the 8 columns a word's
  codes meet, each code made a float by its bits (no int -> float conversion, the issue rate
  that bounds this loop), the scale applied once per word.
Above the layer's row limit, `int4_dequantize` widens the weight for cuBLAS in one pass (each
value rounded once to the activations' dtype).

Imports triton at the top: import this module only on a CUDA device (layers.int4_gpu does).
The interpreter (TRITON_INTERPRET=1) runs it on CPU tensors for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernels.fp8_matmul import _bench, matmul_launch

CODES_PER_WORD = 8


def _configs() -> list[triton.Config]:
    gemv = ((4, 1024, 4, 3), (8, 256, 2, 3), (8, 512, 4, 3), (8, 1024, 4, 2), (16, 256, 4, 3),
            (16, 512, 4, 3), (16, 1024, 8, 3), (32, 256, 4, 3), (32, 512, 8, 3), (64, 128, 4, 3))
    tiles = ((16, 64, 32, 4, 4), (16, 64, 64, 4, 4), (16, 128, 64, 4, 3), (16, 64, 128, 4, 3),
             (16, 128, 128, 8, 3), (32, 64, 32, 4, 3), (32, 64, 128, 4, 3), (64, 64, 32, 4, 3),
             (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 128, 8, 3))
    return ([triton.Config({"BLOCK_M": 1, "BLOCK_N": n, "BLOCK_K": k, "DOT": False},
                           num_warps=w, num_stages=s) for n, k, w, s in gemv]
            + [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "DOT": True},
                             num_warps=w, num_stages=s) for m, n, k, w, s in tiles])


def tile_fits_group(block_k: int, group: int, k: int) -> bool:
    """Whether every K tile lies in one group: BLOCK_K divides the group size, or the whole
    row is one group."""
    return group == k or group % block_k == 0


def _prune(configs: list[triton.Config], named_args: dict, **_: object) -> list[triton.Config]:
    """The GEMV (any BLOCK_K: it takes a scale per word) for up to 4 rows, alone for one row
    (where every tile loses to it, so tiles there only let the autotuner pick wrong: BENCHMARKS
    "GPU (H100 / H200)"); tiles of up to the row bucket's rows (16 at least) that fit the
    groups (groups are multiples of 32 inputs or whole rows, so the 32-input tiles always do)."""
    group, k, bucket = named_args["GROUP"], named_args["K"], named_args["M_BUCKET"]
    return [c for c in configs if (bucket <= 4 if not c.kwargs["DOT"] else
                                   bucket > 1 and c.kwargs["BLOCK_M"] <= max(16, bucket)
                                   and tile_fits_group(c.kwargs["BLOCK_K"], group, k))]


@triton.jit
def _nibble(words, j: tl.constexpr, zero, x_j):
    """(q_j - z) x_j for code j of each word, [BLOCK_N, words]: the code becomes a float by
    its bits (2^23 + q as float32), no int -> float conversion; `zero` is z + 2^23."""
    bits = ((words >> (4 * j)) & 0xF) | 0x4B000000
    return (bits.to(tl.float32, bitcast=True) - zero) * x_j[None, :]


@triton.autotune(configs=_configs(), key=["N", "K", "M_BUCKET", "GROUP"],
                 prune_configs_by={"early_config_prune": _prune}, do_bench=_bench)
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _int4_matmul_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, M_BUCKET,
                        stride_xm, stride_wn, stride_sn, stride_om, GROUP: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT: tl.constexpr, EVEN_K: tl.constexpr):
    WORDS: tl.constexpr = BLOCK_K // 8
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, WORDS)
    n_mask = offs_n < N
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_w[None, :]  # [N, WORDS], each word once
    group_ptrs = offs_n * stride_sn
    if DOT:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        m_mask = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        shifts = tl.arange(0, 8) * 4
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
                words = tl.load(w_ptrs, mask=n_mask[:, None], other=0)
            else:
                x = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k < K - k0)[None, :], other=0.0)
                words = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_w < (K - k0) // 8)[None, :],
                                other=0)
            g = k0 // GROUP
            scale = tl.load(scale_ptr + group_ptrs + g, mask=n_mask, other=0.0).to(tl.float32)
            zero = tl.load(zero_ptr + group_ptrs + g, mask=n_mask, other=0).to(tl.float32)
            bits = ((words[:, :, None] >> shifts[None, None, :]) & 0xF) | 0x4B000000
            q = bits.to(tl.float32, bitcast=True) - (zero + 8388608.0)[:, None, None]
            w = tl.reshape(q, (BLOCK_N, BLOCK_K)).to(x.dtype)  # input 8 i + j; exact integers
            acc += tl.dot(x, tl.trans(w)) * scale[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += WORDS
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])
    else:  # one row per program; the [BLOCK_N, WORDS] partial sums reduced once at the end
        x_ptrs = x_ptr + pid_m * stride_xm + offs_w[:, None] * 8 + tl.arange(0, 8)[None, :]
        acc = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs).to(tl.float32)
                words = tl.load(w_ptrs, mask=n_mask[:, None], other=0)
            else:
                w_mask = offs_w < (K - k0) // 8
                x = tl.load(x_ptrs, mask=w_mask[:, None], other=0.0).to(tl.float32)
                words = tl.load(w_ptrs, mask=n_mask[:, None] & w_mask[None, :], other=0)
            if GROUP % BLOCK_K == 0:  # the tile in one group
                g = k0 // GROUP
                scale = tl.load(scale_ptr + group_ptrs + g, mask=n_mask, other=0.0)[:, None]
                zero = tl.load(zero_ptr + group_ptrs + g, mask=n_mask, other=0)[:, None]
            else:  # each word's group
                g = tl.minimum((k0 + offs_w * 8) // GROUP, (K - 1) // GROUP)[None, :]
                scale = tl.load(scale_ptr + group_ptrs[:, None] + g, mask=n_mask[:, None],
                                other=0.0)
                zero = tl.load(zero_ptr + group_ptrs[:, None] + g, mask=n_mask[:, None], other=0)
            zero = zero.to(tl.float32) + 8388608.0
            # x [WORDS, 8] -> its 8 columns (input 8 i + j), split in registers
            x_even, x_odd = tl.split(tl.reshape(x, (WORDS, 4, 2)))
            x04, x26 = tl.split(tl.reshape(x_even, (WORDS, 2, 2)))
            x15, x37 = tl.split(tl.reshape(x_odd, (WORDS, 2, 2)))
            x0, x4 = tl.split(x04)
            x2, x6 = tl.split(x26)
            x1, x5 = tl.split(x15)
            x3, x7 = tl.split(x37)
            part = (_nibble(words, 0, zero, x0) + _nibble(words, 1, zero, x1)
                    + _nibble(words, 2, zero, x2) + _nibble(words, 3, zero, x3)
                    + _nibble(words, 4, zero, x4) + _nibble(words, 5, zero, x5)
                    + _nibble(words, 6, zero, x6) + _nibble(words, 7, zero, x7))
            acc += part * scale.to(tl.float32)
            x_ptrs += BLOCK_K
            w_ptrs += WORDS
        tl.store(out_ptr + pid_m * stride_om + offs_n,
                 tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_mask)


def int4_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                ) -> torch.Tensor:
    """x [M, K] (bfloat16 / float16, rows contiguous) @ w.T, w encoded by words [N, K / 8]
    int32, scales [N, K / G] float16 and zeros [N, K / G] uint8: [M, N] in x's dtype."""
    m, k = x.shape
    n = words.shape[0]
    out, bucket, grid = matmul_launch(x, n)
    _int4_matmul_kernel[grid](x, words, scales, zeros, out, m, n, k, bucket, x.stride(0),
                              words.stride(0), scales.stride(0), out.stride(0),
                              k // scales.shape[1])
    return out


@triton.jit
def _int4_dequantize_kernel(w_ptr, scale_ptr, zero_ptr, out_ptr, K, GROUP, stride_sn,
                            BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # NOTE: row * K may pass 2^31
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = offs < K
    words = tl.load(w_ptr + row * (K // 8) + offs // 8, mask=mask, other=0)
    g = offs // GROUP
    scale = tl.load(scale_ptr + row * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(zero_ptr + row * stride_sn + g, mask=mask, other=0).to(tl.int32)
    q = ((words >> ((offs % 8) * 4)) & 0xF) - zero
    tl.store(out_ptr + row * K + offs, (q.to(tl.float32) * scale).to(out_ptr.dtype.element_ty),
             mask=mask)


def int4_dequantize(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` (a temporary: prefill's GEMM input)."""
    n, k = words.shape[0], words.shape[1] * CODES_PER_WORD
    out = torch.empty((n, k), dtype=dtype, device=words.device)
    block = 2048
    _int4_dequantize_kernel[(n, triton.cdiv(k, block))](words, scales, zeros, out, k,
                                                        k // scales.shape[1], scales.stride(0),
                                                        BLOCK_K=block)
    return out
