"""Quantized Hugging Face checkpoints on CPU: the bundled model written as
AWQ, GPTQ, compressed-tensors int4 and block-wise fp8 (tests.hf_quant_writers) loads without a
dense copy and matches transformers in float32 on the weights each checkpoint encodes; TP 3
equals TP 1 on one int4 format; layouts and methods we cannot run are one-line errors naming
what we support."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl import LLM
from minisgl.layers.gguf_weight import GgufWeight, StackedWeight, block_kernels
from minisgl.models.hf_quant import int4_blocks
from tests import reference as ref
from tests.hf_quant_writers import write_checkpoint
from tests.test_gguf_types import assert_matches_transformers

pytestmark = pytest.mark.skipif(block_kernels() is None, reason="needs the AVX2 block kernel")

ENGINE_ARGS = dict(max_total_tokens=1024, max_running_requests=2)
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
# int4: the checkpoint's codes, scales and zero points exactly; the error is the activations'
# (~15 bits) as for the GGUF k-quants: every greedy token the reference's argmax. fp8: each
# weight re-encoded per 32 inputs as int8 (at most max/254 of its group off), so a token may
# trail the reference's argmax where its top two are close (0.075 measured; the bound is
# bfloat16's, tests.test_gguf_types). Logprobs: relative, as there; measured 1e-3 (int4) with
# kernels built for AVX2, up to 3.3e-3 (4.3e-3 TP 3 against TP 1) where they are built for
# AVX-512 (a Zen 4 EPYC: -march=native's 512-bit auto-vectorised float kernels round otherwise;
# with -mprefer-vector-width=256 it passes 3e-3); 0.050 (fp8: an error of bfloat16's order,
# whose bound this is).
MARGIN_BOUND = {"int4": 0.05, "fp8": 0.25}
LOGPROB_TOLERANCE = {"int4": 6e-3, "fp8": 0.06}
# (method, group size (-1: a scale per row), symmetric); the model's 576-wide rows take
# groups of 32 or 64 (128 is tested on the kernel alone, below)
FORMATS = [("awq", 64, False), ("gptq", 32, True), ("compressed-tensors", 32, False),
           ("compressed-tensors", -1, True), ("fp8", 0, False)]


@functools.lru_cache(maxsize=None)
def checkpoint(root: str, method: str, group: int, symmetric: bool) -> tuple[Path, Path]:
    return write_checkpoint(Path(root), method, group, symmetric)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hf-quant"))


def generate(llm: LLM) -> list[tuple[list[int], dict]]:
    prompts = [ref.prompt_ids(p) for p in ref.PLAIN_PROMPTS[:2]]
    outs = llm.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                        logprob_start_len=0)
    llm.check_integrity()
    return list(zip(prompts, outs))


@pytest.mark.parametrize("method,group,symmetric", FORMATS)
def test_quantized_checkpoint_matches_its_dense_reference(root: str, method: str, group: int,
                                                          symmetric: bool):
    from transformers import AutoModelForCausalLM
    folder, dense = checkpoint(root, method, group, symmetric)
    with LLM(str(folder), dtype="float32", **ENGINE_ARGS) as llm:
        engine = llm.runtime.engine
        assert engine.quantization == method
        layer = engine.model.layers[0]
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear.quantized, (GgufWeight, StackedWeight))
            assert linear.weight is None  # no dense copy kept
        assert layer.mlp.down_proj.quantized.kind == ("Q8_0" if method == "fp8" else "W4")
        results = generate(llm)
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    shutil.rmtree(dense)  # the model in float32, read once; the checkpoint stays for others
    kind = "fp8" if method == "fp8" else "int4"
    for prompt, out in results:
        assert_matches_transformers(hf, prompt, out, MARGIN_BOUND[kind], LOGPROB_TOLERANCE[kind])


def test_tp3_equals_tp1_on_int4(root: str):
    """AWQ groups of 64: o_proj's 576 inputs cut into 3 x 192 (3 groups each), down_proj's
    1536 into 3 x 512. The ranks' partial sums add up in another order, and the activations'
    int8 terms round on what differs: logprobs within the reference bound (1.7e-3 measured with
    AVX2 kernels, 4.3e-3 with AVX-512 ones)."""
    folder, _ = checkpoint(root, "awq", 64, False)
    results = []
    for tp in (1, 3):
        with LLM(str(folder), dtype="float32", tp_size=tp, **ENGINE_ARGS) as llm:
            results.append(generate(llm))
    for (_, one), (_, three) in zip(*results):
        assert one["output_ids"] == three["output_ids"]
        lp1 = torch.tensor([lp for lp, _, _ in one["meta_info"]["output_token_logprobs"]])
        lp3 = torch.tensor([lp for lp, _, _ in three["meta_info"]["output_token_logprobs"]])
        assert (lp1 - lp3).abs().max() < LOGPROB_TOLERANCE["int4"]


@pytest.mark.parametrize("group", [32, 64, 128, 384])
def test_int4_groups_run_on_the_kernel(group: int):
    """Any group of whole 32-input groups: the kernel's super-block holds its scale."""
    gen = torch.Generator().manual_seed(group)
    codes = torch.randint(0, 16, (24, 768), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(24, 768 // group, generator=gen) * 0.01).half()
    zeros = torch.randint(0, 16, (24, 768 // group), generator=gen)
    blocks = int4_blocks(codes, scales, zeros)
    want = ((codes.double() - zeros.repeat_interleave(group, 1))
            * scales.double().repeat_interleave(group, 1))
    assert torch.equal(blocks.dequantize().double(), want)
    weight = GgufWeight(blocks)
    assert torch.equal(weight.rows().double(), want)
    for rows in (1, 5, 200):
        x = torch.randn(rows, 768, generator=gen)
        exact = x.double() @ want.t()
        assert ((weight.matmul(x) - exact).abs().max() / exact.abs().max()) < 2e-4


def test_gptq_v1_and_v2_zero_points_read_alike():
    """AutoGPTQ's format stores each zero point minus one, gptq_v2 the zero point itself."""
    from minisgl.models.hf_quant import quant_spec, read_int4
    from tests.hf_quant_writers import gptq_tensors, int4_groups, pack_rows
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    codes, scales, zeros = int4_groups(weight, 64, symmetric=False)
    zeros = zeros.clamp(min=1)  # v1 cannot store a zero point of 0
    v1 = gptq_tensors(codes, scales, zeros)
    v2 = dict(v1, qzeros=pack_rows(zeros.t().contiguous()))
    base = {"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False}
    one = read_int4(quant_spec({"quantization_config": base}), v1)
    two = read_int4(quant_spec({"quantization_config": {**base, "checkpoint_format":
                                                        "gptq_v2"}}), v2)
    want = (codes - zeros.repeat_interleave(64, 1)).float() * scales.float().repeat_interleave(
        64, 1)
    assert torch.equal(one.dequantize(), want) and torch.equal(two.dequantize(), want)


def test_a_shard_that_splits_a_group_is_refused():
    codes = torch.zeros(8, 576, dtype=torch.uint8)
    blocks = int4_blocks(codes, torch.ones(8, 576 // 64), torch.zeros(8, 576 // 64))
    assert blocks[:, 192:384].shape == (8, 192)
    with pytest.raises(ValueError, match="multiples of 64"):
        blocks[:, 0:96]


def serve_error(folder: Path, *flags: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "minisgl", "serve", "--model", str(folder),
                           "--port", "0", *flags], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    return proc.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("change,message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' cannot be loaded; "
                                       "supported: awq"),
    ({"version": "gemv"}, "AWQ version 'gemv'"),
    ({"bits": 3}, "bits 3"),
    ({"group_size": 48}, "group_size 48"),
])
def test_what_we_cannot_run_is_a_one_line_error(root: str, tmp_path: Path, change: dict,
                                                message: str):
    folder, _ = checkpoint(root, "awq", 64, False)
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in folder.iterdir():
        (bad / file.name).symlink_to(file)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(change)
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    assert message in serve_error(bad)


def test_a_tp_size_that_splits_a_group_is_a_one_line_error(root: str):
    """Channel-wise scales (one group per row): o_proj / down_proj cannot be row-sharded."""
    folder, _ = checkpoint(root, "compressed-tensors", -1, True)
    line = serve_error(folder, "--tp-size", "3")
    assert "must cut at multiples of" in line and "tensor-parallel size" in line, line


def test_another_method_than_the_checkpoints_is_refused(root: str):
    folder, _ = checkpoint(root, "awq", 64, False)
    line = serve_error(folder, "--quantization", "gptq")
    assert "the checkpoint is quantized (awq): --quantization gptq cannot load it" in line


EXPERT_LINEARS = ("_proj", ".w1", ".w2", ".w3")  # attention, dense MLPs and every expert's


def write_tiny_moe(root: Path, kind: str, method: str, group: int = 32,
                   symmetric: bool = False) -> tuple[Path, Path]:
    """A tiny random mixture of experts (tests.test_moe) as a quantized checkpoint, and the
    dense folder of the weights it encodes."""
    from tests.hf_quant_writers import write_quantized
    from tests.test_model_configs import save_tiny
    from tests.test_moe import MODELS
    model_class, config_class, fields = MODELS[kind]
    save_tiny(model_class, config_class, root / "source", **fields)
    quantized, dense = root / method, root / f"{method}-dense"
    write_quantized(root / "source", quantized, dense, method, group, symmetric,
                    EXPERT_LINEARS)
    return quantized, dense


@pytest.mark.parametrize("kind,method", [("qwen3-moe-mixed", "awq"), ("mixtral", "gptq"),
                                         ("qwen3-moe", "fp8")])
def test_quantized_experts_match_their_dense_reference(tmp_path: Path, kind: str, method: str):
    """Expert weights as the checkpoint stores them (Qwen3-MoE's and Mixtral's names), each
    expert's gate and up joined, kept in blocks (no dense copy): greedy tokens and logprobs
    against transformers in float32 on the weights the checkpoint encodes, bounds as above."""
    from transformers import AutoModelForCausalLM
    quantized, dense = write_tiny_moe(tmp_path, kind, method, symmetric=method == "gptq")
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (7, 30)]
    with LLM(str(quantized), dtype="float32", **ENGINE_ARGS) as llm:
        experts = llm.runtime.engine.model.layers[0].mlp.experts
        assert experts.gate_up is None and len(experts.quantized.parts) == experts.num_experts
        gate_up, down = experts.quantized.parts[0]
        assert isinstance(gate_up, (GgufWeight, StackedWeight))
        assert gate_up.out_features == 2 * experts.shard and down.in_features == experts.shard
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                            logprob_start_len=0)
        llm.check_integrity()
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    bound = "fp8" if method == "fp8" else "int4"
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out, MARGIN_BOUND[bound],
                                    LOGPROB_TOLERANCE[bound])


def test_a_quantized_router_is_a_one_line_refusal(tmp_path: Path):
    """What minisgl reads only dense (the router here), quantized: refused at start, named."""
    from minisgl.engine import Engine, EngineConfig
    from tests.hf_quant_writers import write_quantized
    write_tiny_moe(tmp_path, "qwen3-moe", "awq")
    write_quantized(tmp_path / "source", tmp_path / "router", tmp_path / "router-dense", "awq",
                    32, False, EXPERT_LINEARS + ("mlp.gate",))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate\.weight is quantized"):
        Engine(EngineConfig(model_path=str(tmp_path / "router"), dtype="float32",
                            max_total_tokens=256))


def test_linears_a_checkpoint_left_dense_stay_dense(tmp_path: Path):
    """An fp8 checkpoint whose down projections are not quantized (its `ignore` list): they
    load as the dense weights they are, never quantized again (a per-channel fp8 copy would be
    another model, and runs on CUDA only)."""
    from minisgl.models import resolve_model_path
    from tests.hf_quant_writers import LINEARS, write_quantized
    from transformers import AutoModelForCausalLM
    quantized, dense = tmp_path / "fp8", tmp_path / "fp8-dense"
    write_quantized(resolve_model_path(None), quantized, dense, "fp8", 0, False,
                    tuple(name for name in LINEARS if name != "mlp.down_proj"))
    with LLM(str(quantized), dtype="float32", **ENGINE_ARGS) as llm:
        layer = llm.runtime.engine.model.layers[0]
        assert layer.mlp.down_proj.quantized is None and layer.mlp.down_proj.weight is not None
        assert isinstance(layer.mlp.gate_up_proj.quantized, GgufWeight)
        results = generate(llm)
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    for prompt, out in results:
        assert_matches_transformers(hf, prompt, out, MARGIN_BOUND["fp8"], LOGPROB_TOLERANCE["fp8"])
