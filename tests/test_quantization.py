"""`--quantization gguf`: the bundled GGUF's Q4_1 linear weights served 4-bit, as
in the file, through the VNNI kernel (kernels/csrc/quant_matmul.cpp; torch's int4 kernel on CPUs
without it), and its Q8_0 token table (the tied LM head) 8-bit. The reference is the float32
model on the same weights dequantized (transformers' GGUF reader): the same math, so what
differs is bfloat16 rounding (the kernel keeps activations to ~15 bits), stated as bounds beside
the dense bfloat16 model's own. Measured with the VNNI kernel: logits relative error 0.016 /
0.031 (long / short prompt) for dense bf16, 0.016 / 0.027 for gguf, where int8 activations alone
(llama.cpp's Q8) gave 0.077 / 0.078; perplexity of the paragraph twice 4.105 fp32, 4.108 bf16,
4.105 gguf, of it once 14.27, 14.32, 14.27; greedy tokens before the first difference from
fp32 over 4 prompts x 32 (with the head's table re-quantized from bfloat16 then): 88 / 128 bf16,
83 / 128 gguf, the reference's top-2 margin at each difference at most 0.018 bf16, 0.044 gguf."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl import LLM
from minisgl.engine import Engine, EngineConfig
from minisgl.layers import embedding
from minisgl.layers.quant import (
    KERNEL_MAX_ROWS,
    VNNI_MAX_ROWS,
    WeightBlocks,
    TorchInt4Weight,
    VnniWeight,
    int8_weight,
    vnni_kernels,
)
from tests import reference as ref
from tests.engine_probe import prefill_logits

TEXT = (Path(__file__).parent / "data" / "tale_of_two_cities.txt").read_text().strip()
LOGIT_REL_BOUND = 0.05  # ||logits - reference|| / ||reference||, bf16 activations
PERPLEXITY_REL_BOUND = 0.01
TOP2_MARGIN_BF16 = 0.25  # logit units: where a bf16 greedy run may leave the fp32 one
ENGINE_ARGS = dict(max_total_tokens=4096, max_running_requests=4)


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours.float() - reference).norm() / reference.norm())


def perplexity(logits: torch.Tensor, ids: list[int]) -> float:
    logprobs = torch.log_softmax(logits[:-1].float(), dim=-1)
    return float(torch.exp(-logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean()))


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    """One prompt longer than KERNEL_MAX_ROWS (its prefill dequantizes the layer for a GEMM),
    one shorter (the int4 kernel)."""
    long = ref.prompt_ids(TEXT + "\n\n" + TEXT)
    short = ref.prompt_ids(ref.chat_prompt("Name a prime."))
    assert len(short) <= KERNEL_MAX_ROWS < len(long)
    return {"long": long, "short": short}


@pytest.fixture(scope="module")
def logits(prompts) -> dict[str, dict[str, torch.Tensor]]:
    """Prefill logits of each prompt per method."""
    out = {}
    for name, extra in (("fp32", dict(dtype="float32")),
                        ("bf16", dict(dtype="bfloat16", quantization="none")),
                        ("gguf", dict(dtype="bfloat16", quantization="gguf"))):
        engine = Engine(EngineConfig(**ENGINE_ARGS, **extra))
        assert engine.quantization == ("gguf" if "gguf" in name else "none")
        out[name] = {k: prefill_logits(engine, ids) for k, ids in prompts.items()}
        engine.shutdown()
    return out


@pytest.mark.parametrize("prompt", ["long", "short"])
def test_gguf_logits_match_the_dequantized_reference(logits, prompt: str):
    err = relative_error(logits["gguf"][prompt], logits["fp32"][prompt])
    assert err < LOGIT_REL_BOUND, err
    assert torch.isfinite(logits["gguf"][prompt]).all()


def test_gguf_perplexity_matches(logits, prompts):
    want = perplexity(logits["fp32"]["long"], prompts["long"])
    for method in ("bf16", "gguf"):
        got = perplexity(logits[method]["long"], prompts["long"])
        assert abs(got - want) / want < PERPLEXITY_REL_BOUND, (method, got, want)


def assert_greedy_agrees(quantization: str, margin_bound: float) -> None:
    """Greedy tokens (4 prompts x 24, through the server loop with decode batches) of the
    bfloat16 model with `quantization` equal the float32 model's until a token where the
    reference's top-2 margin is below `margin_bound`."""
    prompts = [ref.prompt_ids(p) for p in ref.PLAIN_PROMPTS[:4]]
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
    with LLM(dtype="float32", **ENGINE_ARGS) as llm:
        reference = [o["output_ids"] for o in llm.generate(input_ids=prompts,
                                                          sampling_params=params)]
    with LLM(dtype="bfloat16", quantization=quantization, **ENGINE_ARGS) as llm:
        assert llm.runtime.engine.quantization == quantization
        ours = [o["output_ids"] for o in llm.generate(input_ids=prompts, sampling_params=params)]
        llm.check_integrity()
    for prompt, a, b in zip(prompts, ours, reference):
        if a == b:
            continue
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        margin = ref.top2_margin(prompt + b[:at])
        assert margin < margin_bound, (quantization, at, margin)


def test_gguf_greedy_agrees_with_the_reference():
    assert_greedy_agrees("gguf", TOP2_MARGIN_BF16)


def vnni_int4(blocks: WeightBlocks, dtype: torch.dtype) -> VnniWeight:
    return VnniWeight(blocks.codes, blocks.scales, blocks.zeros - 8 * blocks.scales, bits=4)


def int4_layouts() -> list:
    return [TorchInt4Weight] + ([vnni_int4] if vnni_kernels() is not None else [])


needs_vnni = pytest.mark.skipif(vnni_kernels() is None, reason="no AVX-512 VNNI here")


def random_blocks(out_features: int, in_features: int, gen: torch.Generator) -> WeightBlocks:
    """Q4_1-like blocks: float16 scales and mins, as a GGUF stores them."""
    groups = in_features // 32
    scales = (torch.rand(out_features, groups, generator=gen) * 0.01).half().float()
    mins = (torch.randn(out_features, groups, generator=gen) * 0.01).half().float()
    return WeightBlocks(torch.randint(0, 16, (out_features, in_features), generator=gen,
                                    dtype=torch.uint8), scales, mins + 8 * scales)


def test_both_paths_of_a_4bit_layer_compute_the_same_weight():
    """Each layout's kernel against the float32 product with the dequantized blocks, at row
    counts on both sides of each layout's kernel / GEMM switch and of the VNNI kernel's 4-row
    tiles;
    also shapes whose torch packing unpack_codes does not know (output rows not a multiple of
    64: a copy of the codes is kept) and an input width of one group."""
    gen = torch.Generator().manual_seed(0)
    for layout in int4_layouts():
        for out_features, in_features in ((192, 256), (48, 256), (16, 32)):
            blocks = random_blocks(out_features, in_features, gen)
            weight = layout(blocks, torch.bfloat16)
            if layout is TorchInt4Weight:
                # NOTE: torch packs for its CPU's vector width: unpack_codes knows the AVX-512
                # layout (blocks of 64 rows); elsewhere every shape keeps its own copy
                known = out_features % 64 == 0 and torch.backends.cpu.get_cpu_capability() \
                    .startswith("AVX512")
                assert (weight.nibbles is None) == known
                assert torch.equal(weight.codes(), blocks.codes)
            for rows in (1, 3, 5, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, VNNI_MAX_ROWS,
                         VNNI_MAX_ROWS + 1):
                x = torch.randn(rows, in_features, generator=gen)
                want = x @ blocks.dequantize().t()
                got = weight.matmul(x.to(torch.bfloat16))
                # measured: 0.0017 (VNNI), 0.0025-0.0033 (torch), mostly x's bf16 rounding
                assert relative_error(got, want) < 1e-2, (layout, out_features, rows)


@needs_vnni
def test_vnni_layout_holds_the_gguf_weights_exactly():
    """float16 scales and offsets (w = d * code + m) lose nothing of blocks whose scales and
    mins are float16, as a GGUF's are."""
    gen = torch.Generator().manual_seed(1)
    blocks = random_blocks(64, 96, gen)
    weight = vnni_int4(blocks, torch.bfloat16)
    scales, offsets = weight.scales_and_offsets.float().permute(2, 0, 3, 1).reshape(2, 64, 3)
    assert torch.equal(scales, blocks.scales)
    assert torch.equal(offsets, blocks.zeros - 8 * blocks.scales)
    assert torch.allclose(weight.dequantized(), blocks.dequantize(), rtol=0, atol=1e-6)
    assert weight.nbytes == 64 * 96 // 2 + 64 * 3 * 2 * 2


@needs_vnni
def test_8bit_vnni_weight_is_q8_0_of_the_dense_one():
    """The LM head's 8-bit form: per group of 32, codes within +-127 of 128 and a float16
    scale; its product against the float32 one of the weight it encodes, at row counts
    around the 4-row tiles."""
    gen = torch.Generator().manual_seed(2)
    dense = torch.randn(48, 96, generator=gen) * 0.05
    weight = int8_weight(dense)
    assert weight.codes.min() >= 1 and weight.nbytes == 48 * 96 + 48 * 3 * 2 * 2
    # rounding to 255 steps of the group's largest value: at most half a step (max/254) off
    step = dense.abs().view(48, 3, 32).amax(dim=-1, keepdim=True) / 254
    assert ((weight.dequantized() - dense).view(48, 3, 32).abs() <= step * 1.01).all()
    for rows in (1, 4, 5, 9, VNNI_MAX_ROWS + 1):
        x = torch.randn(rows, 96, generator=gen)
        want = x @ weight.dequantized().t()
        assert relative_error(weight.matmul(x.to(torch.bfloat16)), want) < 1e-2, rows


def tp3_vs_tp1_error(quantization: str, ids: list[int]) -> float:
    """Relative distance of TP 3's prefill logits of `ids` from TP 1's (bfloat16)."""
    results = []
    for tp in (1, 3):
        engine = Engine(EngineConfig(dtype="bfloat16", quantization=quantization, tp_size=tp,
                                     **ENGINE_ARGS))
        results.append(prefill_logits(engine, ids))
        engine.shutdown()
    return relative_error(results[1], results[0])


def test_tp3_gguf_matches_tp1(prompts):
    """Row- and column-sharded 4-bit blocks (each rank cuts at multiples of 32 inputs)."""
    assert tp3_vs_tp1_error("gguf", prompts["short"]) < LOGIT_REL_BOUND


@pytest.mark.parametrize("config", ["llama-3.1-8b", "qwen3-0.6b"])
def test_dummy_4bit_weights_build_for_the_shipped_shapes(config: str):
    with LLM(config, load_format="dummy", quantization="gguf", dtype="bfloat16",
             json_model_override_args='{"num_hidden_layers": 2}', max_total_tokens=1024) as llm:
        engine = llm.runtime.engine
        layer = engine.model.layers[0]
        assert layer.mlp.down_proj.quantized is not None and layer.mlp.down_proj.packed is None
        out = llm.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 3})
        assert len(out["output_ids"]) == 3


@pytest.mark.parametrize("flags,message", [
    (("--quantization", "gguf", "--dtype", "float16"), "--dtype bfloat16"),
    (("--quantization", "gguf", "--model", "qwen3-0.6b"), "needs a .gguf model"),
    (("--quantization", "int3"), "--quantization"),
])
def test_quantization_that_cannot_run_is_one_line(flags, message):
    done = subprocess.run([sys.executable, "-m", "minisgl", "generate", "--prompt", "hi",
                           "--max-new-tokens", "1", *flags], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("error:"), done.stderr


@needs_vnni
def test_q8_0_linears_run_as_8bit_blocks(prompts):
    """A GGUF whose linear weights are Q8_0 (the bundled one re-encoded): they load as 8-bit
    blocks through the VNNI kernel, and the logits match the float32 model on the same file
    dequantized within the bound of the 4-bit case (measured: 0.017 / 0.021; the same file
    dense in bf16: 0.016 / 0.024)."""
    from tests.gguf_requant import q8_0_gguf
    model = str(q8_0_gguf())
    logits = {}
    for name, extra in (("fp32", dict(dtype="float32")),
                        ("gguf", dict(dtype="bfloat16", quantization="gguf"))):
        engine = Engine(EngineConfig(model_path=model, **extra, **ENGINE_ARGS))
        down = engine.model.layers[0].mlp.down_proj
        assert (getattr(down.quantized, "bits", None) == 8) == (name == "gguf")
        logits[name] = {k: prefill_logits(engine, ids) for k, ids in prompts.items()}
        engine.shutdown()
    for prompt in prompts:
        err = relative_error(logits["gguf"][prompt], logits["fp32"][prompt])
        assert err < LOGIT_REL_BOUND, (prompt, err)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_block_layouts_decode_to_the_ggml_formula(kind: str):
    """Blocks written as ggml lays them out (Q4: fp16 scale [, fp16 min], 16 bytes: byte j =
    value j | value j + 16 << 4; Q8_0: fp16 scale, 32 int8) decode to
    w = (code - 2^(bits - 1)) * scale + zero."""
    import numpy as np
    from minisgl.models.gguf_blocks import decode_blocks
    rng = np.random.default_rng(0)
    out_features, in_features = 4, 64
    d = rng.random((out_features, in_features // 32, 1)).astype(np.float16)
    if kind == "Q8_0":
        q = rng.integers(-128, 128, (out_features, in_features // 32, 32), dtype=np.int8)
        raw = np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1)
        want = q.astype(np.float32) * d
    else:
        codes = rng.integers(0, 16, (out_features, in_features // 32, 32), dtype=np.uint8)
        m = (rng.standard_normal((out_features, in_features // 32, 1)) * 0.1).astype(np.float16)
        packed = codes[..., :16] | (codes[..., 16:] << 4)
        parts = [d.view(np.uint8)] + ([m.view(np.uint8)] if kind == "Q4_1" else []) + [packed]
        raw = np.concatenate(parts, axis=-1)
        q = codes.astype(np.float32)
        want = q * d + m if kind == "Q4_1" else (q - 8) * d
    blocks = decode_blocks(kind, raw.reshape(out_features, -1), out_features, in_features)
    assert blocks.bits == (8 if kind == "Q8_0" else 4)
    assert torch.allclose(blocks.dequantize(), torch.from_numpy(want.reshape(out_features, -1)),
                          atol=1e-6)


def test_llama_q_rows_are_unpermuted_like_transformers():
    """llama.cpp's converter interleaves the rotary halves of each head's q / k rows; the
    blocks' rows go back to Hugging Face order (transformers' reverse_permute)."""
    from minisgl.models.gguf_hybrid import llama_rows
    heads, rows = 3, 12
    hf = torch.arange(rows)
    gguf = hf.view(heads, 2, rows // heads // 2).transpose(1, 2).reshape(-1)  # the converter
    blocks = WeightBlocks(gguf[:, None].repeat(1, 32).to(torch.uint8), torch.zeros(rows, 1),
                        torch.zeros(rows, 1))
    assert blocks[llama_rows(rows, heads)].codes[:, 0].tolist() == hf.tolist()


def test_gguf_is_the_default_for_a_gguf_model_where_a_kernel_keeps_the_dtypes_precision():
    from minisgl.engine.quantization import resolve_quantization
    from minisgl.layers.gguf_weight import block_kernels
    cpu = torch.device("cpu")
    want = "gguf" if vnni_kernels() is not None else "none"  # torch's int4 kernel: opt-in
    assert resolve_quantization(None, None, cpu, torch.bfloat16, "auto") == want
    assert resolve_quantization(None, None, cpu, torch.float32, "auto") == "none"
    # float32 that --dtype auto picked (no native bfloat16): the AVX2 kernel's ~15-bit
    # activations are the speed the user did not trade away
    want = "gguf" if block_kernels() is not None else "none"
    assert resolve_quantization(None, None, cpu, torch.float32, "auto", dtype_chosen=False) == want
    assert resolve_quantization(None, None, torch.device("cuda"), torch.float32, "auto",
                                dtype_chosen=False) == "none"
    assert resolve_quantization(None, None, cpu, torch.bfloat16, "dummy") == "none"
    assert resolve_quantization("none", None, cpu, torch.bfloat16, "auto") == "none"


@needs_vnni
def test_gguf_vocabulary_table_stays_the_files_blocks():
    """The bundled file's Q8_0 token table (tied LM head) is held only as its blocks in the
    VNNI layout: no dense copy, no 8-bit or prepacked copy of the head; its rows are the
    file's values exactly, and the lookup is them in bfloat16."""
    import gguf

    from minisgl.models.weights import gguf_file
    engine = Engine(EngineConfig(dtype="bfloat16", quantization="gguf", **ENGINE_ARGS))
    try:
        embed, head = engine.model.embed_tokens, engine.model.lm_head
        assert isinstance(embed.table_blocks, VnniWeight) and embed.table_blocks.bits == 8
        assert embed.weight.numel() == 0 and head.blocks_head is embed.table_blocks
        assert head.int8 is None and head.packed is None
        table = next(t for t in gguf.GGUFReader(gguf_file(None)).tensors
                     if t.name == "token_embd.weight")
        assert table.tensor_type.name == "Q8_0"
        ids = torch.tensor([0, 2, 17, 4096, 49151])
        want = torch.from_numpy(gguf.quants.dequantize(table.data, table.tensor_type)[ids])
        assert torch.equal(embed.table_blocks.rows(ids), want)
        assert torch.equal(embed(ids), want.to(torch.bfloat16))
    finally:
        engine.shutdown()


@needs_vnni
def test_block_table_pads_its_vocabulary_to_whole_kernel_blocks():
    """A vocabulary that is not a multiple of the layout's 16 rows: zero rows pad the blocks,
    the lookup reads the real rows and the head's logits are the vocabulary's only."""
    gen = torch.Generator().manual_seed(3)
    vocab, hidden = 40, 64
    codes = torch.randint(1, 256, (vocab, hidden), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(vocab, hidden // 32, generator=gen) / 50).half().float()
    blocks = WeightBlocks(codes, scales, torch.zeros_like(scales), bits=8)
    head = embedding.ParallelLMHead(vocab, hidden, tied_to=None).to(torch.bfloat16)
    head.expect_blocks(8)
    head.load("lm_head.weight", blocks)
    assert head.table_blocks.out_features == 48
    dense = blocks.dequantize()
    ids = torch.tensor([[0, 39], [7, 16]])
    assert torch.equal(head.lookup(ids), dense[ids].to(torch.bfloat16))
    x = torch.randn(3, hidden, generator=gen)
    logits = head(x.to(torch.bfloat16))
    assert logits.shape == (3, vocab)
    assert relative_error(logits, x @ dense.t()) < 1e-2
