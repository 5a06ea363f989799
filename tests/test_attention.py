"""The compiled CPU decode-attention kernel against the plain torch path, on ragged batches."""

from __future__ import annotations

import pytest
import torch

from minisgl.kernels import cpu_kernels
from minisgl.attention.torch_backend import TorchBackend
from minisgl.core import Batch
from minisgl.kvcache import KVLayout, KVPool


def float64_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   page_table: torch.Tensor, seq_lens: list[int], scale: float,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v per request and query head, in float64; with `sinks`, each
    head's sink logit joins its softmax and is dropped from it."""
    group = q.shape[1] // k_cache.shape[0]
    out = torch.empty(q.shape, dtype=torch.float64)
    for row, length in enumerate(seq_lens):
        where = page_table[row, :length].long()
        k = k_cache[:, where].double().repeat_interleave(group, 0)  # [heads, length, dim]
        v = v_cache[:, where].double().repeat_interleave(group, 0)
        scores = torch.einsum("hd,htd->ht", q[row].double(), k) * scale
        if sinks is not None:
            scores = torch.cat((scores, sinks.double()[:, None]), dim=-1)
        weights = scores.softmax(-1)[:, :length]
        out[row] = torch.einsum("ht,htd->hd", weights, v)
    return out


# NOTE: the bfloat16 bound is the output's own rounding (8 bits: |out| < 4 here, so < 2 ** -6)
# plus float32 sums; the float32 one is float32 sums over <= 80 tokens.
@pytest.mark.parametrize("sinks", [False, True])  # gpt-oss's attention sinks
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("heads,kv_heads,dim", [
    (9, 3, 64),    # SmolLM2 (bfloat16: the vectorised path)
    (14, 2, 64),   # a group of 7: two chunks of query heads in the value pass
    (6, 6, 64),    # no grouping
    (16, 2, 128),  # Llama / Qwen head dim
    (12, 4, 96),   # a head dim with no vectorised path: the generic loop
])
def test_kernel_matches_float64_decode(dtype: torch.dtype, tolerance: float, heads: int,
                                       kv_heads: int, dim: int, sinks: bool) -> None:
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler here: the kernel falls back to torch ops")
    gen = torch.Generator().manual_seed(0)
    batch, context, locations = 7, 80, 600
    pool = KVPool(KVLayout.uniform(1, kv_heads, dim), num_pages=locations, page_size=1,
                  dtype=dtype, device=torch.device("cpu"))
    pool.buffer[:, :, :, :locations].copy_(
        torch.randn(2, 1, kv_heads, locations, dim, generator=gen))
    page_table = torch.zeros(batch + 1, context, dtype=torch.int32)
    seq_lens = [1, 5, 16, 17, 80, 33, 64]  # around the 16-token score tiles
    for row, length in enumerate(seq_lens):  # scattered, shuffled locations
        page_table[row, :length] = torch.randperm(locations, generator=gen)[:length].int()
    last = torch.tensor([page_table[row, n - 1].item() for row, n in enumerate(seq_lens)])
    k_cache, v_cache = pool.layer(0)
    # the step's own k / v are what the pool holds at its last location (stored again as is)
    k, v = k_cache[:, last].transpose(0, 1), v_cache[:, last].transpose(0, 1)
    q = torch.randn(batch, heads, dim, generator=gen).to(dtype)
    # sink logits around the scores' own range, so each takes a real share of some softmax
    sink = torch.randn(heads, generator=gen) * 2 + 1 if sinks else None
    outputs = []
    for kernels in (cpu_kernels(), None):
        backend = TorchBackend(pool, page_table, dim ** -0.5)
        backend.kernels = kernels
        batch_ = Batch("decode", batch, table_rows=list(range(batch)),
                       cached_lens=[n - 1 for n in seq_lens], seq_lens=seq_lens,
                       extend_lens=[1] * batch, input_positions=torch.tensor(seq_lens) - 1,
                       out_loc=last)
        backend.prepare_metadata(batch_)
        outputs.append(backend.forward(q, k, v, 0, batch_, sink))
    fast, slow = outputs
    exact = float64_decode(q, k_cache, v_cache, page_table, seq_lens, dim ** -0.5, sink)
    exact = exact.view(fast.shape)
    assert (fast.double() - exact).abs().max().item() < tolerance
    assert (slow.double() - exact).abs().max().item() < 2 * tolerance  # the torch path too


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


@pytest.mark.parametrize("tokens", [1, 64, 700])  # 700: split across threads
def test_store_kv_kernel_matches_pool_store(tokens: int) -> None:
    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler here: the pool's index_copy_ stores K and V")
    gen = torch.Generator().manual_seed(0)
    kv_heads, dim = 3, 64
    pools = [KVPool(KVLayout.uniform(2, kv_heads, dim), num_pages=1000, page_size=1,
                    dtype=torch.bfloat16, device=torch.device("cpu")) for _ in range(2)]
    for pool in pools:
        pool.buffer.zero_()
    qkv = torch.randn(tokens, (9 + 2 * kv_heads) * dim, generator=gen).bfloat16()
    k = qkv[:, 9 * dim:12 * dim].view(tokens, kv_heads, dim)  # strided views, as in the model
    v = qkv[:, 12 * dim:].view(tokens, kv_heads, dim)
    locations = torch.randperm(1000, generator=gen)[:tokens]
    pools[0].store(1, locations, k, v)
    kernels.store_kv_(*pools[1].layer(1), locations, k, v)
    assert torch.equal(pools[0].buffer, pools[1].buffer)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.store_kv_(*pools[1].layer(1), torch.full((tokens,), 1001), k, v)


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
def test_kernel_prefill_and_mixed_batch_match_float64(dtype: torch.dtype,
                                                      tolerance: float) -> None:
    """A mixed batch through the kernel (one call: each token over its row's first position + 1
    locations): a prompt, a prompt after a cached prefix, a long prompt, one decode row."""
    if cpu_kernels() is None:
        pytest.skip("no C++ compiler here: SDPA runs prefill")
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, locations = 9, 3, 64, 900
    pool = KVPool(KVLayout.uniform(1, kv_heads, dim), num_pages=locations, page_size=1,
                  dtype=dtype, device=torch.device("cpu"))
    pool.buffer[:, :, :, :locations].copy_(
        torch.randn(2, 1, kv_heads, locations, dim, generator=gen))
    cached, new = [0, 13, 0, 40], [20, 7, 300, 1]  # the last row decodes
    seq_lens = [c + n for c, n in zip(cached, new)]
    page_table = torch.zeros(len(new) + 1, max(seq_lens), dtype=torch.int32)
    scattered = torch.randperm(locations, generator=gen)
    start = 0
    for row, length in enumerate(seq_lens):
        page_table[row, :length] = scattered[start:start + length].int()
        start += length
    tokens = sum(new)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(cached, new)])
    out_loc = torch.cat([page_table[row, c:c + n].long()
                         for row, (c, n) in enumerate(zip(cached, new))])
    batch = Batch("prefill", len(new), table_rows=list(range(len(new))), cached_lens=cached,
                  seq_lens=seq_lens, extend_lens=new, input_positions=positions,
                  out_loc=out_loc, decode_rows=1)
    backend = TorchBackend(pool, page_table, dim ** -0.5)
    backend.prepare_metadata(batch)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    out = backend.forward(q, k, v, 0, batch).view(tokens, heads, dim)
    k_cache, v_cache = pool.layer(0)
    token = 0
    for row, (c, n) in enumerate(zip(cached, new)):
        for i in range(n):  # causality: the row's first c + i + 1 locations
            exact = float64_decode(q[token:token + 1], k_cache, v_cache,
                                   page_table[row:row + 1], [c + i + 1], dim ** -0.5)
            assert (out[token].double() - exact[0]).abs().max().item() < tolerance
            token += 1
