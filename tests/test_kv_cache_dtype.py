"""`--kv-cache-dtype`: 8-bit KV pages. int8 pages keep a float32 scale per token and head (the
row's largest magnitude maps to 127); float8 pages (e4m3 / e5m2) keep the values saturated.
References: attention in float32 over the K/V before they were stored (the kernels' bound is
what 8 bits cost), transformers in float32 (the models' bound: each greedy token's reference
logit within a margin of the reference's best, teacher-forced on our own tokens).

The errors and perplexities measured against these bounds: BENCHMARKS.md, "8-bit KV pages"."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from minisgl import LLM
from minisgl.engine import Engine, EngineConfig
from minisgl.kernels import cpu_kernels
from minisgl.kvcache import KVLayout, KVPool
from minisgl.kvcache.pool import quantize_rows
from tests import reference as ref
from tests.engine_probe import prefill_logits
from tests.lora_fixtures import assert_within_margin_of_merged, save_adapter, save_base
from tests.test_deepseek import save_deepseek
from tests.test_model import TINY
from tests.test_model_configs import WINDOW, save_tiny
from tests.test_quantization import PERPLEXITY_REL_BOUND, TEXT, perplexity

KERNEL_BOUNDS = {torch.int8: 0.02, torch.float8_e4m3fn: 0.06, torch.float8_e5m2: 0.12}
# the kernel's output against float32 attention over the pages as stored: bfloat16 q and out
STORED_BOUND = 0.01
# logit units: how far below the reference's best a greedy token of a model with int8 pages
# may be (teacher-forced on our tokens); bfloat16 weights alone take up to 0.25 (test_quantization)
INT8_KV_MARGIN = 0.25

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="no CPU kernels")


def float_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: list[int],
                    scale: float) -> torch.Tensor:
    """q [tokens, heads, dim] over keys / values [kv_heads, len, dim] (every token's request),
    token i seeing the first lengths[i] keys; float32."""
    group = q.shape[1] // keys.shape[0]
    keys = keys.float().repeat_interleave(group, 0)
    values = values.float().repeat_interleave(group, 0)
    out = []
    for i, length in enumerate(lengths):
        scores = torch.einsum("hd,hld->hl", q[i].float() * scale, keys[:, :length])
        out.append(torch.einsum("hl,hld->hd", scores.softmax(-1), values[:, :length]))
    return torch.stack(out)


def stored_pages(cache_dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor, pool: int,
                 locations: torch.Tensor):
    """k / v [n, kv_heads, dim] stored by the kernel at `locations` of a pool of `pool`."""
    kv_heads, dim = k.shape[1], k.shape[2]
    k_cache = torch.zeros(kv_heads, pool, dim, dtype=cache_dtype)
    v_cache = torch.zeros(kv_heads, pool, dim, dtype=cache_dtype)
    scales = ((torch.zeros(kv_heads, pool), torch.zeros(kv_heads, pool))
              if cache_dtype == torch.int8 else (None, None))
    cpu_kernels().store_kv_(k_cache, v_cache, locations, k, v, *scales)
    return k_cache, v_cache, scales


def dequantized(cache: torch.Tensor, scales: torch.Tensor | None, locations: torch.Tensor
                ) -> torch.Tensor:
    rows = cache[:, locations].float()
    return rows if scales is None else rows * scales[:, locations, None]


@needs_kernels
@pytest.mark.parametrize("cache_dtype", list(KERNEL_BOUNDS), ids=str)
@pytest.mark.parametrize("dim", [64, 128, 80])  # 80: the generic loop, not the AVX-512 one
@pytest.mark.parametrize("length", [1, 17, 600])
@pytest.mark.parametrize("shape", ["decode", "prefill"])
def test_8bit_pages_against_float_attention(cache_dtype, dim: int, length: int, shape: str):
    """One request of `length` keys scattered over a pool: a decode token, or (prefill) its
    last 5 tokens at once, each seeing the keys up to itself."""
    gen = torch.Generator().manual_seed(length * dim)
    heads, kv_heads, pool = 9, 3, 1024
    k, v = (torch.randn(length, kv_heads, dim, generator=gen) for _ in range(2))
    locations = torch.randperm(pool, generator=gen)[:length]
    k_cache, v_cache, scales = stored_pages(cache_dtype, k.bfloat16(), v.bfloat16(), pool,
                                            locations)
    tokens = 1 if shape == "decode" else min(5, length)
    lengths = list(range(length - tokens + 1, length + 1))
    q = torch.randn(tokens, heads, dim, generator=gen).bfloat16()
    out = cpu_kernels().decode_attention(
        q, k_cache, v_cache, locations[None].long(), torch.tensor(lengths), dim**-0.5,
        token_rows=torch.zeros(tokens, dtype=torch.long), k_scales=scales[0],
        v_scales=scales[1]).float()
    want = float_attention(q, k.transpose(0, 1), v.transpose(0, 1), lengths, dim**-0.5)
    error = float((out - want).norm() / want.norm())
    assert error < KERNEL_BOUNDS[cache_dtype], error
    as_stored = float_attention(q, dequantized(k_cache, scales[0], locations),
                                dequantized(v_cache, scales[1], locations), lengths, dim**-0.5)
    assert float((out - as_stored).norm() / as_stored.norm()) < STORED_BOUND


@needs_kernels
@pytest.mark.parametrize("cache_dtype", list(KERNEL_BOUNDS), ids=str)
def test_the_kernels_store_and_the_pools_torch_store_agree(cache_dtype):
    """The CPU kernel's store and KVPool.store (the path without kernels, and CUDA's torch
    backend) write the same pages (int8: codes within one step of rounding), and gather
    reads them back in the compute dtype."""
    layout = KVLayout.uniform(2, 3, 64)
    pool = KVPool(layout, 8, 16, torch.bfloat16, torch.device("cpu"), cache_dtype)
    k, v = (torch.randn(20, 3, 64).bfloat16() * 3 for _ in range(2))
    locations = torch.randperm(128)[:20]
    pool.store(1, locations, k, v)
    k_cache, v_cache, scales = stored_pages(cache_dtype, k, v, pool.dummy_loc + 16, locations)
    assert (pool.layer(1)[0][:, locations].float() - k_cache[:, locations].float()
            ).abs().max() <= (1 if cache_dtype == torch.int8 else 0)
    keys, values = pool.gather(1, locations)
    assert keys.dtype == torch.bfloat16 and keys.shape == (3, 20, 64)
    bound = {torch.int8: 0.01, torch.float8_e4m3fn: 0.07, torch.float8_e5m2: 0.14}[cache_dtype]
    for x, read in ((k, keys), (v, values)):
        assert float((read.float() - x.transpose(0, 1).float()).norm() / x.float().norm()) < bound
    if cache_dtype == torch.int8:
        _, scale = quantize_rows(k.transpose(0, 1), torch.int8)
        assert torch.allclose(scale, scales[0][:, locations], rtol=1e-6)


def test_the_pool_holds_twice_the_tokens_in_8_bits():
    layout = KVLayout.uniform(30, 3, 64)
    assert layout.bytes_per_token(torch.float8_e4m3fn) * 2 == layout.bytes_per_token(
        torch.bfloat16)
    # int8: a float32 scale per 64 values
    assert layout.bytes_per_token(torch.bfloat16) / layout.bytes_per_token(torch.int8) == \
        pytest.approx(128 / 68)


@pytest.mark.parametrize("name, device, error", [
    ("int8", "cuda", "CPU's 8-bit KV format"),
    ("bfloat16", "cpu", "16-bit pages hold the compute dtype"),
])
def test_what_a_kv_cache_dtype_cannot_do_is_refused(name, device, error):
    from minisgl.engine.placement import resolve_kv_cache_dtype
    with pytest.raises(ValueError, match=error):
        resolve_kv_cache_dtype(name, torch.float32, torch.device(device))


@needs_kernels
@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_bundled_model_perplexity_with_int8_pages(quantization: str):
    """Teacher-forced perplexity of a long prompt (its prefill reads its own keys from int8
    pages): within PERPLEXITY_REL_BOUND of bfloat16 pages', with dense bfloat16 weights and
    with the GGUF's blocks (the decoder layers in one C++ call: the default serving path)."""
    ids = ref.prompt_ids(TEXT + "\n\n" + TEXT)
    values = {}
    for kv in ("auto", "int8"):
        engine = Engine(EngineConfig(dtype="bfloat16", quantization=quantization,
                                     kv_cache_dtype=kv, max_total_tokens=4096,
                                     max_running_requests=4))
        assert engine.kv_pool.cache_dtype == (torch.int8 if kv == "int8" else torch.bfloat16)
        values[kv] = perplexity(prefill_logits(engine, ids), ids)
        engine.shutdown()
    assert abs(values["int8"] - values["auto"]) / values["auto"] < PERPLEXITY_REL_BOUND, values


def assert_near_reference_argmax(logits_of, prompts: list[list[int]], outs: list[dict],
                                 margin: float) -> None:
    """Each greedy token's reference logit within `margin` of the reference's best there,
    teacher-forced on our tokens (`logits_of(ids)`: the reference's logits at every position)."""
    for prompt, out in zip(prompts, outs):
        tokens = out["output_ids"]
        logits = logits_of(prompt + tokens)[len(prompt) - 1:-1].float()
        chosen = logits[torch.arange(len(tokens)), torch.tensor(tokens)]
        worst = float((logits.max(dim=-1).values - chosen).max())
        assert worst <= margin, worst


BUNDLED_FEATURES = {
    "plain": dict(disable_radix_cache=True),
    "prefix cache": dict(),
    "chunked + mixed": dict(chunked_prefill_size=16, enable_mixed_chunk=True),
    "ngram speculation": dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=4),
}


@needs_kernels
@pytest.mark.parametrize("feature", list(BUNDLED_FEATURES))
def test_bundled_model_with_int8_pages_and_each_feature(feature: str):
    """The bundled model (float32 compute, int8 pages): greedy tokens near transformers'
    float32 argmax with each feature; the prefix cache run serves a second round of prompts
    that share their first 40 tokens with the first."""
    base = [ref.prompt_ids(p) for p in ref.PLAIN_PROMPTS[:3]]
    shared = ref.prompt_ids(TEXT)[:40]
    prompts = base + [shared + p for p in base]
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    with LLM(dtype="float32", kv_cache_dtype="int8", max_total_tokens=4096,
             max_running_requests=4, **BUNDLED_FEATURES[feature]) as llm:
        assert llm.runtime.engine.kv_pool.cache_dtype == torch.int8
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        again = llm.generate(input_ids=[shared + [5] + p for p in base], sampling_params=params)
        llm.check_integrity()
    if feature == "prefix cache":
        assert all(o["meta_info"]["cached_tokens"] >= 32 for o in again)
    assert_near_reference_argmax(ref.hf_logits, prompts, outs, INT8_KV_MARGIN)
    assert_near_reference_argmax(ref.hf_logits, [shared + [5] + p for p in base], again,
                                 INT8_KV_MARGIN)


def tiny_logits(model: torch.nn.Module):
    def logits_of(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids])).logits[0]
    return logits_of


TINY_MODELS: dict[str, Callable[[Path], torch.nn.Module]] = {
    "sliding window": lambda path: save_tiny("MistralForCausalLM", "MistralConfig", path,
                                             sliding_window=WINDOW),
    "moe": lambda path: save_tiny("Qwen3MoeForCausalLM", "Qwen3MoeConfig", path, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=32),
    "latent attention": lambda path: save_deepseek(path, "v3"),  # int8 rows of 40 dims
}


@needs_kernels
@pytest.mark.parametrize("tp_size", [1, 2])
@pytest.mark.parametrize("kind", list(TINY_MODELS))
def test_tiny_models_with_int8_pages(kind: str, tp_size: int, tmp_path: Path):
    """A sliding-window model (prompts past its window), a mixture of experts and latent
    attention (the values a view of the keys' rows, sharing their scales), int8 pages,
    chunked, on 1 and 2 ranks (each rank's heads and their scales): greedy tokens near
    transformers' float32 argmax."""
    model = TINY_MODELS[kind](tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist()
               for n in (5, 40, 70)]
    params = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
    with LLM(model=str(tmp_path), dtype="float32", kv_cache_dtype="int8", max_total_tokens=1024,
             chunked_prefill_size=32, tp_size=tp_size) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        llm.check_integrity()
    assert_near_reference_argmax(tiny_logits(model), prompts, outs, INT8_KV_MARGIN)


@needs_kernels
def test_lora_with_int8_pages(tmp_path: Path):
    """Rows with an adapter and rows without in one batch, int8 pages: each row's greedy
    tokens near PEFT's merged float32 model's argmax."""
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    save_base(base)
    save_adapter(base, adapter, seed=1)
    prompts = [[1, 5, 9, 30, 77], [1, 8, 200, 11], [1, 400, 3, 17, 21, 99]]
    names = ["a", None, "a"]
    with LLM(model=str(base), dtype="float32", kv_cache_dtype="int8", max_total_tokens=1024,
             enable_lora=True, lora_paths=[f"a={adapter}"]) as llm:
        outs = llm.generate(input_ids=prompts, lora_path=names,
                            sampling_params={"temperature": 0, "max_new_tokens": 12,
                                             "ignore_eos": True})
        llm.check_integrity()
    assert_within_margin_of_merged(base, {"a": adapter}, prompts, names, outs, INT8_KV_MARGIN)


FP8_MARGIN_CUDA = 0.5  # logit units: bfloat16 compute and float8 pages (e4m3 ~2x int8's error)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_pages_through_flashinfer_on_cuda(kv: str):
    """float8 pages on CUDA (FlashInfer's 8-bit KV, decode in CUDA graphs): greedy tokens of
    the bundled model, prompts up to 300 tokens, near the float32 reference's argmax."""
    pytest.importorskip("flashinfer")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (int(n),), generator=gen).tolist()
               for n in torch.randint(5, 300, (8,), generator=gen)]
    with LLM(dtype="bfloat16", device="cuda", kv_cache_dtype=kv, max_total_tokens=32768,
             max_running_requests=8) as llm:
        engine = llm.runtime.engine
        assert engine.kv_pool.cache_dtype == getattr(torch, engine.config.kv_cache_dtype)
        assert engine.runner.graph_runner is not None
        outs = llm.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 24, "ignore_eos": True})
        llm.check_integrity()
    assert_near_reference_argmax(ref.hf_logits, prompts, outs, FP8_MARGIN_CUDA)
