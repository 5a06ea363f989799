"""`--cpu-int8-activations`: the VNNI kernels with one int8 term per activation and group of 32
inputs (llama.cpp's Q8 numerics) instead of two. Each kernel computes, up to its output's
rounding, the float64 product of the weights and the activations rounded so; the bundled model
served so stays within stated bounds of the float32 reference; speculation keeps plain
decoding's greedy output; and the flag is refused where it would not do what it says. (What
the bounds were set against: BENCHMARKS.md, "One int8 activation term".)"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from minisgl import LLM
from minisgl.engine import Engine, EngineConfig
from minisgl.engine.quantization import check_int8_activations
from minisgl.layers.gguf_weight import OFFSET_FOLDED, GgufWeight, block_kernels
from minisgl.layers.quant import (VnniWeight, WeightBlocks, activation_terms, block_weight,
                                  int8_weight)
from minisgl.models.gguf_decode import BLOCK_BYTES, read_gguf_blocks
from tests import reference as ref
from tests.engine_probe import prefill_logits
from tests.test_gguf_kquants import random_blocks
from tests.test_quantization import TEXT, perplexity, relative_error

VNNI = block_kernels() is not None and block_kernels().block_kernel_vnni()
needs_vnni = pytest.mark.skipif(not VNNI, reason="needs the AVX-512 VNNI kernels")

ROWS = (1, 2, 3, 4, 5, 9, 64, 130, 600)
# |kernel - product of the rounded activations| / max |product|: the output's rounding
ROUNDED_BOUND = {torch.bfloat16: 4e-3, torch.float32: 1e-5}
EXACT_BOUND = 0.03  # the same against the exact activations' product (two terms: 8e-3)
LOGIT_REL_BOUND = 0.15  # ||logits - fp32 reference|| / ||reference|| (two terms: 0.05)
PERPLEXITY_REL_BOUND = 0.03  # two terms: 0.01
TOP2_MARGIN = 0.5  # logit units: where greedy tokens may leave the fp32 reference's


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels round it: per row and group of 32, s = max |x| / 127 in float32 and
    each value to the nearest (even) multiple of s; float64."""
    groups = x.float().view(x.shape[0], -1, 32)
    s = groups.abs().amax(-1, keepdim=True) / 127
    q = torch.round(groups * torch.where(s > 0, 1 / s, 0))
    return (q.double() * s.double()).view_as(x)


def one_term_product(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
                     ) -> torch.Tensor:
    """What a kernel computes for w = d * code + m (`offsets`: m per weight, zero where the
    kernel folds m into the integer dot product): d * code times the rounded activations, m times
    the exact ones, in float64."""
    exact = x.double()
    return rounded(x) @ (weight - offsets).t() + exact @ offsets.t()


def check_kernel(matmul, dense: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    for rows in ROWS:
        x = torch.randn(rows, dense.shape[1], generator=gen).to(dtype)
        want = one_term_product(x, dense, offsets)
        got = matmul(x)
        assert got.dtype == dtype and got.shape == want.shape
        error = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert error < ROUNDED_BOUND[dtype], (rows, dtype, error)
        exact = x.double() @ dense.t()
        assert ((got.double() - exact).abs().max() / exact.abs().max()).item() < EXACT_BOUND


@needs_vnni
@pytest.mark.parametrize("bits", [4, 8])
def test_vnni_kernel_multiplies_activations_rounded_to_one_int8(bits: int):
    gen = torch.Generator().manual_seed(1)
    out, in_features = 48, 768
    with activation_terms(1):
        if bits == 4:
            blocks = WeightBlocks(torch.randint(0, 16, (out, in_features), generator=gen,
                                                dtype=torch.uint8),
                                  (torch.rand(out, 24, generator=gen) * 0.01).half().float(),
                                  (torch.randn(out, 24, generator=gen) * 0.01).half().float())
            weight = block_weight(blocks, torch.bfloat16)
        else:
            weight = int8_weight(torch.randn(out, in_features, generator=gen) * 0.05)
    assert isinstance(weight, VnniWeight) and weight.terms == 1
    groups = weight.codes.shape[1]
    zero = VnniWeight(torch.zeros(out, in_features, dtype=torch.uint8),
                      *weight.scales_and_offsets.float().permute(2, 0, 3, 1).reshape(
                          2, out, groups), bits=bits)
    check_kernel(weight.matmul, weight.dequantized().double(),
                 zero.dequantized().double(), torch.bfloat16)


@needs_vnni
@pytest.mark.parametrize("kind", sorted(BLOCK_BYTES))
def test_block_kernel_multiplies_activations_rounded_to_one_int8(kind: str):
    out, in_features = 40, 768
    blocks = read_gguf_blocks(kind, random_blocks(kind, out, in_features, seed=3), out, in_features)
    with activation_terms(1):
        weight = GgufWeight(blocks)
        zero = GgufWeight(dataclasses.replace(blocks, codes=torch.zeros_like(blocks.codes)))
    assert weight.terms == 1
    offsets = zero.rows().double() * (kind not in OFFSET_FOLDED)
    for dtype in (torch.float32, torch.bfloat16):
        check_kernel(weight.matmul, weight.rows().double(), offsets, dtype)


@pytest.fixture(scope="module")
def served_logits() -> dict[str, dict[str, torch.Tensor]]:
    """Prefill logits of a long prompt (past every crossover) and a short one, float32
    reference and one-term bfloat16 gguf."""
    ids = {"long": ref.prompt_ids(TEXT + "\n\n" + TEXT),
           "short": ref.prompt_ids(ref.chat_prompt("Name a prime."))}
    out = {"ids": ids}
    for name, extra in (("fp32", dict(dtype="float32")),
                        ("one-term", dict(dtype="bfloat16", quantization="gguf",
                                          cpu_int8_activations=True))):
        engine = Engine(EngineConfig(max_total_tokens=4096, max_running_requests=4, **extra))
        out[name] = {k: prefill_logits(engine, v) for k, v in ids.items()}
        engine.shutdown()
    return out


@needs_vnni
@pytest.mark.parametrize("prompt", ["long", "short"])
def test_served_logits_within_the_stated_bound(served_logits, prompt: str):
    err = relative_error(served_logits["one-term"][prompt], served_logits["fp32"][prompt])
    assert err < LOGIT_REL_BOUND, err


@needs_vnni
def test_served_perplexity_within_the_stated_bound(served_logits):
    ids = served_logits["ids"]["long"]
    want = perplexity(served_logits["fp32"]["long"], ids)
    got = perplexity(served_logits["one-term"]["long"], ids)
    assert abs(got - want) / want < PERPLEXITY_REL_BOUND, (got, want)


@needs_vnni
def test_tp3_within_the_stated_bound(served_logits):
    """Each rank rounds the activations it multiplies, groups whole (shards cut at multiples of
    32): the same rounding as one rank's, but the ranks' partial sums, each rounded to
    bfloat16, move later layers' inputs, and one term's rounding turns such differences into
    its own: TP 3 is held to the reference's bound, not to TP 1's logits."""
    engine = Engine(EngineConfig(max_total_tokens=4096, max_running_requests=4, tp_size=3,
                                 dtype="bfloat16", quantization="gguf",
                                 cpu_int8_activations=True))
    logits = prefill_logits(engine, served_logits["ids"]["short"])
    engine.shutdown()
    assert relative_error(logits, served_logits["fp32"]["short"]) < LOGIT_REL_BOUND


@needs_vnni
def test_greedy_tokens_leave_the_reference_only_where_it_is_unsure():
    prompts = [ref.prompt_ids(p) for p in ref.PLAIN_PROMPTS[:4]]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    with LLM(dtype="float32", max_total_tokens=4096, max_running_requests=4) as llm:
        reference = [o["output_ids"] for o in llm.generate(input_ids=prompts,
                                                          sampling_params=params)]
    with LLM(dtype="bfloat16", quantization="gguf", cpu_int8_activations=True,
             max_total_tokens=4096, max_running_requests=4) as llm:
        ours = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=params)]
        llm.check_integrity()
    for prompt, a, b in zip(prompts, ours, reference):
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is not None:
            margin = ref.top2_margin(prompt + b[:at])
            assert margin < TOP2_MARGIN, (at, margin)


@needs_vnni
def test_speculation_keeps_plain_decodings_greedy_output():
    """NGRAM drafts verified at several rows a forward: each row's activations round alone,
    so the verify step's tokens are the decode steps'."""
    passage = " ".join(TEXT.split()[:80])
    prompts = [ref.chat_prompt(f"Repeat the following text exactly:\n\n{passage}"),
               ref.chat_prompt("Name three prime numbers.")]
    params = {"temperature": 0, "max_new_tokens": 48}
    outputs = []
    for spec in ({}, {"speculative_algorithm": "NGRAM", "speculative_always_draft": True}):
        with LLM(dtype="bfloat16", quantization="gguf", cpu_int8_activations=True,
                 max_total_tokens=4096, max_running_requests=2, **spec) as llm:
            outs = llm.generate(prompts, params)
            outputs.append([o["output_ids"] for o in outs])
            if spec:
                assert llm.runtime.state()["spec_accepted_tokens"] > 0
            llm.check_integrity()
    assert outputs[0] == outputs[1]


def test_refused_where_it_would_change_nothing():
    with pytest.raises(ValueError, match="on a GPU"):
        check_int8_activations(True, "gguf", torch.device("cuda"))
    with pytest.raises(ValueError, match="with none every linear runs dense"):
        check_int8_activations(True, "none", torch.device("cpu"))
    assert check_int8_activations(False, "none", torch.device("cpu")) == 2
    if VNNI:
        assert check_int8_activations(True, "gguf", torch.device("cpu")) == 1
    else:
        with pytest.raises(ValueError, match="AVX-512 VNNI"):
            check_int8_activations(True, "gguf", torch.device("cpu"))


def test_refusal_on_the_command_line_is_one_line():
    done = subprocess.run([sys.executable, "-m", "minisgl", "generate", "--prompt", "hi",
                           "--max-new-tokens", "1", "--quantization", "none",
                           "--cpu-int8-activations"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), done.stderr
    assert "--cpu-int8-activations" in lines[0]
