"""x @ w.T for int4 weights in groups along the inputs (AWQ, GPTQ and compressed-tensors
checkpoints, layers.int4_gpu), in Triton: w[n, k] = (q - z[n, g]) * s[n, g], g = k // GROUP,
with the codes q packed 8 to an int32 word along the inputs (code j of word i: input 8 i + j,
bits 4 j .. 4 j + 3), float16 scales s and uint8 zero points z per (output, group).

The matmul kernel's two inner loops, chosen per launch by the autotuner as in fp8_matmul:
16-row tiles through tensor cores (`DOT`), or a GEMV of one row per program. A tile never
spans two groups (the configs are pruned to BLOCK_K dividing GROUP, or one group per row), so
a tile takes one scale and zero point per output. The tensor-core product is of the integers
q - z (exact in bfloat16 / float16) and is scaled in float32 after it: the weights enter
exactly. Above the layer's row limit, `int4_dequantize` widens the weight for cuBLAS in one
pass (each value rounded once to the activations' dtype).

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
    gemv = ((8, 128, 4, 4), (16, 128, 4, 4), (32, 128, 4, 3), (64, 128, 4, 3),
            (32, 64, 4, 4), (64, 64, 4, 3), (128, 32, 4, 4), (256, 32, 8, 3))
    tiles = ((32, 128, 4, 4), (64, 128, 4, 3), (64, 64, 4, 4), (128, 32, 4, 4))
    return ([triton.Config({"BLOCK_M": 1, "BLOCK_N": n, "BLOCK_K": k, "DOT": False},
                           num_warps=w, num_stages=s) for n, k, w, s in gemv]
            + [triton.Config({"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": k, "DOT": True},
                             num_warps=w, num_stages=s) for n, k, w, s in tiles])


def tile_fits_group(block_k: int, group: int, k: int) -> bool:
    """Whether every K tile lies in one group: BLOCK_K divides the group size, or the whole
    row is one group."""
    return group == k or group % block_k == 0


def _prune(configs: list[triton.Config], named_args: dict, **_: object) -> list[triton.Config]:
    """As fp8_matmul's (the GEMV for up to 4 rows), keeping the tiles that fit the groups."""
    group, k = named_args["GROUP"], named_args["K"]
    return [c for c in configs if (c.kwargs["DOT"] or named_args["M_BUCKET"] <= 4)
            and tile_fits_group(c.kwargs["BLOCK_K"], group, k)]


@triton.autotune(configs=_configs(), key=["N", "K", "M_BUCKET", "GROUP"],
                 prune_configs_by={"early_config_prune": _prune}, do_bench=_bench)
@triton.jit
def _int4_matmul_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, M_BUCKET, GROUP,
                        stride_xm, stride_wn, stride_sn, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        DOT: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    shifts = (offs_k % 8) * 4
    group_ptrs = offs_n * stride_sn
    if DOT:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + (offs_k // 8)[:, None]  # [BLOCK_K, N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            words = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0)
            g = k0 // GROUP
            scale = tl.load(scale_ptr + group_ptrs + g, mask=n_mask, other=0.0).to(tl.float32)
            zero = tl.load(zero_ptr + group_ptrs + g, mask=n_mask, other=0).to(tl.int32)
            q = ((words >> shifts[:, None]) & 0xF) - zero[None, :]
            acc += tl.dot(x, q.to(x.dtype)) * scale[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K // 8
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])
    else:
        x_ptrs = x_ptr + pid_m * stride_xm + offs_k
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (offs_k // 8)[None, :]  # [N, BLOCK_K]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            words = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0)
            g = k0 // GROUP
            scale = tl.load(scale_ptr + group_ptrs + g, mask=n_mask, other=0.0).to(tl.float32)
            zero = tl.load(zero_ptr + group_ptrs + g, mask=n_mask, other=0).to(tl.int32)
            q = (((words >> shifts[None, :]) & 0xF) - zero[:, None]).to(tl.float32)
            acc += q * scale[:, None] * x[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K // 8
        tl.store(out_ptr + pid_m * stride_om + offs_n,
                 tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=n_mask)


def int4_matmul(x: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                ) -> torch.Tensor:
    """x [M, K] (bfloat16 / float16, rows contiguous) @ w.T, w encoded by words [N, K / 8]
    int32, scales [N, K / G] float16 and zeros [N, K / G] uint8: [M, N] in x's dtype."""
    m, k = x.shape
    n = words.shape[0]
    out, bucket, grid = matmul_launch(x, n)
    _int4_matmul_kernel[grid](x, words, scales, zeros, out, m, n, k, bucket,
                              k // scales.shape[1], x.stride(0), words.stride(0),
                              scales.stride(0), out.stride(0))
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
