"""Nemotron-H (NemotronHForCausalLM): Mamba2, attention, MLP and expert layers, each a block of
its own. The reference is transformers float32 on a tiny random model built here (nothing
downloaded); its norms, Mamba2 decays and skips, and the routers' correction biases are
perturbed so that each shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minisgl.engine import Engine, EngineConfig
from minisgl.llm import LLM
from tests.test_hybrid import (
    VOCAB,
    assert_greedy_batched_chunked_and_repeated,
    assert_logits_match_across_spans,
    assert_ngram_speculation_is_greedy,
    assert_prefix_hits_resume_from_snapshots,
    assert_retraction_recomputes_the_state,
    assert_tensor_parallel_2_is_greedy,
    random_prompts,
)
from tests.test_model import forward_spans

LOGIT_TOLERANCE = 1e-4  # max |ours - transformers| over all vocab logits, float32
SHAPE = {
    "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16,
    "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4, "max_position_embeddings": 512,
    "eos_token_id": 1, "layer_norm_epsilon": 1e-5}
# Nemotron 3 Nano's routing: groups of experts, a correction bias, scaled weights
EXPERTS = {"n_routed_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
           "moe_shared_expert_intermediate_size": 48, "n_group": 4, "topk_group": 2,
           "routed_scaling_factor": 2.5, "norm_topk_prob": True}
FAMILIES = {
    "dense": {**SHAPE, "hybrid_override_pattern": "M-*M-"},
    "moe": {**SHAPE, **EXPERTS, "hybrid_override_pattern": "ME*-EM"},
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def nemotron(request, tmp_path_factory) -> tuple[torch.nn.Module, str]:
    path = tmp_path_factory.mktemp(request.param)
    return save_nemotron(path, request.param), str(path)


def save_nemotron(path: Path, family: str, **fields) -> torch.nn.Module:
    """FAMILIES[family] (with `fields`) with random weights (fixed seed), saved at `path`."""
    import transformers
    torch.manual_seed(0)
    config = transformers.NemotronHConfig(**{**FAMILIES[family], **fields})
    model = transformers.NemotronHForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if any(key in name for key in ("norm", "A_log", "dt_bias", ".D",
                                           "e_score_correction_bias")):
                tensor.add_(torch.randn_like(tensor) * 0.2)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("spans", [
    [(0, 40)],  # one prefill
    [(0, 7), (7, 23), (23, 24), (24, 25), (25, 40)],  # chunks, decodes, a chunk after them
])
def test_logits_match_transformers_across_chunks_and_decodes(nemotron, spans) -> None:
    assert_logits_match_across_spans(*nemotron, spans)


def test_greedy_generation_batched_chunked_and_repeated(nemotron) -> None:
    assert_greedy_batched_chunked_and_repeated(*nemotron)


def test_retraction_under_a_tiny_pool_recomputes_the_state(nemotron) -> None:
    assert_retraction_recomputes_the_state(*nemotron)


def test_prefix_hits_resume_from_the_state_snapshot_at_the_prefix_end(nemotron) -> None:
    assert_prefix_hits_resume_from_snapshots(*nemotron)


def test_ngram_speculation_rolls_the_state_back_to_the_accepted_tokens(nemotron) -> None:
    assert_ngram_speculation_is_greedy(*nemotron)


def test_tensor_parallel_2_splits_the_heads_and_their_states(nemotron) -> None:
    assert_tensor_parallel_2_is_greedy(*nemotron)


@pytest.mark.parametrize("nemotron", ["moe"], indirect=True)
def test_the_hubs_spelling_of_a_checkpoint_loads_the_same_model(nemotron, tmp_path) -> None:
    """As NVIDIA's Hub checkpoints spell it: `backbone.` tensors, each expert's own up_proj and
    down_proj, and a config with hybrid_override_pattern and num_hidden_layers."""
    from safetensors.torch import load_file, save_file
    model, path = nemotron
    tensors = {}
    for name, tensor in load_file(f"{path}/model.safetensors").items():
        name = name.replace("model.", "backbone.", 1)
        if name.endswith(("experts.up_proj", "experts.down_proj")):
            for e, expert in enumerate(tensor):
                tensors[name.replace(".experts.", f".experts.{e}.") + ".weight"] = expert
        else:
            tensors[name] = tensor
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((Path(path) / "config.json").read_text())
    kinds = config.pop("layers_block_type")
    letters = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    config.update(hybrid_override_pattern="".join(letters[k] for k in kinds),
                  num_hidden_layers=len(kinds))
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = Engine(EngineConfig(model_path=str(tmp_path), dtype="float32", max_total_tokens=256,
                                 max_running_requests=2))
    try:
        assert engine.arch.layer_types == tuple(kinds)
        ids = random_prompts((30,))[0]
        ours = forward_spans(engine, ids, [(0, 30)])
    finally:
        engine.shutdown()
    with torch.inference_mode():
        theirs = model(input_ids=torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < LOGIT_TOLERANCE


@pytest.mark.parametrize("field, value", [
    ("mlp_hidden_act", "silu"), ("moe_latent_size", 16), ("residual_in_fp32", True),
    ("n_group", 3),
])
def test_a_config_value_we_do_not_compute_is_refused_in_one_line(tmp_path, field, value):
    config = {**SHAPE, **EXPERTS, "hybrid_override_pattern": "ME*", "num_hidden_layers": 3,
              "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"],
              field: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=field) as refused:
        Engine(EngineConfig(model_path=str(tmp_path), dtype="float32", max_total_tokens=256,
                            load_format="dummy"))
    assert "\n" not in str(refused.value)


def test_the_shipped_nemotron_3_nano_shape_builds_from_dummy_weights_and_decodes() -> None:
    """The shipped shape-only config (its Hub spelling: hybrid_override_pattern; grouped
    routing over many experts), narrowed: its first six layers (Mamba2, experts, attention)."""
    narrow = {"num_hidden_layers": 6, "hidden_size": 128, "n_routed_experts": 16,
              "moe_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32,
              "vocab_size": 1024, "head_dim": 32, "mamba_num_heads": 8, "mamba_head_dim": 16,
              "ssm_state_size": 16}
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with LLM(model="nemotron-3-nano-30b-a3b", load_format="dummy", dtype="float32",
             max_total_tokens=1024, json_model_override_args=json.dumps(narrow)) as llm:
        arch = llm.runtime.engine.arch
        assert set(arch.layer_types) == {"linear_attention", "moe", "full_attention"}
        outs = llm.generate(input_ids=random_prompts((12, 30)), sampling_params=params)
        llm.check_integrity()
    assert all(len(r["output_ids"]) == 6 for r in outs)
