"""Gemma 4 (text): global layers with their own head size (and, with attention_k_eq_v, values
from the key projection and KV heads of their own), proportional RoPE, KV shared by the last
layers, per-layer inputs, the double-wide MLP, experts beside the MLP, the multimodal
checkpoint served as its text model. The reference is transformers float32 on tiny random
models built here (nothing downloaded)."""

from __future__ import annotations

import json

import pytest
import torch

from minisgl.engine import Engine
from tests.test_model import TINY
from tests.test_model_configs import (STEPS, WINDOW, assert_greedy_matches_transformers,
                                      assert_logits_match, save_tiny, tiny_engine)

SLIDING, FULL = "sliding_attention", "full_attention"
BASE = dict(num_hidden_layers=6, head_dim=16, global_head_dim=32, sliding_window=WINDOW,
            layer_types=[SLIDING, FULL, SLIDING, SLIDING, FULL, FULL],
            final_logit_softcapping=30.0, pad_token_id=0, bos_token_id=1, eos_token_id=1)
VARIANTS = {
    # E2B's kind: per-layer inputs, the last three layers share the KV of layers 2 (sliding)
    # and 1 (full), and their MLP is twice as wide
    "per-layer inputs, shared KV": dict(hidden_size_per_layer_input=8,
                                        vocab_size_per_layer_input=TINY["vocab_size"],
                                        num_kv_shared_layers=3, use_double_wide_mlp=True),
    # 26B-A4B's kind: keys serve as values in the global layers, which have one KV head;
    # experts beside the MLP
    "k = v, experts": dict(hidden_size_per_layer_input=0, attention_k_eq_v=True,
                           num_global_key_value_heads=1,
                           enable_moe_block=True, num_experts=4, top_k_experts=2,
                           moe_intermediate_size=32),
}
# per KV layer (kv heads, head size) of each variant: the sharing layers keep none
POOL_SHAPES = {"per-layer inputs, shared KV": ((2, 16), (2, 32), (2, 16)),
               "k = v, experts": ((2, 16), (1, 32), (2, 16), (2, 16), (1, 32), (1, 32))}


def save_gemma4(path, variant: str, **overrides) -> torch.nn.Module:
    model = save_tiny("Gemma4ForCausalLM", "Gemma4TextConfig", path,
                      **{**BASE, **VARIANTS[variant], **overrides})
    with torch.no_grad():  # norms, scales and layer scalars start at one: give them values
        for name, tensor in model.state_dict().items():
            if name.endswith(("norm.weight", "scale", "layer_scalar")):
                tensor.add_(torch.randn_like(tensor) * 0.2)
    model.save_pretrained(path)
    return model


def pool_holds(variant: str):
    def check(engine: Engine) -> None:
        assert engine.kv_pool.layout.shapes == POOL_SHAPES[variant]
        assert engine.attn_backend.windows == (WINDOW, 0, WINDOW, WINDOW, 0, 0)
    return check


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_gemma4_matches_transformers(tmp_path, variant: str, steps: str, attention: str
                                     ) -> None:
    """Past the 16-token window: prefill, chunked prefill over a cached prefix and decode give
    transformers' logits (within 1e-4), from a pool that holds the producing layers only."""
    model = save_gemma4(tmp_path, variant)
    assert_logits_match(model, str(tmp_path), STEPS[steps], seed=5, attention=attention,
                        check=pool_holds(variant))


def test_the_kv_pool_keeps_the_producing_layers_at_their_own_head_size(tmp_path) -> None:
    """Bytes per token (float32): layers 0-2 keep 2 KV heads each, of 16, 32 and 16 dims
    (2 x 4 x 2 x 64 = 1024); a pool of every layer at the global head size would take
    3072."""
    save_gemma4(tmp_path, "per-layer inputs, shared KV")
    engine = tiny_engine(str(tmp_path))
    try:
        assert engine.kv_pool.layout.bytes_per_token(torch.float32) == 1024
        assert {shape: tuple(b.shape[1:3]) for shape, b in engine.kv_pool.buffers.items()} == {
            (2, 16): (2, 2), (2, 32): (1, 2)}  # layers of a shape, KV heads
    finally:
        engine.shutdown()


def test_the_hub_spelling_of_the_global_layers(tmp_path) -> None:
    """The released configs say global_head_dim and num_global_key_value_heads (transformers 5
    writes per_layer_config instead): the same model either way."""
    model = save_gemma4(tmp_path, "k = v, experts")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["per_layer_config"]
    config.update(global_head_dim=32, num_global_key_value_heads=1)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_logits_match(model, str(tmp_path), STEPS["chunked prefill"], seed=6,
                        check=pool_holds("k = v, experts"))


def test_a_multimodal_gemma4_checkpoint_is_served_as_its_text_model(tmp_path) -> None:
    """Gemma4ForConditionalGeneration: the text model from `text_config` and
    `model.language_model.*`, the vision tower skipped; a text prompt's logits equal
    transformers' multimodal model's."""
    import transformers
    torch.manual_seed(0)
    text = {**TINY, **BASE, **VARIANTS["per-layer inputs, shared KV"]}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    model = transformers.Gemma4ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)

    def text_model(engine: Engine) -> None:
        assert engine.arch.architecture == "Gemma4ForCausalLM"

    assert_logits_match(model, str(tmp_path), STEPS["prefill + decode"], seed=7,
                        check=text_model)


@pytest.mark.parametrize("variant", VARIANTS)
def test_gemma4_greedy_batched_over_one_and_two_ranks(tmp_path, variant: str) -> None:
    """Through the scheduler, past the window: a batch equals transformers' greedy generation,
    at TP 1 and TP 2 (one KV head per rank; the single global KV head on both)."""
    model = save_gemma4(tmp_path, variant)
    with torch.inference_mode():
        assert_greedy_matches_transformers(model, tmp_path, (7, 30, 45), 12)


@pytest.mark.parametrize("shape, narrow", [
    ("gemma-4-e2b", {"num_hidden_layers": 10, "num_kv_shared_layers": 5}),
    ("gemma-4-26b-a4b", {"num_hidden_layers": 6, "num_experts": 8}),
])
def test_the_shipped_gemma4_shapes_build_from_dummy_weights_and_decode(shape: str,
                                                                      narrow: dict) -> None:
    """The shipped shape-only configs (the Hub's spelling, multimodal), narrowed in depth,
    width and vocabulary: random weights reach every parameter and a batch decodes."""
    from minisgl.llm import LLM
    from tests.test_hybrid import random_prompts
    narrow = {**narrow, "hidden_size": 128, "intermediate_size": 64, "moe_intermediate_size": 32,
              "num_attention_heads": 4, "head_dim": 32, "global_head_dim": 64,
              "vocab_size": 1024, "vocab_size_per_layer_input": 1024}
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with LLM(model=shape, load_format="dummy", dtype="float32", max_total_tokens=1024,
             json_model_override_args=json.dumps(narrow)) as llm:
        engine = llm.runtime.engine
        assert {dim for _, dim in engine.kv_pool.layout.shapes} == {32, 64}
        assert all(p.isfinite().all() for p in engine.model.parameters())
        outs = llm.generate(input_ids=random_prompts((12, 30)), sampling_params=params)
        llm.check_integrity()
    assert all(len(r["output_ids"]) == 6 for r in outs)


GGUF_VOCAB = 49152  # the bundled tokenizer's, which the file carries


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_gemma4_gguf_file_serves_transformers_logits(tmp_path, variant: str) -> None:
    """llama.cpp's `gemma4` file (F32): the layer types from its sliding-window pattern, the
    head sizes and KV heads per kind, keys as values where the global layers have no v,
    the double-wide MLP from the per-layer widths, proportional RoPE's share from rope_freqs,
    the router's scales, the layer scalars."""
    from tests.gguf_families import write_gemma4_gguf
    model = save_gemma4(tmp_path / "hf", variant, vocab_size=GGUF_VOCAB,
                        vocab_size_per_layer_input=GGUF_VOCAB)
    gguf = write_gemma4_gguf(tmp_path / "hf", tmp_path / "tiny.gguf")
    assert_logits_match(model, str(gguf), STEPS["chunked prefill"], seed=8, vocab=GGUF_VOCAB,
                        check=pool_holds(variant))


INT8_ACTIVATIONS_BOUND = 1e-3  # relative L2 error of logits: two int8 activation terms


def test_a_gemma4_q8_0_file_keeps_its_linears_and_experts_as_blocks(tmp_path) -> None:
    """--quantization gguf: attention, the MLP and the experts hold blocks, with the logits of
    the same file dequantized, float32 both (bfloat16 alone moves this tiny model's logits by
    ~10%: unscaled scores of normed 16-dim heads), within INT8_ACTIVATIONS_BOUND."""
    from gguf import GGMLQuantizationType

    from tests.gguf_families import write_gemma4_gguf
    from tests.test_hybrid_gguf import assert_blocks_give_the_dequantized_logits
    # every token takes every expert: no near-tie in the routing flips between the roundings
    save_gemma4(tmp_path / "hf", "k = v, experts", vocab_size=GGUF_VOCAB, top_k_experts=4)
    gguf = write_gemma4_gguf(tmp_path / "hf", tmp_path / "tiny.Q8_0.gguf",
                             GGMLQuantizationType.Q8_0)

    def check(engine: Engine, blocks: bool) -> None:
        layer = engine.model.layers[1]
        linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                   layer.mlp.down_proj)
        assert [isinstance(m.weight, torch.nn.Parameter) for m in linears] == [not blocks] * 4
        assert (layer.experts.quantized is not None) == blocks

    assert_blocks_give_the_dequantized_logits(gguf, check, "float32", INT8_ACTIVATIONS_BOUND)


@pytest.mark.parametrize("variant", VARIANTS)
def test_lora_adapters_on_attention_and_mlp_match_peft(tmp_path, variant: str) -> None:
    """A PEFT adapter on every attention and MLP projection (the k = v layers have no v_proj;
    the sharing layers' k_proj / v_proj exist but feed nothing)."""
    from tests.lora_fixtures import (ALL_TARGETS, assert_adapter_and_base_rows_match_peft,
                                     save_adapter)
    save_gemma4(tmp_path / "base", variant)
    adapter = save_adapter(tmp_path / "base", tmp_path / "adapter", seed=3, b_scale=1.0)
    assert_adapter_and_base_rows_match_peft(tmp_path / "base", adapter, ALL_TARGETS,
                                            [[5, 17, 33, 9, 81, 12, 40, 7] * 3])

