"""Quantized checkpoints on CUDA (layers.gpu_blocks): AWQ, GPTQ and
compressed-tensors int4 and block-wise / per-channel fp8 weights kept as the checkpoint stores
them, through the Triton kernels kernels/int4_matmul and kernels/fp8_matmul.

Here (no GPU needed): each format's staged blocks become the CUDA form encoding exactly the
weights the checkpoint does; block-wise fp8 shards cut at whole blocks; and the kernels' tiles,
masks, strides and group / block scales run under Triton's interpreter (TRITON_INTERPRET=1, in
a child process; triton >= 3.9) against float64 math on the same weights. On a CUDA GPU: the
kernels at the Llama-3.1-8B shapes, and the bundled model's checkpoints served in bfloat16
against transformers in float32 on the weights each encodes."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Callable

import pytest
import torch

from minisgl.layers.fp8 import Fp8ChannelWeight, fp8_unavailable
from minisgl.layers.gguf_weight import BlockSlots
from minisgl.layers.gpu_blocks import Fp8Blocks, Int4GroupWeight, gpu_block_weight
from minisgl.models.hf_quant import fp8_blocks, quant_spec, read_int4
from tests import hf_quant_writers as writers
from tests import reference as ref
from tests.test_fp8 import interpreter_runs_the_kernel, run_interpreted
from tests.test_gpu import real_model  # noqa: F401  (a fixture: skips without the bundled model)

# (method, group, symmetric): every int4 layout and group form the loader takes
INT4_FORMATS = [("awq", 64, False), ("awq", 128, True), ("gptq", 32, True),
                ("gptq", 128, False), ("compressed-tensors", 32, False),
                ("compressed-tensors", -1, True)]
KERNEL_REL_BOUND = 1e-5  # float32 activations under the interpreter, against float64


def int4_weight(method: str, group: int, symmetric: bool, out: int, in_features: int,
                seed: int = 0) -> tuple[Int4GroupWeight, torch.Tensor]:
    """(the CUDA form, built on CPU, of a checkpoint tensor in `method`'s layout, the float32
    weight the checkpoint encodes)."""
    weight = torch.randn(out, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    codes, scales, zeros = writers.int4_groups(weight, group, symmetric)
    tensors = {"awq": writers.awq_tensors, "gptq": writers.gptq_tensors}[method](
        codes, scales, zeros) if method != "compressed-tensors" else \
        writers.compressed_tensors(codes, scales, zeros, symmetric)
    config = {"quantization_config": writers.CONFIGS[method](group, symmetric)}
    blocks = read_int4(quant_spec(config), tensors)
    return Int4GroupWeight(blocks, torch.device("cpu")), writers.dequantized(codes, scales, zeros)


def fp8_weight(out: int, in_features: int, seed: int = 0
               ) -> tuple[Fp8ChannelWeight, torch.Tensor]:
    """A block-wise fp8 tensor staged in row parts as q / k / v would be (cuts off the
    128-row blocks), joined: (the CUDA form, the weight the checkpoint encodes)."""
    weight = torch.randn(out, in_features, generator=torch.Generator().manual_seed(seed)) * 0.05
    tensors, encoded = writers.fp8_block(weight)
    staged = fp8_blocks(tensors)
    slots = BlockSlots(out, in_features)
    cuts = [0, out // 3, out // 3 + out // 4, out]
    for start, stop in zip(cuts, cuts[1:]):
        slots.narrow(0, start, stop - start).copy_(staged[start:stop])
    return gpu_block_weight(slots, torch.device("cpu")), encoded


@pytest.mark.parametrize("method,group,symmetric", INT4_FORMATS)
def test_int4_cuda_form_encodes_the_checkpoint_exactly(method: str, group: int,
                                                       symmetric: bool):
    weight, want = int4_weight(method, group, symmetric, 48, 768)
    assert torch.equal(weight.dequantized(), want)
    assert weight.group == (768 if group == -1 else group)
    assert weight.words.dtype == torch.int32 and weight.words.shape == (48, 96)
    assert weight.nbytes < want.numel() * 0.6  # half a byte a weight, plus the groups


def test_fp8_cuda_form_keeps_the_checkpoint_codes():
    """Block-wise: 576 rows and inputs (4.5 blocks), staged in parts that cut inside a 128-row
    block; per-channel and per-tensor scales too."""
    weight, want = fp8_weight(576, 576)
    assert weight.scale_group == 128 and weight.scales.shape == (576, 5)
    assert torch.equal(weight.dequantized(), want)
    codes = torch.randn(40, 96).to(torch.float8_e4m3fn)
    per_channel = torch.rand(40, 1) + 0.5
    for scale in (per_channel, torch.tensor(0.25)):
        staged = fp8_blocks({"weight": codes, "weight_scale": scale})
        slots = BlockSlots(40, 96)
        slots.copy_(staged)
        form = gpu_block_weight(slots, torch.device("cpu"))
        assert form.scale_group == 0
        assert torch.equal(form.dequantized(), codes.float() * scale.reshape(-1, 1).expand(40, 1))


def test_fp8_block_shards_cut_at_whole_blocks():
    blocks = Fp8Blocks(torch.zeros(8, 576).to(torch.float8_e4m3fn), torch.ones(8, 5), 128)
    assert blocks[:, 128:256].scales.shape == (8, 1)
    assert blocks[:, 384:576].scales.shape == (8, 2)  # the last, partial block
    with pytest.raises(ValueError, match="multiples of 128"):
        blocks[:, 0:192]


def test_gpu_forms_refuse_other_kinds():
    from minisgl.layers.gguf_weight import GgufBlocks
    q8 = GgufBlocks("Q8_0", torch.zeros(8, 64, dtype=torch.int8), torch.ones(8, 2, 2), None)
    slots = BlockSlots(8, 64)
    slots.copy_(q8)
    with pytest.raises(ValueError, match="no GPU kernel"):
        gpu_block_weight(slots, torch.device("cpu"))


def test_int4_autotuner_keeps_a_config_for_every_layout():
    """Every group form the loader takes (multiples of 32 inputs, whole rows) and row bucket
    leaves the autotuner tiles that fit the groups (an empty list fails at the first launch)."""
    pytest.importorskip("triton")
    from minisgl.kernels import int4_matmul
    configs = int4_matmul._configs()
    for k, group in ((576, 32), (576, 64), (576, 576), (4096, 128), (4096, 4096), (96, 96)):
        for bucket in (1, 2, 4, 8, 16, 64, 256):
            kept = int4_matmul._prune(configs, {"GROUP": group, "K": k, "M_BUCKET": bucket})
            assert kept and all(int4_matmul.tile_fits_group(c.kwargs["BLOCK_K"], group, k)
                                for c in kept if c.kwargs["DOT"]), (k, group, bucket)
            assert any(c.kwargs["DOT"] for c in kept) or bucket <= 4
            assert bucket > 1 or not any(c.kwargs["DOT"] for c in kept)


def _interpreted_kernel_checks() -> None:
    """Run in a child with TRITON_INTERPRET=1: every inner loop, group form and mask."""
    import triton

    from minisgl.kernels import fp8_matmul, int4_matmul
    gen = torch.Generator().manual_seed(1)

    def check(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, what: object) -> None:
        want = x.double() @ weight.double().t()
        err = float((out.double() - want).norm() / want.norm())
        assert err < KERNEL_REL_BOUND, (what, err)

    def strided_rows(m: int, k: int) -> torch.Tensor:
        return torch.randn(m + 2, k + 8, generator=gen)[1:m + 1, 4:k + 4]

    for method, group, symmetric in INT4_FORMATS:
        for n, k in ((40, 256), (48, 576)):
            if group > 0 and k % group:
                continue
            weight, want = int4_weight(method, group, symmetric, n, k, seed=n + k)
            g = weight.group
            tile_k = min(128, g) if g != k else 128
            for cfg in (dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=tile_k, DOT=False),
                        dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, DOT=False),
                        dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=tile_k, DOT=True),
                        dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=tile_k, DOT=True)):
                assert cfg["DOT"] is False or int4_matmul.tile_fits_group(tile_k, g, k)
                for m in ((1, 2) if not cfg["DOT"] else (1, 3, 17)):
                    x = strided_rows(m, k)
                    out = torch.full((m, n), float("nan"))
                    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
                    int4_matmul._int4_matmul_kernel.fn[grid](
                        x, weight.words, weight.scales, weight.zeros, out, m, n, k, m,
                        x.stride(0), weight.words.stride(0), weight.scales.stride(0),
                        out.stride(0), g, **cfg)
                    check(out, x, want, (method, group, n, k, m, cfg))
            widened = int4_matmul.int4_dequantize(weight.words, weight.scales, weight.zeros,
                                                  torch.float32)
            assert torch.equal(widened, want), (method, group, n, k)

    for n, k in ((40, 256), (48, 576)):
        weight, want = fp8_weight(n, k, seed=n + k)
        for cfg in (dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=128, DOT=False),
                    dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, DOT=False),
                    dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, DOT=True)):
            for m in ((1,) if not cfg["DOT"] else (1, 3, 17)):
                x = strided_rows(m, k)
                out = torch.full((m, n), float("nan"))
                grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
                fp8_matmul._fp8_matmul_kernel.fn[grid](
                    x, weight.codes, weight.scales, out, m, n, k, m, x.stride(0),
                    weight.codes.stride(0), out.stride(0), weight.scales.stride(0), 128, **cfg)
                check(out, x, want, ("fp8 block", n, k, m, cfg))
        widened = fp8_matmul.fp8_dequantize(weight.codes, weight.scales, torch.float32, 128)
        assert torch.equal(widened, want), ("fp8 block", n, k)
    print("ok")


@pytest.mark.skipif(not interpreter_runs_the_kernel(), reason="needs triton >= 3.9")
def test_gpu_kernels_under_the_interpreter():
    run_interpreted("from tests.test_gpu_blocks import _interpreted_kernel_checks as c; c()",
                    timeout=600)


needs_int4_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_unavailable(torch.device("cuda"), (8, 0)) is not None,
    reason="needs a CUDA GPU of compute capability 8.0+ and triton")
needs_fp8_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_unavailable(torch.device("cuda")) is not None,
    reason="needs a CUDA GPU with float8 (compute capability 8.9+) and triton")
GPU_KERNEL_REL_BOUND = 1e-2  # bfloat16 activations and output against float64


def _check_on_cuda(weight, want: torch.Tensor, in_features: int,
                   kernel: Callable | None = None) -> None:
    """Both paths (kernel up to the layer's row limit, widen + cuBLAS above), strided input,
    every output written; `kernel`: also the kernel itself at every row count (its tiles)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    for rows, matmul in [(r, f) for r in (1, 2, 3, 16, 17, 64, 65, 300)
                         for f in ([weight.matmul] + ([kernel] if kernel else []))]:
        x = torch.randn(rows, in_features + 8, device="cuda", generator=gen)
        x = x.to(torch.bfloat16)[:, 4:in_features + 4]
        out = matmul(x)
        exact = x.double() @ want.double().t()
        err = float((out.double() - exact).norm() / exact.norm())
        assert out.dtype == torch.bfloat16 and err < GPU_KERNEL_REL_BOUND, (rows, err)


@needs_int4_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("out_features,in_features,group", [
    (48, 576, 64), (1536, 576, 32), (6144, 4096, 128), (4096, 14336, 128), (4096, 4096, -1)])
def test_int4_matmul_on_cuda(out_features: int, in_features: int, group: int):
    weight, want = int4_weight("awq", group, False, out_features, in_features)
    weight.words, weight.scales, weight.zeros = (t.cuda() for t in
                                                 (weight.words, weight.scales, weight.zeros))
    from minisgl.layers.gpu_blocks import _kernels
    _check_on_cuda(weight, want.cuda(), in_features, kernel=lambda x: _kernels().int4_matmul(
        x, weight.words, weight.scales, weight.zeros))  # its tiles too, past the layer's rows


@needs_fp8_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("out_features,in_features", [(48, 576), (6144, 4096), (4096, 14336)])
def test_fp8_block_matmul_on_cuda(out_features: int, in_features: int):
    weight, want = fp8_weight(out_features, in_features)
    weight.codes, weight.scales = weight.codes.cuda(), weight.scales.cuda()
    _check_on_cuda(weight, want.cuda(), in_features)


@functools.lru_cache(maxsize=None)
def _checkpoint(root: str, method: str, group: int, symmetric: bool) -> tuple[Path, Path]:
    return writers.write_checkpoint(Path(root), method, group, symmetric)


@pytest.mark.gpu
@pytest.mark.usefixtures("real_model")
@pytest.mark.parametrize("method,group,symmetric", [
    pytest.param(*f, marks=needs_fp8_gpu if f[0] == "fp8" else needs_int4_gpu)
    for f in [("awq", 64, False), ("gptq", 32, True), ("compressed-tensors", -1, True),
              ("fp8", 0, False)]])
def test_quantized_checkpoint_on_cuda(tmp_path_factory, method: str, group: int,
                                      symmetric: bool):
    """Served in bfloat16 with CUDA graphs, no dense copy kept: as close to transformers in
    float32 as the same weights served dense (assert_as_close_as_dense)."""
    from minisgl import LLM
    from tests.test_hf_quantized import ENGINE_ARGS, generate
    folder, dense = _checkpoint(str(tmp_path_factory.mktemp("hf-quant-gpu")), method, group,
                                symmetric)
    with LLM(str(folder), device="cuda", dtype="bfloat16", **ENGINE_ARGS) as llm:
        engine = llm.runtime.engine
        assert engine.quantization == method
        for linear in (engine.model.layers[0].self_attn.qkv_proj,
                       engine.model.layers[0].mlp.down_proj):
            assert isinstance(linear.quantized,
                              Fp8ChannelWeight if method == "fp8" else Int4GroupWeight)
            assert linear.weight is None
        results = generate(llm)
    assert_as_close_as_dense(dense, results)


# bfloat16 on CUDA against float32: relative logprob errors of 0.06-0.12 at the first prompt
# tokens, where the bundled model's activations are largest (H200: dense 0.056 beside AWQ g64
# 0.092, the same with either int4 kernel; compressed-tensors and fp8 within 1.5x); a kernel's
# mistake (a scale or zero point off, a code misplaced) is whole logits off
DENSE_ERROR_FACTOR = 2.0
GREEDY_MARGIN_BF16 = 0.25


def assert_as_close_as_dense(dense: Path, results: list[tuple[list[int], dict]],
                             adapter: Path | None = None, layers: int | None = None,
                             margin: float = GREEDY_MARGIN_BF16) -> None:
    """Each greedy token of `results` (a quantized checkpoint served on CUDA) within bfloat16's
    margin of the float32 reference's argmax (transformers on the weights the checkpoint
    encodes, saved in `dense`; with `adapter`, PEFT's merged model of it, cut to `layers`); its
    logprobs at most DENSE_ERROR_FACTOR times as far from the reference's (relative,
    tests.test_gguf_types.reference_gap) as the same tokens scored by `dense` (and `adapter`)
    served on CUDA in bfloat16 (or within the CPU tests' 0.06)."""
    from minisgl import LLM
    from tests.lora_fixtures import merged_model
    from tests.test_gguf_types import reference_gap
    from tests.test_hf_quantized import ENGINE_ARGS
    with LLM(str(dense), device="cuda", dtype="bfloat16", **ENGINE_ARGS,
             **lora_args(adapter, layers)) as llm:
        scored = [llm.generate(input_ids=prompt + out["output_ids"], return_logprob=True,
                               sampling_params={"max_new_tokens": 0}, logprob_start_len=0,
                               **({"lora_path": "a"} if adapter else {}))
                  for prompt, out in results]
    hf = merged_model(dense, adapter, layers)
    for (prompt, out), full in zip(results, scored):
        entries = full["meta_info"]["input_token_logprobs"]
        as_dense = {"output_ids": out["output_ids"], "meta_info": {
            "input_token_logprobs": entries[:len(prompt)],
            "output_token_logprobs": entries[len(prompt):]}}
        behind, error = reference_gap(hf, prompt, out)
        _, dense_error = reference_gap(hf, prompt, as_dense)
        assert behind <= margin, (out["output_ids"], behind)
        assert error <= max(0.06, DENSE_ERROR_FACTOR * dense_error), (error, dense_error)


def lora_args(adapter: Path | None, layers: int | None) -> dict:
    """The LLM arguments that serve `adapter` as "a" on a base cut to `layers`."""
    args: dict = {} if adapter is None else {"lora_paths": [f"a={adapter}"]}
    if layers is not None:
        args["json_model_override_args"] = json.dumps({"num_hidden_layers": layers})
    return args


@pytest.mark.gpu
@pytest.mark.usefixtures("real_model")
@pytest.mark.parametrize("method,group", [pytest.param("awq", 64, marks=needs_int4_gpu),
                                          pytest.param("fp8", 0, marks=needs_fp8_gpu)])
def test_lora_on_quantized_checkpoint_on_cuda(tmp_path_factory, method: str, group: int):
    """An adapter on an int4 / fp8 checkpoint (the bundled model cut to 4 layers) on CUDA in
    bfloat16 with graphs: its term added to the quantized kernels' output, as close to PEFT's
    merged float32 model as the same adapter on the dense weights served on CUDA."""
    from minisgl import LLM
    from tests.lora_fixtures import save_adapter
    from tests.test_hf_quantized import ENGINE_ARGS, GREEDY, MARGIN_BOUND
    root = tmp_path_factory.mktemp("hf-quant-lora-gpu")
    folder, dense = _checkpoint(str(root), method, group, False)
    layers = 4
    adapter = save_adapter(dense, root / "adapter", seed=21, rank=8, layers=layers, b_scale=8.0)
    prompts = [ref.prompt_ids(p) for p in ref.PLAIN_PROMPTS[:2]]
    with LLM(str(folder), device="cuda", dtype="bfloat16", **ENGINE_ARGS,
             **lora_args(adapter, layers)) as llm:
        linear = llm.runtime.engine.model.layers[0].mlp.down_proj
        assert isinstance(linear.quantized, Fp8ChannelWeight if method == "fp8"
                          else Int4GroupWeight) and linear.lora
        outs = llm.generate(input_ids=prompts, lora_path="a", sampling_params=GREEDY,
                            return_logprob=True, logprob_start_len=0)
        base = llm.generate(input_ids=prompts, sampling_params=GREEDY)
        llm.check_integrity()
    assert [o["output_ids"] for o in outs] != [b["output_ids"] for b in base]
    # fp8's own error (tests.test_hf_quantized.MARGIN_BOUND, in float32) beside bfloat16's
    margin = GREEDY_MARGIN_BF16 + (MARGIN_BOUND["fp8"] if method == "fp8" else 0.0)
    assert_as_close_as_dense(dense, list(zip(prompts, outs)), adapter, layers, margin)


def test_dummy_int4_groups_have_the_dense_dummy_spread():
    """`--load-format dummy --quantization awq`: random int4 groups of 128 (the row where 128
    does not divide it), std ~0.02 as the dense dummy weights, the mean half a step off 0 (codes
    - 8 in [-8, 7], as the gguf dummy's)."""
    from minisgl.models.dummy_weights import random_int4_groups
    gen = torch.Generator().manual_seed(0)
    for shape, group in (((64, 512), 128), ((64, 576), 576)):
        weight = Int4GroupWeight(random_int4_groups(shape, gen, torch.device("cpu")),
                                 torch.device("cpu"))
        values = weight.dequantized()
        assert weight.group == group
        assert abs(values.std().item() - 0.02) < 0.002 and abs(values.mean().item()) < 0.003


@needs_int4_gpu
@pytest.mark.gpu
def test_dummy_int4_model_decodes_on_cuda_with_graphs():
    """The Llama-3.1-8B shape (2 layers) with random int4 groups, as `python -m minisgl.bench gpu
    decode --quantization awq` runs it: graphs captured (each row count tuned before its capture),
    greedy decode equal to an eager run."""
    from minisgl import LLM
    outs = []
    for graphs in (True, False):
        with LLM("llama-3.1-8b", load_format="dummy", device="cuda", dtype="bfloat16",
                 quantization="awq", json_model_override_args='{"num_hidden_layers": 2}',
                 max_total_tokens=4096, disable_cuda_graph=not graphs) as llm:
            linear = llm.runtime.engine.model.layers[0].mlp.down_proj
            assert isinstance(linear.quantized, Int4GroupWeight) and linear.weight is None
            outs.append([o["output_ids"] for o in llm.generate(
                input_ids=[[1, 2, 3, 4], [5, 6, 7]],
                sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True})])
    assert outs[0] == outs[1]


@needs_int4_gpu
@pytest.mark.gpu
@pytest.mark.usefixtures("real_model")  # the bundled tokenizer
@pytest.mark.parametrize("method", ["awq", pytest.param("fp8", marks=needs_fp8_gpu)])
def test_quantized_experts_on_cuda(tmp_path: Path, method: str):
    """A tiny mixture of experts with quantized experts (per expert through its kernel) in
    bfloat16 against transformers in float32 on the weights the checkpoint encodes, as close
    as the same weights served dense (assert_as_close_as_dense)."""
    from minisgl import LLM
    from tests.test_hf_quantized import ENGINE_ARGS, GREEDY, write_tiny_moe
    quantized, dense = write_tiny_moe(tmp_path, "qwen3-moe", method)
    prompts = [[5, 17, 300, 42, 7, 99, 11], list(range(40, 70))]
    with LLM(str(quantized), device="cuda", dtype="bfloat16", **ENGINE_ARGS) as llm:
        gate_up, _ = llm.runtime.engine.model.layers[0].mlp.experts.quantized.parts[0]
        assert isinstance(gate_up, Fp8ChannelWeight if method == "fp8" else Int4GroupWeight)
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                            logprob_start_len=0)
    assert_as_close_as_dense(dense, list(zip(prompts, outs)))
