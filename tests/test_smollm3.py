"""SmolLM3 (SmolLM3ForCausalLM): the Llama decoder with NoPE layers (no RoPE on every fourth
layer by default, or where `no_rope_layers` says 0), and a window on the layers its
layer_types mark (with use_sliding_window, the NoPE ones); its GGUF files (llama.cpp's
`smollm3`). The reference is transformers float32 on a tiny random model built
here (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from minisgl.engine import Engine
from minisgl.layers import NoRotary
from tests.gguf_families import write_smollm3_gguf
from tests.test_hybrid_gguf import assert_blocks_give_the_dequantized_logits
from tests.test_model_configs import (STEPS, WINDOW, assert_greedy_matches_transformers,
                                      assert_logits_match, save_tiny)

LAYERS = 4
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=1)  # inside the tiny vocabulary


def save_smollm3(path, **fields) -> torch.nn.Module:
    return save_tiny("SmolLM3ForCausalLM", "SmolLM3Config", path, num_hidden_layers=LAYERS,
                     **IDS, **fields)


def rotates(engine: Engine) -> list[bool]:
    return [not isinstance(layer.self_attn.rotary, NoRotary) for layer in engine.model.layers]


@pytest.mark.parametrize("fields, expected", [
    ({}, [True, True, True, False]),  # the default: every fourth layer without RoPE
    ({"no_rope_layers": [0, 1, 0, 1]}, [False, True, False, True]),
])
@pytest.mark.parametrize("steps", STEPS)
def test_smollm3_matches_transformers(tmp_path, fields: dict, expected: list[bool],
                                      steps: str) -> None:
    """Prefill, chunked prefill over a cached prefix and decode give transformers' logits, with
    RoPE on exactly the layers the config gives it."""
    model = save_smollm3(tmp_path, **fields)

    def check(engine: Engine) -> None:
        assert rotates(engine) == expected

    assert_logits_match(model, str(tmp_path), STEPS[steps], seed=5, check=check)


def test_smollm3_windows_its_nope_layers_where_the_config_says(tmp_path) -> None:
    """use_sliding_window with a window: transformers windows the NoPE layers only; 60 tokens
    past a 16-token window give its logits."""
    model = save_smollm3(tmp_path, use_sliding_window=True, sliding_window=WINDOW)
    assert model.config.layer_types[-1] == "sliding_attention"

    def check(engine: Engine) -> None:
        assert engine.attn_backend.windows == (0, 0, 0, WINDOW)

    assert_logits_match(model, str(tmp_path), STEPS["chunked prefill"], seed=6, check=check)


def test_smollm3_greedy_batched_over_one_and_two_ranks(tmp_path) -> None:
    model = save_smollm3(tmp_path)
    with torch.inference_mode():
        assert_greedy_matches_transformers(model, tmp_path, (7, 30, 45), 12)


GGUF_VOCAB = 49152  # the bundled tokenizer's, which the file carries


def test_a_smollm3_gguf_file_serves_transformers_logits(tmp_path) -> None:
    """llama.cpp's `smollm3` file (F32): the config from its metadata, RoPE off on every fourth
    layer as llama.cpp's model does, q / k rows brought back from the file's order."""
    model = save_smollm3(tmp_path / "hf", vocab_size=GGUF_VOCAB)
    gguf = write_smollm3_gguf(model, tmp_path / "tiny.gguf")

    def check(engine: Engine) -> None:
        assert type(engine.model).__name__ == "SmolLM3ForCausalLM"
        assert rotates(engine) == [True, True, True, False]

    assert_logits_match(model, str(gguf), STEPS["chunked prefill"], seed=8, vocab=GGUF_VOCAB,
                        check=check)


def test_a_smollm3_q8_0_file_keeps_its_projections_as_blocks(tmp_path) -> None:
    """--quantization gguf: every projection holds blocks, with the logits of the same file
    dequantized (bfloat16 both; bound BF16_REL_BOUND)."""
    model = save_smollm3(tmp_path / "hf", vocab_size=GGUF_VOCAB)
    gguf = write_smollm3_gguf(model, tmp_path / "tiny.Q8_0.gguf", GGMLQuantizationType.Q8_0)

    def check(engine: Engine, blocks: bool) -> None:
        layer = engine.model.layers[3]
        dense = [isinstance(m.weight, torch.nn.Parameter) for m in
                 (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                  layer.mlp.down_proj)]
        assert dense == [not blocks] * 4

    assert_blocks_give_the_dequantized_logits(gguf, check)
