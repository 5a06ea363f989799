"""Hybrid models: Qwen3-Next and Qwen3.5 (Gated DeltaNet layers), Granite 4.0-H (Mamba2
layers), dense and with experts: a recurrent state per request beside attention layers over
the paged KV. The reference is transformers float32 on a tiny random
model built here (nothing downloaded); its norms, decays and gates are perturbed so that the
checkpoint's conventions ((1 + w) norms, the DeltaNet's plain gated norm) all show."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl.engine import Engine, EngineConfig
from minisgl.llm import LLM
from tests.test_model import forward_spans

LOGIT_TOLERANCE = 1e-4  # max |ours - transformers| over all vocab logits, float32
VOCAB = 512
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, eos_token_id=1,
    layer_types=["linear_attention", "full_attention"] * 2)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)
# Granite's multipliers and logit scaling away from 1, so that each shows; no RoPE (its default)
GRANITE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
    mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=2, mamba_expand=2,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    embedding_multiplier=2.0, attention_multiplier=0.1, residual_multiplier=0.5,
    logits_scaling=3.0, max_position_embeddings=512, eos_token_id=1)
FAMILIES = {  # model class, config class, its fields
    "qwen3-next": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
                   {**SHAPE, **EXPERTS, "decoder_sparse_step": 1, "mlp_only_layers": [2]}),
    "qwen3.5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", SHAPE),
    "qwen3.5-moe": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", {**SHAPE, **EXPERTS}),
    "granite-4.0-h": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                      {**GRANITE, "num_local_experts": 4}),
    "granite-4.0-h-dense": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                            {**GRANITE, "num_local_experts": 0}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def qwen3_next(request, tmp_path_factory) -> tuple[torch.nn.Module, str]:
    return tiny_hybrid(request.param, tmp_path_factory.mktemp(request.param))


def tiny_hybrid(family: str, path: Path) -> tuple[torch.nn.Module, str]:
    """FAMILIES[family] with random weights (fixed seed), saved at `path`."""
    import transformers
    model_class, config_class, fields = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**fields)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name or name.endswith(".D"):
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    return model, str(path)


def random_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    return [torch.randint(2, VOCAB, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in lengths]


def reference_greedy(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int
                     ) -> list[list[int]]:
    with torch.inference_mode():
        return [model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                               pad_token_id=0, eos_token_id=None)[0, len(ids):].tolist()
                for ids in prompts]


@pytest.mark.parametrize("spans", [
    [(0, 40)],  # one prefill
    [(0, 7), (7, 23), (23, 24), (24, 25), (25, 40)],  # chunks, decodes, a chunk after them
])
def test_logits_match_transformers_across_chunks_and_decodes(qwen3_next, spans) -> None:
    assert_logits_match_across_spans(*qwen3_next, spans)


def assert_logits_match_across_spans(model: torch.nn.Module, path: str,
                                     spans: list[tuple[int, int]]) -> None:
    """The engine's logits of a prompt forwarded in `spans` (chunks and decodes) equal
    transformers'; the KV pool holds the attention layers only, the state pool the linear."""
    engine = Engine(EngineConfig(model_path=path, dtype="float32", max_total_tokens=256,
                                 max_running_requests=2))
    try:
        arch = engine.arch
        kinds = arch.layer_types
        assert engine.kv_pool.buffer.shape[1] == arch.kv_layers == kinds.count("full_attention")
        assert engine.states.conv.shape[0] == arch.linear_layers == kinds.count("linear_attention")
        ids = random_prompts((40,))[0]
        ours = forward_spans(engine, ids, spans)
        with torch.inference_mode():
            theirs = model(input_ids=torch.tensor([ids])).logits[0]
        assert (ours - theirs).abs().max().item() < LOGIT_TOLERANCE
    finally:
        engine.shutdown()


def test_greedy_generation_batched_chunked_and_repeated(qwen3_next) -> None:
    assert_greedy_batched_chunked_and_repeated(*qwen3_next)


def assert_greedy_batched_chunked_and_repeated(model: torch.nn.Module, path: str) -> None:
    """Batched through the scheduler with 16-token prefill chunks and mixed batches, and the
    same prompts again (resumed from the prefix cache's state snapshots where it kept them),
    equal transformers' greedy generation of each prompt alone."""
    prompts = random_prompts((5, 23, 40, 61))
    expected = reference_greedy(model, prompts, 12)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with LLM(model=path, dtype="float32", max_total_tokens=2048, max_running_requests=4,
             chunked_prefill_size=16, enable_mixed_chunk=True) as llm:
        first = llm.generate(input_ids=prompts, sampling_params=params)
        again = llm.generate(input_ids=prompts[::-1], sampling_params=params)[::-1]
        llm.check_integrity()
    assert [r["output_ids"] for r in first] == expected
    assert [r["output_ids"] for r in again] == expected
    assert any(r["meta_info"]["cached_tokens"] for r in again)


def test_prefix_hits_resume_from_the_state_snapshot_at_the_prefix_end(qwen3_next) -> None:
    assert_prefix_hits_resume_from_snapshots(*qwen3_next)


def assert_prefix_hits_resume_from_snapshots(model: torch.nn.Module, path: str) -> None:
    """A full hit (the same prompt again), a multi-turn hit (a prompt continuing an earlier
    request's prompt and output) and a part-way hit (a prompt sharing 33 tokens with an
    earlier one) each resume from the snapshot at the deepest page boundary they share, and
    generate what transformers does. With 4-token pages and 16-token chunks, the first
    request leaves snapshots at its chunks' ends (16, 32), at the page boundary before its
    prompt's last token (36) and at the last one its KV reached (48 of 40 + 12 - 1). A short
    answer's next turn resumes where its prompt ended (44 of 44 + 2 - 1)."""
    first, short = random_prompts((40, 44))
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with LLM(model=path, dtype="float32", max_total_tokens=2048, max_running_requests=4,
             chunked_prefill_size=16, page_size=4, max_mamba_cache_size=32) as llm:
        out = llm.generate(input_ids=[first], sampling_params=params)[0]["output_ids"]
        answer = llm.generate(input_ids=[short], sampling_params={**params, "max_new_tokens": 2}
                              )[0]["output_ids"]
        prompts = [first, first + out + [7, 8, 9], first[:33] + random_prompts((21,))[0],
                   short + answer + [5]]
        results = [llm.generate(input_ids=[p], sampling_params=params)[0] for p in prompts]
        llm.check_integrity()
    expected = reference_greedy(model, [first, *prompts], 12)
    assert [out, *(r["output_ids"] for r in results)] == expected
    assert [r["meta_info"]["cached_tokens"] for r in results] == [36, 48, 32, 44]


def test_retraction_under_a_tiny_pool_recomputes_the_state(qwen3_next) -> None:
    assert_retraction_recomputes_the_state(*qwen3_next)


def assert_retraction_recomputes_the_state(model: torch.nn.Module, path: str) -> None:
    prompts = random_prompts((20, 25, 30, 35, 40, 45))
    expected = reference_greedy(model, prompts, 30)
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    with LLM(model=path, dtype="float32", max_total_tokens=192, max_running_requests=6) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        retractions = llm.runtime.state()["retractions"]
        llm.check_integrity()
    assert retractions > 0, "the pool was meant to be too small to run everything at once"
    assert [r["output_ids"] for r in outs] == expected


@pytest.mark.parametrize("family", ["qwen3-next", "granite-4.0-h"])
def test_preempted_hybrid_requests_resume_with_the_same_greedy_output(
        family, tmp_path, minisgl_server_factory) -> None:
    """An urgent request preempts both running ones (their states dropped with their rows);
    each preempted request is recomputed and finishes as transformers generates it."""
    from tests.test_scheduling import SHORT, Clock
    from tests.test_server import state, wait_for
    model, path = tiny_hybrid(family, tmp_path)
    prompts = random_prompts((20, 30, 40))
    long = {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}  # still running
    expected = reference_greedy(model, prompts[:2], long["max_new_tokens"])
    server = minisgl_server_factory("--model", path, "--max-running-requests", "2",
                                    "--enable-priority-scheduling")
    clock = Clock(server)
    blockers = [clock.send({"input_ids": p, "sampling_params": long, "priority": 0})
                for p in prompts[:2]]
    wait_for(lambda: state(server)["generated_tokens"] >= 16, what="both decoding")
    urgent = clock.send({"input_ids": prompts[2], "sampling_params": SHORT, "priority": 20})
    urgent_done, _ = urgent.result()
    results = [f.result() for f in blockers]
    assert urgent_done < min(done for done, _ in results)
    assert state(server)["preemptions"] >= 1
    assert [out["output_ids"] for _, out in results] == expected


def test_ngram_speculation_rolls_the_state_back_to_the_accepted_tokens(qwen3_next) -> None:
    assert_ngram_speculation_is_greedy(*qwen3_next)


def test_ngram_speculation_over_two_ranks_rolls_each_ranks_states_back(qwen3_next) -> None:
    """Each rank holds half of the heads' states: rank 0's choice of each row's state after
    its accepted drafts reaches the other rank."""
    assert_ngram_speculation_is_greedy(*qwen3_next, tp_size=2)


def assert_ngram_speculation_is_greedy(model: torch.nn.Module, path: str, tp_size: int = 1
                                       ) -> None:
    """Greedy NGRAM speculation, every draft verified, with 16-token chunks, mixed batches and
    the prefix cache, gives transformers' greedy tokens: a rejected draft's state is undone,
    and a partly accepted row keeps the state after its accepted drafts (the Qwen models
    here repeat their motifs, so some drafts are accepted; Granite's random model does not)."""
    motifs = random_prompts((4, 6, 9))
    prompts = [motif * 6 for motif in motifs] + random_prompts((30,))
    expected = reference_greedy(model, prompts, 24)
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with LLM(model=path, dtype="float32", max_total_tokens=2048, max_running_requests=4,
             chunked_prefill_size=16, enable_mixed_chunk=True, speculative_algorithm="NGRAM",
             speculative_always_draft=True, speculative_num_draft_tokens=4,
             tp_size=tp_size) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        again = llm.generate(input_ids=prompts, sampling_params=params)
        stats = llm.runtime.state()
        llm.check_integrity()
    assert [r["output_ids"] for r in outs] == expected
    assert [r["output_ids"] for r in again] == expected
    assert stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"], stats


@pytest.mark.parametrize("qwen3_next", ["qwen3.5"], indirect=True)
def test_a_dense_draft_model_speculates_for_a_hybrid_target(qwen3_next, tmp_path) -> None:
    """STANDALONE with a small random Llama as the draft (its drafts mostly rejected): the
    target's rows roll back to their accepted state, and the greedy tokens are transformers'."""
    import transformers
    model, path = qwen3_next
    torch.manual_seed(1)
    draft = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512))
    draft.save_pretrained(tmp_path)
    prompts = random_prompts((9, 30))
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    with LLM(model=path, dtype="float32", max_total_tokens=1024, max_running_requests=2,
             speculative_algorithm="STANDALONE", speculative_draft_model_path=str(tmp_path),
             speculative_always_draft=True, speculative_num_draft_tokens=3) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        stats = llm.runtime.state()
        llm.check_integrity()
    assert [r["output_ids"] for r in outs] == reference_greedy(model, prompts, 16)
    assert stats["spec_accepted_tokens"] < stats["spec_drafted_tokens"], stats


@pytest.mark.parametrize("tp_size", [1, 2])
def test_lora_adapters_on_attention_mlp_and_linear_mixer_layers(qwen3_next, tmp_path, request,
                                                                tp_size: int) -> None:
    """A PEFT adapter on the attention, MLP and linear-mixer projections, batched with a
    request of the base model: each equals its transformers reference (PEFT's merged model),
    on one rank and on two (each adapter's B cut as its projection's parts are: q, k and v's
    shares, or Mamba2's z, x, B, C and dt's)."""
    from tests.lora_fixtures import merged_model, save_adapter
    model, path = qwen3_next
    mixer = {"qwen3-next": ["in_proj_qkvz", "out_proj"], "qwen3.5": ["in_proj_qkv", "out_proj"],
             "qwen3.5-moe": ["in_proj_qkv", "in_proj_z", "out_proj"]}
    family = request.node.callspec.params["qwen3_next"]
    granite = family.startswith("granite")
    targets = ["q_proj", "v_proj", "o_proj"] + (["in_proj", "out_proj"] if granite else
                                                ["gate_proj", "up_proj", "down_proj", *mixer[family]])
    adapter = save_adapter(Path(path), tmp_path / "adapter", seed=3, targets=targets)
    prompts = random_prompts((9, 30))
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    with LLM(model=path, dtype="float32", max_total_tokens=1024, enable_lora=True,
             lora_paths=[f"adapter={adapter}"], max_lora_rank=8, tp_size=tp_size) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params,
                            lora_path=["adapter", None])
        llm.check_integrity()
    adapted = reference_greedy(merged_model(Path(path), adapter), prompts[:1], 10)
    assert [outs[0]["output_ids"]] == adapted
    assert [outs[1]["output_ids"]] == reference_greedy(model, prompts[1:], 10)
    assert adapted != reference_greedy(model, prompts[:1], 10)


def test_tensor_parallel_2_splits_the_heads_and_their_states(qwen3_next) -> None:
    assert_tensor_parallel_2_is_greedy(*qwen3_next)


def assert_tensor_parallel_2_is_greedy(model: torch.nn.Module, path: str) -> None:
    """Two ranks (each a process with half of every layer's heads and of their recurrent
    states), chunked, with the prefix cache's snapshots on both: transformers' greedy tokens."""
    prompts = random_prompts((5, 23, 40))
    expected = reference_greedy(model, prompts, 12)
    params = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    with LLM(model=path, dtype="float32", max_total_tokens=1024, max_running_requests=4,
             tp_size=2, chunked_prefill_size=16, page_size=4) as llm:
        engine = llm.runtime.engine
        assert engine.tp.size == 2 and engine.states is not None
        assert engine.states.recurrent.shape[2] * 2 == engine.arch.linear.state_shape[0]
        first = llm.generate(input_ids=prompts, sampling_params=params)
        again = llm.generate(input_ids=prompts, sampling_params=params)
        llm.check_integrity()
    assert [r["output_ids"] for r in first] == expected
    assert [r["output_ids"] for r in again] == expected
    assert all(r["meta_info"]["cached_tokens"] > 0 for r in again)


@pytest.mark.parametrize("flags, named", [
    ({"tp_size": 4}, "--tp-size 4"),
])
def test_what_hybrids_do_not_run_with_yet_is_refused_in_one_line(qwen3_next, flags, named):
    _, path = qwen3_next
    with pytest.raises(ValueError, match=named) as refused:
        Engine(EngineConfig(model_path=path, dtype="float32", max_total_tokens=256, **flags))
    assert "\n" not in str(refused.value)


# max |bfloat16 states - float32 states| over all vocab logits (of order 1) across 40 positions
# of chunks and decodes, each step rounding every state once: 7e-5 at most in these families
BF16_STATE_TOLERANCE = 1e-3


def test_bfloat16_states_stay_near_the_float32_ones(qwen3_next) -> None:
    """--mamba-ssm-dtype bfloat16: the pool keeps the recurrent states in half the bytes and
    the logits of a prompt forwarded in chunks and decodes stay within BF16_STATE_TOLERANCE of
    the float32 states' (the updates themselves float32 both)."""
    _, path = qwen3_next
    ids = random_prompts((40,))[0]
    spans = [(0, 7), (7, 23), (23, 24), (24, 25), (25, 40)]
    logits, nbytes = {}, {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(EngineConfig(model_path=path, dtype="float32", max_total_tokens=256,
                                     max_running_requests=2, mamba_ssm_dtype=dtype))
        try:
            assert engine.states.recurrent.dtype == getattr(torch, dtype)
            nbytes[dtype] = engine.states.recurrent.nbytes
            logits[dtype] = forward_spans(engine, ids, spans)
        finally:
            engine.shutdown()
    assert nbytes["bfloat16"] * 2 == nbytes["float32"]
    assert (logits["bfloat16"] - logits["float32"]).abs().max().item() < BF16_STATE_TOLERANCE


def test_bfloat16_states_are_refused_where_the_cpu_kernels_do_not_run(qwen3_next,
                                                                       monkeypatch) -> None:
    from minisgl.engine import placement
    monkeypatch.setattr(placement, "cpu_kernels", lambda: None)
    with pytest.raises(ValueError, match="--mamba-ssm-dtype bfloat16") as refused:
        Engine(EngineConfig(model_path=qwen3_next[1], dtype="float32", max_total_tokens=256,
                            mamba_ssm_dtype="bfloat16"))
    assert "\n" not in str(refused.value)


def test_a_multimodal_qwen3_5_checkpoint_is_served_as_its_text_model(tmp_path) -> None:
    """Qwen3_5ForConditionalGeneration (most Qwen3.5 checkpoints): its text model under
    model.language_model beside its vision tower; greedy text equals transformers'."""
    import transformers
    torch.manual_seed(0)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=SHAPE["hidden_size"], patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2)
    config = transformers.Qwen3_5Config(text_config=SHAPE, vision_config=vision)
    model = transformers.Qwen3_5ForConditionalGeneration(config).float().eval()
    model.save_pretrained(tmp_path)
    prompts = random_prompts((9, 30))
    expected = reference_greedy(model, prompts, 10)
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    with LLM(model=str(tmp_path), dtype="float32", max_total_tokens=1024) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
    assert [r["output_ids"] for r in outs] == expected


@pytest.mark.parametrize("length", [2, 63, 64, 150])
def test_the_chunked_delta_rule_is_the_recurrence(length: int) -> None:
    """Prefill runs the delta rule in blocks (a triangular solve per block); it must equal the
    token-by-token recurrence, outputs and final state, from any starting state."""
    from minisgl.models.qwen3_next import (chunked_gated_delta_rule, gated_delta_rule,
                                           l2_normalized)
    gen = torch.Generator().manual_seed(length)
    heads, dk, dv = 4, 8, 16
    q = l2_normalized(torch.randn(length, heads, dk, generator=gen)) * dk ** -0.5
    k = l2_normalized(torch.randn(length, heads, dk, generator=gen))
    v = torch.randn(length, heads, dv, generator=gen)
    decay = -2 * torch.rand(length, heads, generator=gen)
    beta = torch.rand(length, heads, generator=gen)
    start = torch.randn(heads, dk, dv, generator=gen)
    stepped, blocked = start.clone(), start.clone()
    expected = gated_delta_rule(q, k, v, decay, beta, stepped)
    ours = chunked_gated_delta_rule(q, k, v, decay, beta, blocked, chunk=32)
    assert (ours - expected).abs().max().item() < 1e-5
    assert (blocked - stepped).abs().max().item() < 1e-5


QWEN_NARROW = {"num_hidden_layers": 4, "hidden_size": 128, "num_experts": 4,
               "num_experts_per_tok": 2, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 32, "vocab_size": 1024, "head_dim": 32,
               "linear_key_head_dim": 16, "linear_value_head_dim": 16, "intermediate_size": 64}
# its first six layers (five Mamba2, one attention), in the Hub's layer names (mamba, attention)
GRANITE_NARROW = {"num_hidden_layers": 6, "hidden_size": 128, "num_local_experts": 4,
                  "num_experts_per_tok": 2, "intermediate_size": 32,
                  "shared_intermediate_size": 64, "vocab_size": 1024, "mamba_n_heads": 8,
                  "mamba_d_head": 32, "mamba_d_state": 16, "num_attention_heads": 4,
                  "num_key_value_heads": 2}


@pytest.mark.parametrize("config, narrow", [("qwen3-next-80b-a3b", QWEN_NARROW),
                                            ("qwen3.5-35b-a3b", QWEN_NARROW),
                                            ("granite-4.0-h-tiny", GRANITE_NARROW)])
def test_shipped_hybrid_shapes_build_from_dummy_weights_and_decode(config: str, narrow) -> None:
    """The shipped shape-only configs (their layer layout, projections and shared experts),
    narrowed so that the test stays small: random weights load into every parameter and a
    batch decodes. (Four real layers of Qwen3.5-35B-A3B: BENCHMARKS.md, "Hybrid models".)"""
    import json
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with LLM(model=config, load_format="dummy", dtype="float32", max_total_tokens=1024,
             json_model_override_args=json.dumps(narrow)) as llm:
        outs = llm.generate(input_ids=random_prompts((12, 30)), sampling_params=params)
        assert llm.runtime.engine.states is not None
        llm.check_integrity()
    assert all(len(r["output_ids"]) == 6 for r in outs)



@pytest.mark.parametrize("length", [2, 63, 64, 150])
def test_the_blocked_mamba2_scan_is_the_recurrence(length: int) -> None:
    from minisgl.models.granite_hybrid import mamba2_blocked, mamba2_recurrence
    gen = torch.Generator().manual_seed(length)
    heads, head_dim, d_state = 4, 8, 16
    x = torch.randn(length, heads, head_dim, generator=gen)
    dt = torch.rand(length, heads, generator=gen)
    log_a = -4 * torch.rand(heads, generator=gen)
    b = torch.randn(length, heads, d_state, generator=gen)
    c = torch.randn(length, heads, d_state, generator=gen)
    start = torch.randn(heads, head_dim, d_state, generator=gen)
    stepped, blocked = start.clone(), start.clone()
    expected = mamba2_recurrence(x, dt, log_a, b, c, stepped)
    ours = mamba2_blocked(x, dt, log_a, b, c, blocked, chunk=32)
    assert (ours - expected).abs().max().item() < 1e-4
    assert (blocked - stepped).abs().max().item() < 1e-4
