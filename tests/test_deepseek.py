"""DeepSeek-V2 and V3: multi-head latent attention from a compressed cache (one row of
kv_lora_rank + qk_rope_head_dim per token and layer, its first kv_lora_rank dims the values),
absorbed weights, q through a low-rank pair or straight, interleaved RoPE, YaRN with DeepSeek's
softmax scale, dense first layers, routed experts (V3: sigmoid, correction bias, groups; V2:
softmax, greedy or by group) with shared ones. The reference is transformers float32 on tiny
random models built here (nothing downloaded)."""

from __future__ import annotations

import json

import pytest
import torch

from minisgl.engine import Engine
from minisgl.llm import LLM
from tests.test_model import TINY
from tests.test_model_configs import (STEPS, assert_greedy_matches_transformers,
                                      assert_logits_match, tiny_engine)

LATENT, ROPE, LAYERS = 32, 8, 3
COMMON = dict(num_hidden_layers=LAYERS, num_key_value_heads=TINY["num_attention_heads"],
              kv_lora_rank=LATENT, qk_nope_head_dim=16, qk_rope_head_dim=ROPE, v_head_dim=12,
              n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
              n_shared_experts=1, first_k_dense_replace=1, pad_token_id=0, bos_token_id=1,
              eos_token_id=1)
VARIANTS = {
    "v3": ("DeepseekV3", dict(q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                              norm_topk_prob=True)),
    "v3 yarn, pairs apart": ("DeepseekV3", dict(
        q_lora_rank=24, n_group=2, topk_group=1, rope_interleave=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 64, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.8})),
    "v2 lite": ("DeepseekV2", dict(q_lora_rank=None, topk_method="greedy")),
    "v2 by group": ("DeepseekV2", dict(q_lora_rank=24, topk_method="group_limited_greedy",
                                       n_group=4, topk_group=2, routed_scaling_factor=1.5)),
}


def save_deepseek(path, variant: str, **overrides) -> torch.nn.Module:
    import transformers
    family, fields = VARIANTS[variant]
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**{**TINY, **COMMON, **fields,
                                                          **overrides})
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("norm.weight"):  # norms start at one: give them values
                tensor.add_(torch.randn_like(tensor) * 0.2)
            elif name.endswith("gate.weight"):  # a router that tells experts apart
                tensor.normal_(0.0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn_like(tensor) * 0.1)
    model.save_pretrained(path)
    return model


def caches_latent_rows(engine: Engine) -> None:
    assert engine.kv_pool.layout.latent == LATENT
    assert engine.kv_pool.layout.shapes == ((1, LATENT + ROPE),) * LAYERS


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_deepseek_matches_transformers(tmp_path, variant: str, steps: str, attention: str
                                       ) -> None:
    """Prefill, chunked prefill over a cached prefix and decode give transformers' logits
    (within 1e-4), read from the compressed cache."""
    model = save_deepseek(tmp_path, variant)
    assert_logits_match(model, str(tmp_path), STEPS[steps], seed=5, attention=attention,
                        check=caches_latent_rows)


def test_the_latent_cache_holds_one_row_per_token_and_layer(tmp_path) -> None:
    """Bytes per token (float32): 3 layers x (32 + 8) x 4 = 480. The same model with its keys
    and values expanded per head (4 heads of 24-dim keys and 12-dim values) would keep
    3 x 4 x 36 x 4 = 1728. At DeepSeek-V3's shape (61 layers, 128 heads, 512 + 64 latent,
    192-dim keys, 128-dim values) that is 70,272 bytes (bfloat16) against 4,997,120: 1.4%."""
    save_deepseek(tmp_path, "v3")
    engine = tiny_engine(str(tmp_path))
    try:
        assert engine.kv_pool.layout.bytes_per_token(torch.float32) == 480
        assert [tuple(b.shape[:3]) for b in engine.kv_pool.buffers.values()] == [(1, LAYERS, 1)]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("variant", ["v3", "v2 lite"])
def test_deepseek_greedy_batched_over_one_and_two_ranks(tmp_path, variant: str) -> None:
    """Through the scheduler, batched: transformers' greedy generation, at TP 1 and TP 2 (two
    heads per rank, the compressed row whole on each)."""
    model = save_deepseek(tmp_path, variant)
    with torch.inference_mode():
        assert_greedy_matches_transformers(model, tmp_path, (7, 30, 45), 12)


def test_a_routing_we_do_not_compute_is_refused(tmp_path) -> None:
    save_deepseek(tmp_path, "v2 lite")
    config = json.loads((tmp_path / "config.json").read_text())
    config["scoring_func"] = "sigmoid"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="scoring_func 'sigmoid'"):
        tiny_engine(str(tmp_path))


@pytest.mark.parametrize("shape, narrow", [
    ("deepseek-v3", {"num_hidden_layers": 4, "n_routed_experts": 16, "q_lora_rank": 64}),
    ("deepseek-v2-lite", {"num_hidden_layers": 2}),
])
def test_the_shipped_deepseek_shapes_build_from_dummy_weights_and_decode(shape: str,
                                                                        narrow: dict) -> None:
    """The shipped shape-only configs (the Hub's spelling: rope_scaling with YaRN), narrowed in
    depth, width and vocabulary: random weights reach every parameter and a batch decodes."""
    from minisgl.llm import LLM
    from tests.test_hybrid import random_prompts
    narrow = {**narrow, "hidden_size": 128, "intermediate_size": 64, "moe_intermediate_size": 32,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1024}
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with LLM(model=shape, load_format="dummy", dtype="float32", max_total_tokens=1024,
             json_model_override_args=json.dumps(narrow)) as llm:
        engine = llm.runtime.engine
        assert engine.kv_pool.layout.latent == 512
        assert all(p.isfinite().all() for p in engine.model.parameters())
        outs = llm.generate(input_ids=random_prompts((12, 30)), sampling_params=params)
        llm.check_integrity()
    assert all(len(r["output_ids"]) == 6 for r in outs)


GGUF_VOCAB = 49152  # the bundled tokenizer's, which the file carries


def save_for_gguf(path, variant: str, **overrides) -> torch.nn.Module:
    """The checkpoint, its config.json with the scoring_func the Hub's configs carry (from
    which llama.cpp's converter writes the gating function)."""
    model = save_deepseek(path, variant, vocab_size=GGUF_VOCAB, **overrides)
    config = json.loads((path / "config.json").read_text())
    config["scoring_func"] = "sigmoid" if VARIANTS[variant][0] == "DeepseekV3" else "softmax"
    (path / "config.json").write_text(json.dumps(config))
    return model


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 0.8, "mscale_all_dim": 0.8}


@pytest.mark.parametrize("variant, overrides", [("v3", {"rope_parameters": YARN}),
                                                ("v2 lite", {})])
def test_a_deepseek2_gguf_file_serves_transformers_logits(tmp_path, variant: str,
                                                          overrides: dict) -> None:
    """llama.cpp's `deepseek2` file (F32): the config from its metadata (V3 by its sigmoid
    gating, YaRN's mscale from the log multiplier), kv_b_proj from k_b and v_b, the rope rows
    from adjacent pairs to halves as they are read."""
    from tests.gguf_families import write_deepseek2_gguf
    model = save_for_gguf(tmp_path / "hf", variant, **overrides)
    gguf = write_deepseek2_gguf(tmp_path / "hf", tmp_path / "tiny.gguf")
    family = VARIANTS[variant][0]

    def check(engine: Engine) -> None:
        assert engine.arch.architecture == f"{family}ForCausalLM"
        caches_latent_rows(engine)

    assert_logits_match(model, str(gguf), STEPS["chunked prefill"], seed=8, vocab=GGUF_VOCAB,
                        check=check)


def test_a_deepseek2_q8_0_file_keeps_its_linears_and_experts_as_blocks(tmp_path) -> None:
    """--quantization gguf: q's, the compressed row's and the output projections, the dense
    MLP and the experts hold blocks (the rope rows reordered as blocks), with the logits of
    the same file dequantized (bfloat16 both; bound BF16_REL_BOUND)."""
    from gguf import GGMLQuantizationType

    from tests.gguf_families import write_deepseek2_gguf
    from tests.test_hybrid_gguf import assert_blocks_give_the_dequantized_logits
    save_for_gguf(tmp_path / "hf", "v3", q_lora_rank=32, v_head_dim=16)  # inputs by 32
    gguf = write_deepseek2_gguf(tmp_path / "hf", tmp_path / "tiny.Q8_0.gguf",
                                GGMLQuantizationType.Q8_0)

    def check(engine: Engine, blocks: bool) -> None:
        dense, sparse = engine.model.layers[0], engine.model.layers[1]
        attention = sparse.self_attn
        linears = (attention.q_a_proj, attention.q_b_proj, attention.kv_a_proj_with_mqa,
                   attention.o_proj, dense.mlp.gate_up_proj, dense.mlp.down_proj)
        assert [isinstance(m.weight, torch.nn.Parameter) for m in linears] == [not blocks] * 6
        assert (sparse.mlp.experts.quantized is not None) == blocks

    assert_blocks_give_the_dequantized_logits(gguf, check)


def test_lora_adapters_match_peft_and_the_latent_projections_are_refused(tmp_path) -> None:
    """An adapter on q_b_proj, o_proj and the dense layer's MLP matches PEFT; one on the
    latent projections (their weights are absorbed into the attention) is refused at start."""
    from tests.lora_fixtures import assert_adapter_and_base_rows_match_peft, save_adapter
    save_deepseek(tmp_path / "base", "v3")
    targets = ["q_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = save_adapter(tmp_path / "base", tmp_path / "adapter", seed=3, b_scale=1.0,
                           targets=targets)
    assert_adapter_and_base_rows_match_peft(tmp_path / "base", adapter, targets,
                                            [[5, 17, 33, 9, 81, 12, 40, 7] * 3])
    with pytest.raises(ValueError, match="no LoRA-capable kv_a_proj_with_mqa, kv_b_proj"):
        LLM(model=str(tmp_path / "base"), dtype="float32", max_total_tokens=256,
            enable_lora=True, max_lora_rank=8,
            lora_target_modules=["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"])

