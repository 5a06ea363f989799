"""The decoder layers as one C++ call (models.fused_layers): the same kernels in the same order
as the modules, so a served run with it equals one without it to the bit, over decode,
prefill, mixed and prefix-cached batches, for Llama layers (SmolLM3's with and without RoPE;
the bundled model's default path, its Q4_1 blocks in bfloat16 through quant_matmul),
Granite 4.0-H's (Mamba2 and attention layers, its multipliers, experts), Qwen3.5's (Gated
DeltaNet and gated attention layers, experts) and Nemotron-H's blocks (its experts too); and it
stays out of what it cannot run. (Against
transformers: tests.test_gguf_kquants serves the same Q4_K_M-style file, fused;
tests.test_hybrid_gguf a Granite hybrid file.)"""

from __future__ import annotations

import functools

import pytest

from minisgl import LLM
from minisgl.layers.gguf_weight import block_kernels
from minisgl.layers.quant import VnniWeight, vnni_kernels
from minisgl.models.fused_layers import FusedLayers
from tests import reference as ref
from tests.gguf_requant import requant_gguf
from tests.test_gguf_kquants import q4_k_m_kind

pytestmark = pytest.mark.skipif(block_kernels() is None, reason="needs the AVX2 block kernel")

# layer 0: q / k Q5_0 with v Q8_0 (two kernels, one output), down Q6_K; layers 3 and 4: Q4_K
LAYERS = 6


@functools.lru_cache(maxsize=1)
def q4_k_m_six_layers() -> str:
    return str(requant_gguf(f"Q4_K_M-style-{LAYERS}-layers", q4_k_m_kind, layers=LAYERS))


class CountingFusedLayers(FusedLayers):
    calls = 0

    def __call__(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN204
        self.calls += 1
        return super().__call__(*args, **kwargs)


@functools.lru_cache(maxsize=1)
def q4_1_six_layers() -> str:
    """The bundled file's own Q4_1 blocks, which a VNNI CPU serves in bfloat16 through
    layers.quant's VnniWeight (quant_matmul), not GgufWeight."""
    return str(requant_gguf(f"Q4_1-{LAYERS}-layers", lambda name, kind: None, layers=LAYERS))


def served(fused: bool, int8_activations: bool = False, path: str | None = None,
           dtype: str = "float32", kv_cache_dtype: str = "auto") -> list[dict]:
    """Greedy outputs with every logprob: four prompts at once in chunks of 16 tokens mixed
    with the running streams' decode rows, then one prompt again (its prefix cached; its
    decode steps of one row take the one-row program where it applies). A hybrid runs the
    batches that take a prefix-cache snapshot part-way on the modules."""
    prompts = [ref.prompt_ids(p) for p in ref.PLAIN_PROMPTS[:3]]
    prompts.append(prompts[0] * 4 + prompts[1])
    params = {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}
    with LLM(path or q4_k_m_six_layers(), dtype=dtype, quantization="gguf",
             max_total_tokens=1024,
             max_running_requests=4, chunked_prefill_size=16, enable_mixed_chunk=True,
             cpu_int8_activations=int8_activations, kv_cache_dtype=kv_cache_dtype) as llm:
        model = llm.runtime.engine.model
        assert model.fused_layers is not None
        if dtype == "bfloat16" and path == q4_1_six_layers():
            assert isinstance(model.layers[0].mlp.down_proj.quantized, VnniWeight)
        counting = CountingFusedLayers(model.fused_layers.program, model.fused_layers.max_rows)
        model.fused_layers = counting if fused else None
        outs = llm.generate(input_ids=prompts, return_logprob=True, logprob_start_len=0,
                            sampling_params=params)
        outs += llm.generate(input_ids=[prompts[3]], return_logprob=True,
                             sampling_params=params)  # NOTE: prompt logprobs would recompute
        assert outs[-1]["meta_info"]["cached_tokens"] > 0
        llm.check_integrity()
        steps = llm.runtime.engine.phase_steps
        hybrid = llm.runtime.engine.arch.is_hybrid
        one_row_steps = counting.program.one_row_steps()
    assert steps["decode"] and steps["mixed"]
    if fused and dtype == "bfloat16":  # bfloat16 activations: the one-row program's
        assert one_row_steps >= params["max_new_tokens"] - 1
    else:
        assert one_row_steps == 0
    if fused and not hybrid:  # every step, prefill / mixed / decode alike
        assert counting.calls == sum(steps.values())
    elif fused:
        assert steps["decode"] < counting.calls < sum(steps.values())
    return outs


def assert_same_outputs(fused: list[dict], modules: list[dict]) -> None:
    for ours, theirs in zip(fused, modules):
        assert ours["output_ids"] == theirs["output_ids"]
        meta, expected = ours["meta_info"], theirs["meta_info"]
        assert meta["input_token_logprobs"] == expected["input_token_logprobs"]
        assert meta["output_token_logprobs"] == expected["output_token_logprobs"]


@pytest.mark.parametrize("int8_activations", [
    False, pytest.param(True, marks=pytest.mark.skipif(
        not block_kernels() or not block_kernels().block_kernel_vnni(), reason="needs VNNI"))])
def test_fused_layers_serve_the_modules_outputs_to_the_bit(int8_activations: bool):
    assert_same_outputs(served(fused=True, int8_activations=int8_activations),
                        served(fused=False, int8_activations=int8_activations))


@pytest.mark.skipif(vnni_kernels() is None, reason="needs the VNNI kernel")
@pytest.mark.parametrize(("int8_activations", "kv_cache_dtype"),
                         [(False, "auto"), (True, "auto"), (False, "int8")])
def test_fused_vnni_weight_layers_serve_the_modules_outputs_to_the_bit(int8_activations: bool,
                                                                       kv_cache_dtype: str):
    """The bundled model's default path: bfloat16 activations, its Q4_1 blocks as VnniWeight
    (and bfloat16 or int8 KV pages)."""
    def run(fused: bool) -> list[dict]:
        return served(fused, int8_activations, q4_1_six_layers(), dtype="bfloat16",
                      kv_cache_dtype=kv_cache_dtype)
    assert_same_outputs(run(fused=True), run(fused=False))


@pytest.mark.skipif(vnni_kernels() is None, reason="needs the VNNI kernel")
@pytest.mark.parametrize("int8_activations", [False, True])
def test_fused_block_layers_in_bfloat16_serve_the_modules_outputs_to_the_bit(
        int8_activations: bool):
    """The Q4_K_M-style file in bfloat16: its one-row steps take the one-row program through
    block_matmul's layouts (Q5_0 and Q8_0 parts in one linear, Q4_K, Q6_K)."""
    def run(fused: bool) -> list[dict]:
        return served(fused, int8_activations, dtype="bfloat16")
    assert_same_outputs(run(fused=True), run(fused=False))


@pytest.mark.skipif(vnni_kernels() is None, reason="needs the VNNI kernel")
@pytest.mark.parametrize(("weights", "kv_cache_dtype"),
                         [("Q4_1", "auto"), ("Q4_1", "int8"), ("Q4_K_M", "auto")])
def test_one_row_program_equals_the_batched_layers(weights: str, kv_cache_dtype: str):
    """One decode token through the one-row program against the same token in two decode rows
    through the batched path (one result each), at contexts inside one tile of 16 keys, across
    tiles, and past a page: the output and the residual equal to the bit. Q4_1: quant_matmul's
    layout; Q4_K_M: block_matmul's."""
    import torch

    from minisgl.bench.decode_step import decode_batch, fill_kv_pool

    path = q4_1_six_layers() if weights == "Q4_1" else q4_k_m_six_layers()
    with LLM(path, dtype="bfloat16", quantization="gguf", max_total_tokens=1024,
             max_running_requests=2, kv_cache_dtype=kv_cache_dtype) as llm:
        engine = llm.runtime.engine
        program = engine.model.fused_layers.program
        assert program.one_row_applies()
        hidden = engine.arch.hidden_size
        no_spans = torch.zeros(0, dtype=torch.long)

        def compare(context: int) -> None:
            batch, _ = decode_batch(engine, 1, context)
            locations, lens, rows = batch.attn_metadata.view(0, engine.attn_backend.page_table)
            x = (torch.randn(1, hidden, generator=torch.Generator().manual_seed(context))
                 .to(torch.bfloat16))
            steps = program.one_row_steps()
            one = program.run(x.clone(), batch.input_positions, batch.out_loc, locations,
                              lens, rows, no_spans, no_spans)
            assert program.one_row_steps() == steps + 1
            # two decode rows (int8 pages: a row of several tokens reads dequantized copies)
            two = program.run(x.repeat(2, 1), batch.input_positions.repeat(2),
                              batch.out_loc.repeat(2), locations.repeat(2, 1), lens.repeat(2),
                              torch.arange(2, dtype=rows.dtype), no_spans, no_spans)
            assert program.one_row_steps() == steps + 1
            for ours, batched in zip(one, two):
                assert torch.equal(ours[0], batched[0]) and torch.equal(batched[0], batched[1])

        def run() -> None:
            fill_kv_pool(engine)
            with torch.inference_mode():
                for context in (0, 5, 17, 100):
                    compare(context)
        engine.stream.call(run)


@pytest.mark.parametrize("variant", ["nope", "rope", "experts"])
def test_fused_granite_hybrid_layers_serve_the_modules_outputs_to_the_bit(variant, tmp_path):
    """A Q8_0 Granite 4.0-H file (Mamba2 and attention layers, a shared MLP; its embedding,
    attention and residual multipliers), without and with RoPE, and with experts beside the
    shared MLP."""
    from gguf import GGMLQuantizationType

    from tests.gguf_families import write_granite_hybrid_gguf
    from tests.test_hybrid_gguf import save_granite

    # blocks of 32 along every input, rows by 8 (the Mamba2 projection's: 2 x 128 + 64 + 8)
    save_granite(tmp_path / "hf", num_local_experts=4 if variant == "experts" else 0,
                 shared_intermediate_size=64, mamba_n_heads=8, mamba_d_head=16,
                 **({"position_embedding_type": "rope"} if variant == "rope" else {}))
    gguf = str(write_granite_hybrid_gguf(tmp_path / "hf", tmp_path / "tiny.Q8_0.gguf",
                                         GGMLQuantizationType.Q8_0))
    assert_same_outputs(served(fused=True, path=gguf), served(fused=False, path=gguf))


@pytest.mark.parametrize("family", ["qwen3.5", "qwen3.5-moe"])
def test_fused_qwen3_5_layers_serve_the_modules_outputs_to_the_bit(family, tmp_path):
    """A Q8_0 Qwen3.5 file (Gated DeltaNet layers with 8 value heads tiled over 2 key heads;
    gated attention with QK-norm and a quarter of each head rotating), dense or with experts
    and a gated shared expert."""
    from gguf import GGMLQuantizationType

    from tests.gguf_families import write_qwen_hybrid_gguf
    from tests.test_hybrid_gguf import save_qwen

    # rows by 8: in_proj_a / in_proj_b hold one per value head; the shared expert's down
    # takes blocks of 32
    save_qwen(family, tmp_path / "hf", linear_num_value_heads=8,
              **({"shared_expert_intermediate_size": 64} if family.endswith("moe") else {}))
    gguf = str(write_qwen_hybrid_gguf(tmp_path / "hf", tmp_path / "tiny.Q8_0.gguf",
                                      GGMLQuantizationType.Q8_0, gate_blocks=True))
    assert_same_outputs(served(fused=True, path=gguf), served(fused=False, path=gguf))


def test_fused_smollm3_layers_serve_the_modules_outputs_to_the_bit(tmp_path):
    """A Q8_0 SmolLM3 file: RoPE on three layers of four, the fourth without."""
    from gguf import GGMLQuantizationType

    from tests.gguf_families import write_smollm3_gguf
    from tests.test_smollm3 import GGUF_VOCAB, save_smollm3

    model = save_smollm3(tmp_path / "hf", vocab_size=GGUF_VOCAB)
    gguf = str(write_smollm3_gguf(model, tmp_path / "tiny.Q8_0.gguf",
                                  GGMLQuantizationType.Q8_0))
    assert_same_outputs(served(fused=True, path=gguf), served(fused=False, path=gguf))


@pytest.mark.parametrize("int8_activations", [
    False, pytest.param(True, marks=pytest.mark.skipif(
        not block_kernels() or not block_kernels().block_kernel_vnni(), reason="needs VNNI"))])
def test_fused_nemotron_h_blocks_serve_the_modules_outputs_to_the_bit(int8_activations,
                                                                      tmp_path):
    """A Q8_0 Nemotron-H file with a block of each kind: Mamba2, experts (grouped routing with
    a correction bias, scaled weights, a shared expert), attention without RoPE, a relu² MLP."""
    from gguf import GGMLQuantizationType

    from tests.gguf_families import write_nemotron_h_gguf
    from tests.test_hybrid_gguf import VOCAB
    from tests.test_nemotron_h import save_nemotron

    # rows by 8 (Mamba2's in_proj: 2 x 128 + 64 + 8), inputs by 32 (the shared expert's down)
    save_nemotron(tmp_path / "hf", "moe", vocab_size=VOCAB, mamba_num_heads=8,
                  moe_shared_expert_intermediate_size=64)
    gguf = str(write_nemotron_h_gguf(tmp_path / "hf", tmp_path / "tiny.Q8_0.gguf",
                                     GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q8_0))
    assert_same_outputs(served(fused=True, int8_activations=int8_activations, path=gguf),
                        served(fused=False, int8_activations=int8_activations, path=gguf))


@pytest.mark.parametrize("flags", [{"quantization": "none"}, {"tp_size": 3},
                                   {"enable_lora": True, "max_lora_rank": 8,
                                    "lora_target_modules": ["q_proj"]}])
def test_fused_layers_stay_out_of_what_they_cannot_run(flags: dict):
    """Dense weights, tensor parallelism (the all-reduce between layers), LoRA terms."""
    with LLM(q4_k_m_six_layers(), dtype="float32", max_total_tokens=256,
             max_running_requests=1, **{"quantization": "gguf", **flags}) as llm:
        assert llm.runtime.engine.model.fused_layers is None
        out = llm.generate(input_ids=[ref.prompt_ids("Hello")],
                           sampling_params={"temperature": 0, "max_new_tokens": 2})
        assert len(out[0]["output_ids"]) == 2
