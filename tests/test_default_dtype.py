"""`--dtype auto` on this machine's CPU: bfloat16 where oneDNN multiplies it natively, float32
elsewhere (an AVX2 CPU crashed in the bfloat16 weight prepack, and its bfloat16 GEMMs run
several times slower than float32). The default start must serve either way."""

from __future__ import annotations

import torch

from minisgl import LLM
from minisgl.layers.linear import native_cpu_gemm


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
