"""LoRA on a quantized base: the adapter's term is added to the quantized linear's output in
the activations' dtype. The bundled model cut to 4 layers, as its own GGUF blocks
(--quantization gguf) and as an AWQ int4 checkpoint, each with a random PEFT adapter made on
the dense weights the blocks encode; the reference is PEFT's merged model on those weights, in
float32, with the quantized kernels' bounds (tests.test_gguf_kquants, tests.test_hf_quantized)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minisgl import LLM
from minisgl.layers.gguf_weight import GgufWeight, StackedWeight, block_kernels
from minisgl.models import resolve_model_path
from tests import reference as ref
from tests.hf_quant_writers import write_checkpoint
from tests.lora_fixtures import merged_model, save_adapter
from tests.test_gguf_types import assert_matches_transformers

pytestmark = pytest.mark.skipif(block_kernels() is None, reason="needs the AVX2 block kernel")

LAYERS = 4
# the int4 / k-quant bounds of tests.test_hf_quantized and tests.test_gguf_kquants
MARGIN_BOUND = 0.05
LOGPROB_TOLERANCE = 3e-3


@pytest.mark.parametrize("method", ["gguf", "awq"])
def test_adapter_on_quantized_base_matches_merged_reference(method: str, tmp_path) -> None:
    if method == "gguf":
        model, dense = None, resolve_model_path(None)
    else:
        quantized, dense = write_checkpoint(tmp_path, "awq", 64)
        model = str(quantized)
    adapter = save_adapter(dense, tmp_path / "adapter", seed=21, rank=8, layers=LAYERS,
                           b_scale=8.0)
    prompts = [ref.prompt_ids(p) for p in ref.PLAIN_PROMPTS[:2]]
    with LLM(model, dtype="float32", quantization=method, max_total_tokens=1024,
             json_model_override_args=json.dumps({"num_hidden_layers": LAYERS}),
             lora_paths=[f"a={adapter}"]) as llm:
        linear = llm.runtime.engine.model.layers[0].mlp.down_proj
        assert isinstance(linear.quantized, (GgufWeight, StackedWeight)) and linear.lora
        outs = llm.generate(input_ids=prompts, lora_path="a", return_logprob=True,
                            logprob_start_len=0, sampling_params={
                                "temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
        base = llm.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
        llm.check_integrity()
    assert [o["output_ids"] for o in outs] != [b["output_ids"] for b in base]
    merged = merged_model(Path(dense), adapter, LAYERS)
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(merged, prompt, out, MARGIN_BOUND, LOGPROB_TOLERANCE)
