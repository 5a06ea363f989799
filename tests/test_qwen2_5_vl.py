"""Qwen2.5-VL checkpoints served as their text model (models.qwen2_5_vl): greedy generation
and logits equal to transformers' Qwen2_5_VLForConditionalGeneration in float32 on text, from
the config transformers writes (a nested text_config) and from the Hub's older flat one
(`rope_scaling: {type: mrope}`), tied or untied embeddings; the vision tensors are skipped."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_model import TINY
from tests.test_model_configs import (STEPS, assert_greedy_matches_transformers,
                                      assert_logits_match)

# head_dim 16: eight rotated pairs, in M-RoPE's three sections (temporal, height, width)
TEXT = {**TINY, "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                    "rope_theta": 1_000_000.0}}
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)


def save_qwen2_5_vl(path, tied: bool) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION,
                                           tie_word_embeddings=tied)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    return model


def flatten_config(path) -> None:
    """The Hub's older spelling: the text fields at the top, RoPE as rope_scaling."""
    config = json.loads((path / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    text.pop("model_type")
    config.update(text, rope_theta=rope["rope_theta"],
                  rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("spelling", ["nested", "flat"])
@pytest.mark.parametrize("tied", [False, True])
def test_text_matches_transformers(tmp_path, spelling: str, tied: bool) -> None:
    model = save_qwen2_5_vl(tmp_path, tied)
    if spelling == "flat":
        flatten_config(tmp_path)
    assert_logits_match(model, str(tmp_path), STEPS["chunked prefill"], seed=3)
    assert_greedy_matches_transformers(model, tmp_path, (5, 23), new_tokens=8, tp_sizes=(1,))
