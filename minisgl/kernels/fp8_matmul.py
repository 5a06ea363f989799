"""x @ (codes * scales).T for float8 (e4m3) weights with one float32 scale per output feature
(`--quantization fp8`, layers.fp8), or per output feature and block of SCALE_GROUP inputs (a
block-wise fp8 checkpoint's 128 x 128 scales, expanded to the rows), in Triton: the weight is
read as 1 byte per value and widened in registers, so a decode step moves half the bytes of
bfloat16 weights.

One matmul kernel, two inner loops chosen per launch by the autotuner (keyed on the output and input
widths and the row count rounded up to a power of two):
- `DOT`: tiles of 16 rows through tensor cores (tl.dot on the widened weight tile), for any
  row count (the layer sends it at most KERNEL_MAX_ROWS, above which cuBLAS on bf16 weights
  is faster: BENCHMARKS.md, "GPU (H100 / H200)");
- a GEMV, one row per program: each keeps a [BLOCK_N, BLOCK_K] float32 partial product and
  reduces it once at the end, without padding the row to a 16-row tile.
The float32 accumulator is scaled per output feature once, after the K loop; with block
scales each tensor-core tile's product is scaled as it is added (those configs are pruned to
tiles within one block), and the GEMV scales each weight by its block's, so its tiles may span
blocks (the long K tiles a one-row product needs to keep enough bytes in flight). Above the
layer's row limit (prefill), `fp8_dequantize` widens the weight for cuBLAS in one pass.

Imports triton at the top: import this module only on a CUDA device (layers.fp8 does). The
interpreter (TRITON_INTERPRET=1) runs it on CPU tensors for tests.
"""

from __future__ import annotations

from typing import Callable

import torch
import triton
import triton.language as tl
import triton.testing

MAX_TUNED_ROWS = 256  # row counts above this share one autotuning key


def _configs() -> list[triton.Config]:
    gemv = ((4, 1024, 4, 4), (8, 512, 4, 3), (8, 1024, 4, 3), (16, 256, 4, 4), (16, 512, 4, 3),
            (16, 512, 8, 4), (32, 256, 4, 3), (32, 512, 8, 3), (64, 256, 8, 3),
            (16, 128, 4, 4), (32, 128, 4, 3), (64, 128, 4, 3), (128, 128, 8, 3))
    tiles = ((32, 256, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3))
    return ([triton.Config({"BLOCK_M": 1, "BLOCK_N": n, "BLOCK_K": k, "DOT": False},
                           num_warps=w, num_stages=s) for n, k, w, s in gemv]
            + [triton.Config({"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": k, "DOT": True},
                             num_warps=w, num_stages=s) for n, k, w, s in tiles])


def _prune(configs: list[triton.Config], named_args: dict, **_: object) -> list[triton.Config]:
    """The GEMV (one row per program) competes for up to 4 rows; 16-row tensor-core tiles for
    any count (the row tiles of one weight tile run side by side and share it through L2).
    With block scales, only tensor-core tiles within one block (the GEMV scales each input)."""
    group = named_args["SCALE_GROUP"]
    return [c for c in configs if (c.kwargs["DOT"] or named_args["M_BUCKET"] <= 4)
            and (group == 0 or group % c.kwargs["BLOCK_K"] == 0 or not c.kwargs["DOT"])]


def _bench(fn: Callable[[], object], quantiles: list[float]) -> list[float]:
    """Shorter than Triton's default (25 / 100 ms): every key is tuned at engine start."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


@triton.autotune(configs=_configs(), key=["N", "K", "M_BUCKET", "SCALE_GROUP"],
                 prune_configs_by={"early_config_prune": _prune}, do_bench=_bench)
@triton.jit
def _fp8_matmul_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, M_BUCKET,
                       stride_xm, stride_wn, stride_om, stride_sn, SCALE_GROUP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       DOT: tl.constexpr):
    pid_m = tl.program_id(0)  # NOTE: fastest: the row tiles of one weight tile run together
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    scale_ptrs = scale_ptr + offs_n * stride_sn
    if SCALE_GROUP == 0:
        scale = tl.load(scale_ptrs, mask=n_mask, other=0.0)
    else:
        scale = tl.full((BLOCK_N,), 1.0, dtype=tl.float32)
    if DOT:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[None, :] & k_mask[:, None], other=0.0)
            if SCALE_GROUP == 0:
                acc = tl.dot(x, w.to(x.dtype), acc)
            else:
                block = tl.load(scale_ptrs + k0 // SCALE_GROUP, mask=n_mask, other=0.0)
                acc += tl.dot(x, w.to(x.dtype)) * block[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out = acc * scale[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])
    else:
        x_ptrs = x_ptr + pid_m * stride_xm + offs_k
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            if SCALE_GROUP != 0 and SCALE_GROUP % BLOCK_K == 0:
                w *= tl.load(scale_ptrs + k0 // SCALE_GROUP, mask=n_mask, other=0.0)[:, None]
            elif SCALE_GROUP != 0:  # the tile spans blocks: each input's block scale
                blocks = tl.minimum((k0 + offs_k) // SCALE_GROUP, (K - 1) // SCALE_GROUP)
                w *= tl.load(scale_ptrs[:, None] + blocks[None, :], mask=n_mask[:, None],
                             other=0.0)
            acc += w * x[None, :]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out = tl.sum(acc, axis=1) * scale
        tl.store(out_ptr + pid_m * stride_om + offs_n, out.to(out_ptr.dtype.element_ty),
                 mask=n_mask)


def fp8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
               scale_group: int = 0) -> torch.Tensor:
    """x [M, K] (bfloat16 / float16, rows contiguous) @ codes [N, K] (float8_e4m3fn).T, each
    output column times its float32 scale (scales [N]), or each product of a block of
    `scale_group` inputs times the block's (scales [N, ceil(K / scale_group)]): [M, N] in x's
    dtype."""
    m, k = x.shape
    n = codes.shape[0]
    out, bucket, grid = matmul_launch(x, n)
    _fp8_matmul_kernel[grid](x, codes, scales, out, m, n, k, bucket, x.stride(0),
                             codes.stride(0), out.stride(0), scales.stride(0), scale_group)
    return out


def matmul_launch(x: torch.Tensor, n: int) -> tuple[torch.Tensor, int, Callable]:
    """For an autotuned matmul kernel of x [M, K] by N outputs (this one's and
    int4_matmul's): the output [M, N], the row bucket of its tuning key and its grid."""
    m = x.shape[0]

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"])

    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    return out, min(triton.next_power_of_2(m), MAX_TUNED_ROWS), grid


@triton.jit
def _fp8_dequantize_kernel(w_ptr, scale_ptr, out_ptr, K, stride_sn,
                           SCALE_GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # NOTE: row * K may pass 2^31
    offs = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = offs < K
    if SCALE_GROUP == 0:
        scale = tl.load(scale_ptr + row * stride_sn)
    else:
        scale = tl.load(scale_ptr + row * stride_sn + offs // SCALE_GROUP, mask=mask, other=0.0)
    w = tl.load(w_ptr + row * K + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * K + offs, (w.to(tl.float32) * scale).to(out_ptr.dtype.element_ty),
             mask=mask)


def fp8_dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                   scale_group: int = 0) -> torch.Tensor:
    """codes [N, K] (contiguous) times their scales (as fp8_matmul's) in `dtype`, one pass
    (torch's float8 conversion alone runs at a third of the bandwidth)."""
    n, k = codes.shape
    out = torch.empty((n, k), dtype=dtype, device=codes.device)
    block = 2048
    _fp8_dequantize_kernel[(n, triton.cdiv(k, block))](codes, scales, out, k, scales.stride(0),
                                                       SCALE_GROUP=scale_group, BLOCK_K=block)
    return out
