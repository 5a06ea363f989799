"""`--dtype auto` on this machine's CPU: bfloat16 where oneDNN multiplies it natively, float32
elsewhere (an AVX2 CPU crashed in the bfloat16 weight prepack, and its bfloat16 GEMMs run
several times slower than float32). The default start must serve either way."""

from __future__ import annotations

import torch

from minisgl import LLM
from minisgl.layers.linear import native_cpu_gemm

TOP2_MARGIN_BF16 = 0.25  # logit units, as tests/test_quantization.py


def test_default_dtype_starts_and_serves_on_this_cpu():
    with LLM(load_format="dummy", json_model_override_args='{"num_hidden_layers": 2}',
             max_total_tokens=1024) as llm:
        engine = llm.runtime.engine
        expected = torch.bfloat16 if native_cpu_gemm(torch.bfloat16) else torch.float32
        assert engine.dtype == expected
        out = llm.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4,
                                                                 "temperature": 0})
        assert len(out["output_ids"]) == 4


def test_explicit_bfloat16_serves_without_native_support():
    """Asked for explicitly it still runs (slowly, unpacked) where the CPU lacks it."""
    with LLM(dtype="bfloat16", load_format="dummy", max_total_tokens=1024,
             json_model_override_args='{"num_hidden_layers": 2}') as llm:
        out = llm.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4,
                                                                 "temperature": 0})
        assert len(out["output_ids"]) == 4


def test_default_start_keeps_the_bundled_gguf_blocks_where_a_kernel_runs_them():
    """`make serve`'s start: the bundled GGUF's blocks stay packed wherever a CPU kernel runs
    them at the auto dtype (VNNI in bfloat16, AVX2 in float32), and its greedy answers follow
    transformers in float32 on the same weights, leaving them only where the reference's top-2
    logits are within bfloat16's rounding (the kernels keep activations to ~15 bits)."""
    from minisgl.layers.gguf_weight import block_kernels
    from minisgl.layers.quant import vnni_kernels
    from tests import reference as ref

    kernel = vnni_kernels() if native_cpu_gemm(torch.bfloat16) else block_kernels()
    with LLM(max_total_tokens=1024) as llm:
        assert llm.runtime.engine.quantization == ("gguf" if kernel else "none")
        for question in ref.CHAT_QUESTIONS:
            prompt = ref.prompt_ids(ref.chat_prompt(question))
            ours = llm.generate(input_ids=prompt, sampling_params={
                "max_new_tokens": 24, "temperature": 0})["output_ids"]
            ref.assert_greedy_matches(prompt, ours, ref.hf_greedy(prompt, 24), TOP2_MARGIN_BF16)


def test_engine_config_is_resolved_once_and_leaves_nothing_open():
    """What the flags leave open (the device's defaults, `auto`, the model's context, the
    quantization its file implies) is settled in one step, before anything is built; settling
    a settled config changes nothing, and the engine runs with exactly what it reports."""
    from minisgl.engine import Engine, EngineConfig
    from minisgl.engine.config import resolve
    from minisgl.models import ModelArch, load_config, resolve_model_path

    arch = ModelArch.from_config(load_config(resolve_model_path(None)))
    config = EngineConfig(dtype="auto", speculative_algorithm="NGRAM")
    resolved = resolve(config, torch.device("cpu"), arch)
    open_fields = [name for name in ("quantization", "context_length", "max_running_requests",
                                     "mem_fraction_static", "page_size", "attention_backend",
                                     "speculative_num_draft_tokens")
                   if getattr(resolved, name) is None]
    assert not open_fields, open_fields
    assert resolved.dtype != "auto" and resolved.device == "cpu"
    assert resolve(resolved, torch.device("cpu"), arch) == resolved
    engine = Engine(EngineConfig(max_total_tokens=256, max_running_requests=4))
    try:
        assert engine.config.max_total_tokens == engine.kv_pool.num_pages * engine.page_size
        assert (engine.config.page_size, engine.config.max_running_requests) == (
            engine.page_size, engine.max_running)
        assert engine.config.quantization == engine.quantization
    finally:
        engine.shutdown()
