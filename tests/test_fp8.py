"""`--quantization fp8`: linear weights float8 e4m3 with a scale per output feature,
weight-only, through the Triton kernel (kernels/fp8_matmul.py) for decode batches of up to
KERNEL_MAX_ROWS rows and widen + cuBLAS above. The kernel is checked against float64 math on
the same fp8 weights (what is left is bfloat16 rounding); the method, against the float32 model
on the original weights, with bounds of its own beside what was measured on an H100 (bundled
SmolLM2; BENCHMARKS.md, "GPU (H100 / H200)"): logits relative error 0.073-0.076 /
0.103-0.111 (long / short prompt, two runs; dense bf16 0.016 / 0.026); perplexity of the
paragraph twice 4.188-4.205 (fp32 4.105, bf16 4.089): e4m3 keeps 3 mantissa bits, so it costs
a 135M model 2-2.4% of perplexity (w8a8_int8, int8 weights per feature and int8 activations,
costs 0.2%).

Needs a CUDA GPU of compute capability 8.9+ (skipped elsewhere), except the quantization's
rounding, the one-line refusal on CPU, and the kernels' indexing under Triton's interpreter
(where triton >= 3.9 is installed)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path
import sys

import pytest
import torch

from minisgl.layers.fp8 import FP8_MAX, KERNEL_MAX_ROWS, Fp8ChannelWeight, fp8_unavailable
from tests.test_quantization import relative_error
from tests.test_gpu import real_model  # noqa: F401  (a fixture)

needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_unavailable(torch.device("cuda")) is not None,
    reason="needs a CUDA GPU with float8 (compute capability 8.9+) and triton")

LOGIT_REL_BOUND = 0.15  # measured 0.111 at most (above)
PERPLEXITY_REL_BOUND = 0.04  # measured +2.4% at most
TOP2_MARGIN = 0.5  # logit units: where an fp8 greedy run may leave the fp32 one
KERNEL_REL_BOUND = 1e-2  # bf16 activations and output against float64 on the same weights


def test_fp8_weight_is_per_channel_e4m3_rounding_of_the_dense_one():
    """Each value within half an e4m3 step of the dense one: 1/16 of its magnitude for normal
    numbers, 2^-10 of the feature's scale in the subnormal range."""
    gen = torch.Generator().manual_seed(0)
    dense = torch.randn(48, 96, generator=gen) * 0.05
    dense[3] = 0  # an all-zero feature keeps a finite scale
    weight = Fp8ChannelWeight(dense)
    assert weight.codes.dtype == torch.float8_e4m3fn and weight.nbytes == 48 * 96 + 48 * 4
    assert weight.codes.float().abs().amax(dim=1)[[0, 1, 2]].eq(FP8_MAX).all()
    bound = torch.maximum(dense.abs() / 16, weight.scales[:, None] * 2**-10)
    assert ((weight.dequantized() - dense).abs() <= bound * 1.001).all()
    assert torch.isfinite(weight.dequantized()).all() and weight.dequantized()[3].eq(0).all()


def interpreter_runs_the_kernel() -> bool:
    """Triton's interpreter from 3.9 (3.6's cannot run a loop bounded by a runtime argument)."""
    if importlib.util.find_spec("triton") is None:
        return False
    from importlib.metadata import version
    major, minor = (int(part) for part in version("triton").split(".")[:2])
    return (major, minor) >= (3, 9)


def run_interpreted(code: str, timeout: int = 300) -> None:
    """Python `code` in a child process with TRITON_INTERPRET=1 (read at import), from the
    repository root; it must print "ok"."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=timeout,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


@pytest.mark.skipif(not interpreter_runs_the_kernel(), reason="needs triton >= 3.9")
def test_fp8_kernel_indexing_under_the_interpreter():
    """The kernels' tiles, masks and strides on CPU tensors (TRITON_INTERPRET=1, in a child
    process: the flag is read at import), the matmul in both inner loops and the one-pass
    dequantization. float32 activations: the interpreter's bfloat16 dot is not the GPU's."""
    script = r"""
import torch, triton
from minisgl.kernels import fp8_matmul
from minisgl.layers.fp8 import Fp8ChannelWeight
gen = torch.Generator().manual_seed(0)
configs = [dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=256, DOT=False),
           dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, DOT=True)]
for n, k in ((40, 96), (48, 576), (16, 300)):
    w = Fp8ChannelWeight(torch.randn(n, k, generator=gen) * 0.05)
    for cfg in configs:
        for m in ((1,) if not cfg["DOT"] else (1, 3, 17)):
            x = torch.randn(m + 2, k, generator=gen)[1:m + 1]  # a row stride, not contiguous
            out = torch.full((m, n), float("nan"))
            grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
            fp8_matmul._fp8_matmul_kernel.fn[grid](x, w.codes, w.scales, out, m, n, k, m,
                                                   x.stride(0), w.codes.stride(0),
                                                   out.stride(0), 1, 0, **cfg)
            want = x.double() @ w.dequantized().double().t()
            err = float((out.double() - want).norm() / want.norm())
            assert err < 1e-5, (n, k, m, cfg, err)
    widened = fp8_matmul.fp8_dequantize(w.codes, w.scales, torch.float32)
    assert torch.equal(widened, w.dequantized()), (n, k)
print("ok")
"""
    run_interpreted(script)


@pytest.mark.usefixtures("real_model")  # else the first line is its absence
def test_fp8_that_cannot_run_is_one_line():
    done = subprocess.run([sys.executable, "-m", "minisgl", "generate", "--prompt", "hi",
                           "--max-new-tokens", "1", "--quantization", "fp8", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "fp8: it runs on CUDA GPUs only" in lines[0], done.stderr


@needs_fp8_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("out_features,in_features", [(40, 96), (48, 576), (1536, 576),
                                                      (6144, 4096), (4096, 14336)])
def test_fp8_matmul_is_the_product_of_the_fp8_weights(out_features: int, in_features: int):
    """Both paths (kernel up to KERNEL_MAX_ROWS, widen + cuBLAS above) against float64 math on
    the dequantized fp8 weights, at row counts around the tiles and the switch, on a strided
    input; the output is fully written (no NaN from torch.empty)."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    dense = torch.randn(out_features, in_features, device="cuda", generator=gen) * 0.02
    weight = Fp8ChannelWeight(dense.to(torch.bfloat16))
    want_weight = weight.dequantized().double()
    for rows in (1, 2, 3, 16, 17, 64, 65, 160, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 1000):
        x = torch.randn(rows, in_features + 8, device="cuda", generator=gen)
        x = x.to(torch.bfloat16)[:, 4:in_features + 4]
        got = weight.matmul(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
        err = relative_error(got, x.double() @ want_weight.t())
        assert err < KERNEL_REL_BOUND, (rows, err)
    x = torch.randn(2, 3, in_features, device="cuda", generator=gen).to(torch.bfloat16)
    assert torch.equal(weight.matmul(x), weight.matmul(x.view(6, -1)).view(2, 3, -1))


@needs_fp8_gpu
@pytest.mark.gpu
def test_fp8_matmul_replays_in_a_cuda_graph():
    gen = torch.Generator(device="cuda").manual_seed(2)
    weight = Fp8ChannelWeight(torch.randn(1536, 576, device="cuda", generator=gen) * 0.02)
    x = torch.randn(8, 576, device="cuda", generator=gen).to(torch.bfloat16)
    eager = weight.matmul(x)  # autotunes outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = weight.matmul(x)
    x.copy_(torch.randn(8, 576, device="cuda", generator=gen))
    graph.replay()
    assert torch.equal(out, weight.matmul(x)) and not torch.equal(out, eager)


@pytest.fixture(scope="module")
def real_logits():
    """Prefill logits of a prompt longer than KERNEL_MAX_ROWS (the widened weights) and of one
    shorter (the kernel)."""
    from minisgl.engine import Engine, EngineConfig
    from tests import reference as ref
    from tests.engine_probe import prefill_logits
    from tests.test_quantization import ENGINE_ARGS, TEXT
    try:
        prompts = {"long": ref.prompt_ids(TEXT + "\n\n" + TEXT),
                   "short": ref.prompt_ids(ref.chat_prompt("Name a prime."))}
    except Exception as exc:  # the bundled SmolLM2 is not installed
        pytest.skip(f"bundled model not available: {exc}")
    assert len(prompts["long"]) > KERNEL_MAX_ROWS > len(prompts["short"])  # both paths
    out = {}
    for name, extra in (("fp32", dict(dtype="float32")),
                        ("bf16", dict(dtype="bfloat16", quantization="none")),
                        ("fp8", dict(dtype="bfloat16", quantization="fp8"))):
        engine = Engine(EngineConfig(device="cuda", **ENGINE_ARGS, **extra))
        if name == "fp8":
            down = engine.model.layers[0].mlp.down_proj
            assert isinstance(down.quantized, Fp8ChannelWeight) and down.weight is None
        out[name] = {k: prefill_logits(engine, ids) for k, ids in prompts.items()}
        engine.shutdown()
    return prompts, out


@needs_fp8_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("prompt", ["long", "short"])
def test_fp8_logits_match_the_reference(real_logits, prompt: str):
    _, logits = real_logits
    err = relative_error(logits["fp8"][prompt], logits["fp32"][prompt])
    bf16 = relative_error(logits["bf16"][prompt], logits["fp32"][prompt])
    print(f"\nfp8 logits relative error ({prompt}): {err:.4f} (bf16 {bf16:.4f})")
    assert err < LOGIT_REL_BOUND, err
    assert torch.isfinite(logits["fp8"][prompt]).all()


@needs_fp8_gpu
@pytest.mark.gpu
def test_fp8_perplexity_matches(real_logits):
    from tests.test_quantization import perplexity
    prompts, logits = real_logits
    got = {m: perplexity(logits[m]["long"], prompts["long"]) for m in ("fp32", "bf16", "fp8")}
    print(f"\nperplexity: {got}")
    assert abs(got["fp8"] - got["fp32"]) / got["fp32"] < PERPLEXITY_REL_BOUND, got


@needs_fp8_gpu
@pytest.mark.gpu
def test_fp8_greedy_agrees_with_the_reference(real_logits):
    from tests.test_quantization import assert_greedy_agrees
    assert_greedy_agrees("fp8", TOP2_MARGIN)


@needs_fp8_gpu
@pytest.mark.gpu
def test_dummy_fp8_weights_build_for_the_8b_shape():
    """Llama-3.1-8B's shapes (2 layers), CUDA graphs on: every linear is fp8, the weights' size
    is what fp8 promises, and decode runs."""
    from minisgl import LLM
    with LLM("llama-3.1-8b", load_format="dummy", quantization="fp8", dtype="bfloat16",
             device="cuda", json_model_override_args='{"num_hidden_layers": 2}',
             max_total_tokens=4096, max_running_requests=8) as llm:
        engine = llm.runtime.engine
        layer = engine.model.layers[0]
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_up_proj, layer.mlp.down_proj):
            assert isinstance(linear.quantized, Fp8ChannelWeight) and linear.weight is None
        assert layer.mlp.down_proj.quantized.nbytes == 4096 * 14336 + 4096 * 4
        out = llm.generate(input_ids=[[5, 6, 7], [8, 9]], sampling_params={"max_new_tokens": 4})
        assert [len(o["output_ids"]) for o in out] == [4, 4]
        llm.check_integrity()
