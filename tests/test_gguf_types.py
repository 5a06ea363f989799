"""Every GGUF tensor type loads and answers, and a layer-count override cuts
any checkpoint down to its first layers (item 11).

The files are the bundled model re-encoded by tests.gguf_requant, cut to a few layers so they
convert fast. The reference is transformers in float32 on the same file (its GGUF reader
dequantizes with the gguf package, as our conversion does), teacher-forced on the prompt and our
greedy output: each token we chose must be the reference's argmax up to its top-2 margin, and
every logprob the reference's.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Kind
from gguf import quants

from minisgl import LLM
from minisgl.layers.gguf_weight import StackedWeight, block_kernels
from minisgl.models import resolve_model_path
from tests import reference as ref
from tests.gguf_requant import encode, requant_gguf

ENGINE_ARGS = dict(max_total_tokens=1024, max_running_requests=2)
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PROMPTS = ref.PLAIN_PROMPTS[:2]
# |ours - reference| / (1 + |reference|) over every logprob (a bf16 logit's error grows with its
# size, and the prompt's unlikely tokens have logprobs down to -35). Measured: float32 4e-6;
# bfloat16 0.024 with --quantization gguf, 0.020 dense.
FLOAT32_LOGPROB_TOLERANCE = 1e-4
BF16_LOGPROB_TOLERANCE = 0.06
TOP2_MARGIN_BF16 = 0.25  # as tests/test_quantization.py: where bf16 may leave the fp32 choice

# One fused group per line, so every kind of layer meets the loaders: all one block type (runs
# as blocks under --quantization gguf), blocks beside dense types (llama.cpp's Q4_K_M falls back
# to Q5_0 / Q8_0 where a row, 576 values here, is not a whole 256-value k-quant block), block
# widths mixed (4-bit beside Q8_0), and no blocks at all. Only ffn_down's rows (1536) take the
# 256-value types.
LAYOUT = {
    0: {"attn_q": Kind.Q4_0, "attn_k": Kind.Q4_0, "attn_v": Kind.Q4_0, "attn_output": Kind.Q4_1,
        "ffn_gate": Kind.Q4_1, "ffn_up": Kind.Q4_1, "ffn_down": Kind.Q4_K},
    1: {"attn_q": Kind.Q4_1, "attn_k": Kind.Q5_0, "attn_v": Kind.Q8_0, "attn_output": Kind.Q5_0,
        "ffn_gate": Kind.Q5_1, "ffn_up": Kind.Q5_0, "ffn_down": Kind.Q6_K},
    2: {"attn_q": Kind.F32, "attn_k": Kind.F16, "attn_v": Kind.BF16, "attn_output": Kind.MXFP4,
        "ffn_gate": Kind.Q8_0, "ffn_up": Kind.Q8_0, "ffn_down": Kind.TQ1_0},
    3: {"attn_q": Kind.Q4_0, "attn_k": Kind.Q8_0, "attn_v": Kind.Q4_0, "attn_output": Kind.F16,
        "ffn_gate": Kind.MXFP4, "ffn_up": Kind.BF16, "ffn_down": Kind.TQ2_0},
}


def layout_kind(name: str, kind: Kind) -> Kind | None:
    parts = name.split(".")
    return LAYOUT[int(parts[1])].get(parts[2]) if parts[0] == "blk" else None


@functools.lru_cache(maxsize=1)
def every_type_gguf() -> Path:
    return requant_gguf("4L-every-type", layout_kind, layers=len(LAYOUT))


def writable_kinds() -> set[Kind]:
    """Every GGUF type the gguf package can encode."""
    kinds = set()
    for kind in Kind:
        try:
            quants.quantize(np.zeros((1, 256), dtype=np.float32), kind)
        except NotImplementedError:
            continue
        kinds.add(kind)
    return kinds


@functools.lru_cache(maxsize=2)
def hf_model(model: str | None, num_layers: int | None = None):
    """transformers float32 on the folder our conversion made of `model` (the bundled GGUF
    for None), cut to `num_layers` as the override cuts ours."""
    from transformers import AutoModelForCausalLM
    extra = {} if num_layers is None else {"num_hidden_layers": num_layers}
    return AutoModelForCausalLM.from_pretrained(resolve_model_path(model), dtype=torch.float32,
                                                **extra).eval()


@torch.inference_mode()
def reference_gap(hf, prompt: list[int], out: dict) -> tuple[float, float]:
    """(how far the greedy tokens fall behind the reference's argmax at most, in logit units;
    the largest error of the logprob of a token after the first, prompt and output, relative
    to 1 + its size in the reference)."""
    ids = prompt + out["output_ids"]
    logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    rows, targets = torch.arange(len(ids) - 1), torch.tensor(ids[1:])
    chosen = logits[rows, targets][len(prompt) - 1:]
    behind = (logits[len(prompt) - 1:].max(dim=-1).values - chosen).max().item()
    want = torch.log_softmax(logits, dim=-1)[rows, targets]
    meta = out["meta_info"]
    got = torch.tensor([lp for lp, _, _ in
                        meta["input_token_logprobs"][1:] + meta["output_token_logprobs"]])
    return behind, ((got - want).abs() / (1 + want.abs())).max().item()


def assert_matches_transformers(hf, prompt: list[int], out: dict, margin: float,
                                logprob_tolerance: float) -> None:
    """Each greedy token is the reference's argmax (or within `margin` of its logit), and the
    logprob of every token after the first, prompt and output, the reference's within
    `logprob_tolerance` (relative, as above)."""
    behind, error = reference_gap(hf, prompt, out)
    assert behind <= margin, (out["output_ids"], behind)
    assert error < logprob_tolerance, (out["output_ids"], error)


def generate(llm: LLM) -> list[tuple[list[int], dict]]:
    prompts = [ref.prompt_ids(p) for p in PROMPTS]
    outs = llm.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                        logprob_start_len=0)
    llm.check_integrity()
    return list(zip(prompts, outs))


def test_the_layout_holds_every_type_the_gguf_package_writes():
    kinds = {kind for layer in LAYOUT.values() for kind in layer.values()}
    assert writable_kinds() | {Kind.Q4_K, Kind.Q6_K} <= kinds, writable_kinds() - kinds


@pytest.mark.parametrize("kind,bound", [(Kind.Q4_K, 0.1), (Kind.Q6_K, 0.03)])
def test_k_quant_encoding_is_what_gguf_decodes(kind: Kind, bound: float):
    """Our Q4_K / Q6_K bytes, decoded by the gguf package, give back the weights to about
    their bits (measured on these rows: 0.065, 0.018; Q4_1 0.063), zero blocks included."""
    rng = np.random.default_rng(0)
    weights = (rng.standard_normal((8, 1536)) * 0.05).astype(np.float32)
    weights[1] += 0.1  # a row without negative values
    weights[2, :256] = 0
    decoded = quants.dequantize(encode(weights, kind), kind)
    assert np.linalg.norm(decoded - weights) / np.linalg.norm(weights) < bound
    assert (decoded[2, :256] == 0).all()


def test_every_gguf_type_loads_and_matches_transformers():
    model = str(every_type_gguf())
    with LLM(model, dtype="float32", quantization="none", **ENGINE_ARGS) as llm:
        for prompt, out in generate(llm):
            assert_matches_transformers(hf_model(model), prompt, out, ref.TOP2_MARGIN_BOUND,
                                        FLOAT32_LOGPROB_TOLERANCE)


@pytest.mark.skipif(block_kernels() is None, reason="needs the AVX2 block kernel")
def test_every_gguf_type_loads_with_gguf_quantization(caplog):
    """--quantization gguf: every block type a kernel runs stays in its blocks (Q4_0 / Q4_1 /
    Q8_0 on the VNNI kernel where it runs in bfloat16, the others on the AVX2 one, types mixed
    within a layer), everything else dequantized, named in one warning line; a layer whose
    parts would need two kernels (VNNI's Q4_1 beside AVX2's Q5_0) runs them all on the AVX2
    one."""
    model = str(every_type_gguf())
    with caplog.at_level(logging.WARNING), \
            LLM(model, dtype="bfloat16", quantization="gguf", **ENGINE_ARGS) as llm:
        layers = llm.runtime.engine.model.layers
        assert layers[0].self_attn.qkv_proj.quantized is not None
        assert layers[0].mlp.gate_up_proj.quantized is not None
        assert layers[0].mlp.down_proj.quantized is not None  # Q4_K
        assert layers[1].mlp.down_proj.quantized is not None  # Q6_K
        assert layers[1].self_attn.o_proj.quantized is not None  # Q5_0
        assert layers[1].mlp.gate_up_proj.quantized is not None  # Q5_1 beside Q5_0
        assert layers[2].self_attn.qkv_proj.quantized is None  # F32, F16, BF16
        assert layers[2].self_attn.o_proj.quantized.kind == "MXFP4"
        mixed = layers[1].self_attn.qkv_proj.quantized  # Q4_1 beside Q5_0, Q8_0
        assert isinstance(mixed, StackedWeight)
        assert [p.kind for p in mixed.parts] == ["Q4_1", "Q5_0", "Q8_0"]
        for prompt, out in generate(llm):
            assert_matches_transformers(hf_model(model), prompt, out, TOP2_MARGIN_BF16,
                                        BF16_LOGPROB_TOLERANCE)
    warnings = [r.getMessage() for r in caplog.records if "run dequantized" in r.getMessage()]
    assert len(warnings) == 1 and "TQ1_0" in warnings[0] and "Q4_K" not in warnings[0], warnings
    assert "MXFP4" not in warnings[0], warnings


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_layer_override_serves_the_first_layers(quantization: str):
    """`{"num_hidden_layers": 2}` on the bundled 30-layer GGUF: the tensors of layers 2..29 are
    skipped by the safetensors loader and (gguf) the block reader alike, and the model is the
    checkpoint's first two layers: transformers with the same override."""
    dtype, bounds = (("float32", (ref.TOP2_MARGIN_BOUND, FLOAT32_LOGPROB_TOLERANCE))
                     if quantization == "none" else
                     ("bfloat16", (TOP2_MARGIN_BF16, BF16_LOGPROB_TOLERANCE)))
    with LLM(dtype=dtype, quantization=quantization, **ENGINE_ARGS,
             json_model_override_args='{"num_hidden_layers": 2}') as llm:
        assert len(llm.runtime.engine.model.layers) == 2
        for prompt, out in generate(llm):
            assert_matches_transformers(hf_model(None, 2), prompt, out, *bounds)


def test_a_tensor_the_model_does_not_have_is_a_one_line_error(tmp_path: Path):
    """Only layers past the model's depth are skipped: any other stray tensor still fails the
    load, naming it."""
    from safetensors.torch import save_file
    folder = resolve_model_path(None)
    for file in folder.iterdir():
        os.symlink(file, tmp_path / file.name)
    save_file({"model.layers.0.mlp.extra.weight": torch.zeros(4)},
              str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError) as error:
        LLM(str(tmp_path), dtype="float32", **ENGINE_ARGS,
            json_model_override_args='{"num_hidden_layers": 2}')
    message = str(error.value)
    assert "unknown tensors ['model.layers.0.mlp.extra.weight']" in message, message
    assert "\n" not in message


def test_the_cheap_reads_give_the_readers_own_fields_and_tensors(monkeypatch):
    """minisgl.models.gguf_reader's reads (plain views of the mapping, not memmap slices):
    every field's parts and every tensor's bytes as the gguf package's own reads give them."""
    from gguf import GGUFReader

    from minisgl.models import gguf_reader
    from minisgl.models.weights import bundled_gguf
    gguf_reader.install()
    assert gguf_reader.stock_get is not None, "this gguf release keeps its own reads"
    ours = gguf_reader.gguf_reader(bundled_gguf())
    monkeypatch.setattr(GGUFReader, "_get", gguf_reader.stock_get)
    theirs = GGUFReader(str(bundled_gguf()))
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        mine = ours.fields[name]
        assert mine.types == field.types and mine.data == field.data, name
        assert len(mine.parts) == len(field.parts), name
        assert all(np.array_equal(a, b) and a.dtype == b.dtype
                   for a, b in zip(mine.parts, field.parts)), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, tensor in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == tensor.tensor_type and mine.shape.tolist() == \
            tensor.shape.tolist() and np.array_equal(mine.data, tensor.data), tensor.name
