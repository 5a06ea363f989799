"""The compiled CPU decode-attention kernel against the plain torch path, on ragged batches."""

from __future__ import annotations

import pytest
import torch

from minisgl.kernels import cpu_kernels
from minisgl.attention.torch_backend import TorchBackend
from minisgl.core import Batch
from minisgl.kvcache import KVPool


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kernel_matches_torch_decode(dtype: torch.dtype, tolerance: float) -> None:
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler here: the kernel falls back to torch ops")
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, batch, context = 9, 3, 64, 6, 80
    pool = KVPool(1, num_pages=600, page_size=1, num_kv_heads=kv_heads, head_dim=dim,
                  dtype=dtype, device=torch.device("cpu"))
    pool.buffer[:, :, :, :600].copy_(torch.randn(2, 1, kv_heads, 600, dim, generator=gen))
    page_table = torch.zeros(batch + 1, context, dtype=torch.int32)
    seq_lens = [1, 5, 17, 80, 33, 64]
    for row, length in enumerate(seq_lens):  # scattered, shuffled locations
        page_table[row, :length] = torch.randperm(600, generator=gen)[:length].int()
    batch_ = Batch("decode", batch, table_rows=list(range(batch)),
                   cached_lens=[n - 1 for n in seq_lens], seq_lens=seq_lens,
                   extend_lens=[1] * batch)
    with_kernel = TorchBackend(pool, page_table, dim ** -0.5)
    without = TorchBackend(pool, page_table, dim ** -0.5)
    without.kernels = None
    with_kernel.prepare_metadata(batch_)
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    k_cache, v_cache = pool.layer(0)
    fast = with_kernel._decode(q, k_cache, v_cache, batch_.attn_metadata)
    slow = without._decode(q, k_cache, v_cache, batch_.attn_metadata)
    assert (fast.float() - slow.float()).abs().max().item() < tolerance


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_rms_norm_kernel_matches_torch(dtype: torch.dtype, tolerance: float) -> None:
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler here: RMSNorm falls back to torch ops")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=gen).to(dtype)
    residual = torch.randn(37, 576, generator=gen).to(dtype)
    weight = (1 + torch.randn(576, generator=gen) * 0.1).to(dtype)
    expected_carry = x + residual
    expected = torch.nn.functional.rms_norm(expected_carry.float(), (576,), weight.float(), 1e-5)
    normed, carry = kernels.rms_norm(x, residual.clone(), weight, 1e-5)
    assert torch.equal(carry, expected_carry)
    assert (normed.float() - expected).abs().max().item() < tolerance
    plain, same = kernels.rms_norm(x, None, weight, 1e-5)
    assert same is x or torch.equal(same, x)
    reference = torch.nn.functional.rms_norm(x.float(), (576,), weight.float(), 1e-5)
    assert (plain.float() - reference).abs().max().item() < tolerance
