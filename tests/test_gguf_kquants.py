"""GGUF blocks of every type the AVX2 kernel runs, k-quants and MXFP4 included, kept in their codes:
decoded exactly as the gguf package dequantizes them, multiplied to within
the activations' ~15 bits of the float64 product, and a Q4_K_M-style re-encoding of the bundled
model (llama.cpp's layout for it: Q4_K / Q6_K where a row is whole 256-value super-blocks,
Q5_0 / Q8_0 elsewhere) served against transformers in float32 on the same file."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Kind
from gguf import quants

from minisgl import LLM
from minisgl.layers.gguf_weight import (GgufWeight, GroupedGgufWeights, StackedWeight,
                                        block_kernels)
from minisgl.models.gguf_decode import BLOCK_BYTES, read_gguf_blocks
from tests import reference as ref
from tests.gguf_requant import encode, requant_gguf
from tests.test_gguf_types import assert_matches_transformers, hf_model

pytestmark = pytest.mark.skipif(block_kernels() is None, reason="needs the AVX2 block kernel")

# |kernel - float64| / max |float64| per product. Measured on these shapes: float32 out at most
# 7e-5 (the activations' two int8 terms, ~15 bits); bfloat16 out adds its rounding (2^-9).
KERNEL_BOUND_F32 = 2e-4
KERNEL_BOUND_BF16 = 8e-3
ROWS = (1, 2, 3, 4, 5, 8, 17, 64, 65, 600)
# fp16 fields of each block (byte offsets): d, and the min / dmin where the type has one
FP16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
           "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "MXFP4": []}


def random_blocks(kind: str, out: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Blocks of random bytes (every code, sub-scale and high bit pattern) with finite fp16
    scales: what the layouts can hold, not only what a quantizer writes."""
    rng = np.random.default_rng(seed)
    per_block = 256 if kind.endswith("_K") else 32
    raw = rng.integers(0, 256, size=(out, in_features // per_block, BLOCK_BYTES[kind]),
                       dtype=np.uint8)
    for at in FP16_AT[kind]:
        scale = rng.standard_normal((out, in_features // per_block, 1)) * 0.01
        raw[..., at:at + 2] = scale.astype(np.float16).view(np.uint8)
    if kind == "MXFP4":  # an e8m0 exponent: scales 2^-9 .. 2^2
        raw[..., 0] = rng.integers(118, 130, size=raw.shape[:2])
    return raw.reshape(out, -1)


def quantized_blocks(kind: str, out: int, in_features: int) -> np.ndarray:
    """Real weights' blocks: the gguf package's quantizer, or tests.gguf_requant's k-quant one."""
    weights = np.random.default_rng(1).standard_normal((out, in_features)).astype(np.float32)
    return encode(weights * 0.05, getattr(Kind, kind))


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_blocks_decode_exactly_as_the_gguf_package(kind: str):
    sources = [random_blocks(kind, 16, 512)]
    if kind not in ("Q5_K",):  # no encoder for Q5_K here: random blocks only
        sources.append(quantized_blocks(kind, 16, 512))
    for raw in sources:
        want = quants.dequantize(raw, getattr(Kind, kind))
        blocks = read_gguf_blocks(kind, raw, 16, 512)
        assert np.array_equal(blocks.dequantize().numpy(), want)
        assert np.array_equal(GgufWeight(blocks).rows().numpy(), want)  # the packed layout
        rows = torch.tensor([3, 0, 15])
        assert np.array_equal(GgufWeight(blocks).rows(rows).numpy(), want[[3, 0, 15]])


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_kernel_against_float64(kind: str):
    out, in_features = 40, 768
    raw = random_blocks(kind, out, in_features, seed=3)
    weight = GgufWeight(read_gguf_blocks(kind, raw, out, in_features))
    dense = torch.from_numpy(quants.dequantize(raw, getattr(Kind, kind))).double()
    gen = torch.Generator().manual_seed(0)
    for rows in ROWS:
        x = torch.randn(rows, in_features, generator=gen)
        want = x.double() @ dense.t()
        for dtype, bound in ((torch.float32, KERNEL_BOUND_F32),
                             (torch.bfloat16, KERNEL_BOUND_BF16)):
            got = weight.kernels.block_matmul(x.to(dtype), weight.codes, weight.scales,
                                              weight.subs, weight.bits, weight.mode, 2)
            assert got.dtype == dtype and got.shape == (rows, out)
            error = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert error < bound, (rows, dtype, error)
        # the layer's own choice (past KERNEL_MAX_ROWS: the dequantized weight, float32
        # or bfloat16, and a GEMM)
        for dtype, bound in ((torch.float32, KERNEL_BOUND_F32),
                             (torch.bfloat16, KERNEL_BOUND_BF16)):
            got = weight.matmul(x.to(dtype))
            error = ((got.double() - want).abs().max() / want.abs().max()).item()
            assert got.dtype == dtype and error < bound, (rows, dtype, error)
    dequantized = weight.kernels.block_dequantize_t(weight.codes, weight.scales, weight.subs,
                                                    weight.bits, weight.mode, False)
    assert torch.equal(dequantized, dense.float().t())
    as_bf16 = weight.kernels.block_dequantize_t(weight.codes, weight.scales, weight.subs,
                                                weight.bits, weight.mode, True)
    assert torch.equal(as_bf16, dense.t().to(torch.bfloat16))


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_a_rows_product_does_not_depend_on_its_batch(kind: str):
    """The kernel tiles a batch by its size (1-4 rows; with one int8 term, from 5 rows, spans
    decoded once and tiles of 8 rows; past 256 KB of activations, blocks of rows), but a row's
    result stays the same to the bit: a verify step's rows and a batch's rows decode as the
    row would alone."""
    out, in_features = 40, 768
    weight = GgufWeight(read_gguf_blocks(kind, random_blocks(kind, out, in_features, seed=5), out,
                               in_features))
    kernels = weight.kernels
    x = torch.randn(700, in_features, generator=torch.Generator().manual_seed(2))
    for terms in (1, 2) if kernels.block_kernel_vnni() else (2,):
        for dtype in (torch.float32, torch.bfloat16):
            def product(rows: torch.Tensor) -> torch.Tensor:
                return kernels.block_matmul(rows.to(dtype).contiguous(), weight.codes,
                                            weight.scales, weight.subs, weight.bits,
                                            weight.mode, terms)
            batch = product(x)
            some = [*range(0, len(x), 29), 335, 336, len(x) - 1]  # the row blocks' edges too
            assert torch.equal(batch[some], torch.cat([product(x[i:i + 1]) for i in some]))
            in_twenties = torch.cat([product(x[i:i + 20]) for i in range(0, len(x), 20)])
            assert torch.equal(batch, in_twenties), (terms, dtype)
            in_fives = torch.cat([product(x[i:i + 5]) for i in range(0, 100, 5)])
            assert torch.equal(batch[:100], in_fives), (terms, dtype)


@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_experts_in_one_call_equal_one_call_per_expert(kind: str):
    """A mixture's rows grouped by expert, every group in one kernel call (GroupedGgufWeights):
    each group's rows equal to the bit to their expert's own call, for groups of none, one, a
    tile's worth, past the decoded spans' threshold and past a block of rows."""
    out, in_features = 40, 768
    weights = [GgufWeight(read_gguf_blocks(kind, random_blocks(kind, out, in_features, seed=e),
                                           out, in_features)) for e in range(6)]
    counts = [3, 0, 1, 17, 400, 8]
    x = torch.randn(sum(counts), in_features, generator=torch.Generator().manual_seed(4))
    grouped = GroupedGgufWeights.of(weights)
    kernels = weights[0].kernels
    for terms in (1, 2) if kernels.block_kernel_vnni() else (2,):
        for dtype in (torch.float32, torch.bfloat16):
            rows = x.to(dtype)
            got = kernels.block_matmul_grouped(rows, grouped.codes, grouped.scales, grouped.subs,
                                               grouped.bits, grouped.mode, terms, counts)
            start = 0
            for weight, count in zip(weights, counts):
                alone = kernels.block_matmul(rows[start:start + count].contiguous(), weight.codes,
                                             weight.scales, weight.subs, weight.bits, weight.mode,
                                             terms)
                assert torch.equal(got[start:start + count], alone), (terms, dtype, count)
                start += count


def test_experts_of_other_forms_are_not_grouped():
    kind, out, in_features = "Q4_K", 40, 768
    one = GgufWeight(read_gguf_blocks(kind, random_blocks(kind, out, in_features), out,
                                      in_features))
    other = GgufWeight(read_gguf_blocks("Q6_K", random_blocks("Q6_K", out, in_features), out,
                                        in_features))
    assert GroupedGgufWeights.of([one, one]) is not None
    assert GroupedGgufWeights.of([one, other]) is None
    assert GroupedGgufWeights.of([one, StackedWeight([one])]) is None


def test_a_shard_must_cut_whole_blocks():
    k_quant = read_gguf_blocks("Q4_K", random_blocks("Q4_K", 8, 512), 8, 512)
    assert k_quant[:, 256:512].shape == (8, 256)
    with pytest.raises(ValueError, match="multiples of 256"):
        k_quant[:, 0:128]
    flat = read_gguf_blocks("Q5_0", random_blocks("Q5_0", 8, 96), 8, 96)
    with pytest.raises(ValueError, match="multiples of 32"):
        flat[:, 0:48]


# llama.cpp's Q4_K_M for this model (llama-quantize, BENCHMARKS.md): ffn_down and attn_v take
# the larger type in the first and last eighth of the layers and every third between
# (Q6_K / Q8_0), the smaller one elsewhere (Q4_K / Q5_0); other rows of 576 values: Q5_0.
def q4_k_m_kind(name: str, kind: Kind) -> Kind | None:
    parts = name.split(".")
    if parts[0] != "blk":
        return None
    layer, tensor = int(parts[1]), parts[2]
    more_bits = layer < 3 or layer >= 26 or (layer - 3) % 3 == 2
    if tensor == "ffn_down":
        return Kind.Q6_K if more_bits else Kind.Q4_K
    if tensor == "attn_v":
        return Kind.Q8_0 if more_bits else Kind.Q5_0
    return Kind.Q5_0 if kind == Kind.Q4_1 else None


@functools.lru_cache(maxsize=1)
def q4_k_m_gguf() -> str:
    return str(requant_gguf("Q4_K_M-style", q4_k_m_kind))


# Measured on 4 prompts x 32 greedy tokens: every token the reference's argmax (margin 0.0);
# logprobs at most 1.1e-3 from its (relative, as tests.test_gguf_types); the prompts'
# perplexity within 0.05% of its.
MARGIN_BOUND = 0.05
LOGPROB_TOLERANCE = 3e-3
PERPLEXITY_BOUND = 2e-3


def test_q4_k_m_style_model_serves_against_the_dense_reference():
    model = q4_k_m_gguf()
    with LLM(model, dtype="float32", quantization="gguf", max_total_tokens=1024,
             max_running_requests=2) as llm:
        engine = llm.runtime.engine
        layers = engine.model.layers
        assert layers[0].mlp.down_proj.quantized.kind == "Q6_K"
        assert layers[4].mlp.down_proj.quantized.kind == "Q4_K"
        assert isinstance(layers[0].self_attn.qkv_proj.quantized, StackedWeight)  # Q5_0, Q8_0
        assert layers[4].self_attn.qkv_proj.quantized.kind == "Q5_0"
        assert engine.model.embed_tokens.table_blocks.kind == "Q8_0"  # and the tied LM head
        assert engine.model.embed_tokens.weight.numel() == 0
        prompts = [ref.prompt_ids(p) for p in ref.PLAIN_PROMPTS[:2]]
        outs = llm.generate(input_ids=prompts, return_logprob=True, logprob_start_len=0,
                            sampling_params={"temperature": 0, "max_new_tokens": 12,
                                             "ignore_eos": True})
        llm.check_integrity()
    hf = hf_model(model)
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out, MARGIN_BOUND, LOGPROB_TOLERANCE)
        # perplexity of the prompt (teacher-forced), ours against the reference's
        ours = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
        theirs = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1),
                                               torch.tensor(prompt[1:])]
        ppl_ours, ppl_ref = math.exp(-np.mean(ours)), math.exp(-theirs.mean().item())
        assert abs(ppl_ours / ppl_ref - 1) < PERPLEXITY_BOUND, (ppl_ours, ppl_ref)
