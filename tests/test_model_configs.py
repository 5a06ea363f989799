"""Config values that change a model's math: honoured, or refused at start, never ignored.
Each reference is transformers float32 on a tiny random model built here (nothing downloaded)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Callable

import pytest
import torch

from minisgl.engine import Engine, EngineConfig
from minisgl.models.arch import layer_windows
from minisgl.models.registry import UnsupportedModel
from tests.test_model import TINY, forward_spans

WINDOW = 16
LOGIT_TOLERANCE = 1e-4  # max |ours - transformers| over all vocab logits, float32


def save_tiny(model_class: str, config_class: str, path, **overrides) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**TINY, **overrides})
    model = getattr(transformers, model_class)(config).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> tuple[torch.nn.Module, str]:
    path = tmp_path_factory.mktemp("mistral-window")
    return save_tiny("MistralForCausalLM", "MistralConfig", path, sliding_window=WINDOW), str(path)


def tiny_engine(path: str, attention: str = "kernel", context_length: int | None = None
                ) -> Engine:
    engine = Engine(EngineConfig(model_path=path, dtype="float32", max_total_tokens=256,
                                 max_running_requests=2, context_length=context_length))
    if attention == "sdpa":  # the path without the compiled kernels: SDPA and matmuls
        engine.attn_backend.kernels = None
    return engine


def assert_logits_match(model: torch.nn.Module, path: str, spans: list[tuple[int, int]],
                        seed: int, attention: str = "kernel", vocab: int = TINY["vocab_size"],
                        check: Callable[[Engine], None] | None = None,
                        context_length: int | None = None) -> None:
    """Our logits of random tokens, run as `spans`, equal transformers' (LOGIT_TOLERANCE);
    `check` looks at the engine first."""
    engine = tiny_engine(path, attention, context_length)
    try:
        if check is not None:
            check(engine)
        ids = torch.randint(0, vocab, (spans[-1][1],),
                            generator=torch.Generator().manual_seed(seed))
        ours = forward_spans(engine, ids.tolist(), spans)
        with torch.inference_mode():
            theirs = model(input_ids=ids[None]).logits[0]
        assert (ours - theirs).abs().max().item() < LOGIT_TOLERANCE
    finally:
        engine.shutdown()


def assert_greedy_matches_transformers(model: torch.nn.Module, path, lengths: tuple[int, ...],
                                       new_tokens: int, tp_sizes: tuple[int, ...] = (1, 2)
                                       ) -> None:
    """Greedy generation of random prompts of `lengths`, batched through the scheduler at each
    TP size, equals transformers' own greedy generation of each prompt."""
    from minisgl.llm import LLM
    prompts = [torch.randint(0, TINY["vocab_size"], (n,),
                             generator=torch.Generator().manual_seed(n)).tolist()
               for n in lengths]
    with torch.inference_mode():
        expected = [model.generate(torch.tensor([ids]), max_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=0, eos_token_id=None
                                   )[0, len(ids):].tolist() for ids in prompts]
    params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    for tp in tp_sizes:
        with LLM(model=str(path), dtype="float32", max_total_tokens=1024, tp_size=tp) as llm:
            outputs = [r["output_ids"] for r in llm.generate(input_ids=prompts,
                                                             sampling_params=params)]
        assert outputs == expected, f"tp {tp}"


def windows_are(engine: Engine, windows: tuple[int, ...]) -> None:
    assert engine.attn_backend.windows == windows


STEPS = {  # spans over 60 tokens, the window being 16
    "prefill + decode": [(0, 40)] + [(p, p + 1) for p in range(40, 60)],
    "chunked prefill": [(0, 24), (24, 48)] + [(p, p + 1) for p in range(48, 60)],
}


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
def test_sliding_window_matches_transformers_past_the_window(mistral, attention: str,
                                                             steps: str) -> None:
    """A Mistral with a 16-token window on 60 tokens: prefill, chunked prefill over a cached
    prefix, and decode all see only the window, as transformers does."""
    model, path = mistral

    def full_context(engine: Engine) -> None:
        assert engine.context_len == TINY["max_position_embeddings"]

    assert_logits_match(model, path, STEPS[steps], seed=1, attention=attention,
                        check=full_context)


def test_per_layer_windows_match_transformers(tmp_path) -> None:
    """Qwen2 with use_sliding_window: only the layers from max_window_layers on are windowed."""
    model = save_tiny("Qwen2ForCausalLM", "Qwen2Config", tmp_path, use_sliding_window=True,
                      sliding_window=WINDOW, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    assert_logits_match(model, str(tmp_path), STEPS["prefill + decode"], seed=3,
                        check=lambda engine: windows_are(engine, (0, WINDOW)))


def test_windowed_greedy_generation_matches_transformers_batched_and_alone(mistral) -> None:
    """Greedy generation past the window, through the scheduler: each prompt alone, then all
    together, equal transformers' own greedy generation."""
    from minisgl.llm import LLM
    model, path = mistral
    prompts = [torch.randint(0, TINY["vocab_size"], (n,),
                             generator=torch.Generator().manual_seed(n)).tolist()
               for n in (5, 20, 37)]
    expected = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            expected.append(out[0, len(ids):].tolist())
    params = {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True}
    with LLM(model=path, dtype="float32", max_total_tokens=1024) as llm:
        alone = [llm.generate(input_ids=ids, sampling_params=params)["output_ids"]
                 for ids in prompts]
        together = [r["output_ids"] for r in llm.generate(input_ids=prompts,
                                                          sampling_params=params)]
    assert alone == expected
    assert together == expected


@pytest.mark.parametrize("hub_fields", [
    {"use_sliding_window": False, "sliding_window": 131072},  # Qwen2.5's hub config
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},
    {"use_sliding_window": True, "sliding_window": None},
])
def test_windowed_layers_as_transformers_reads_them(hub_fields: dict) -> None:
    """Which layers are windowed, from a Hub-style Qwen2 config: as transformers derives its
    layer_types, and again from the layer_types it writes."""
    import transformers
    raw = {**TINY, "num_hidden_layers": 3, "model_type": "qwen2", **hub_fields}
    config = transformers.Qwen2Config(**raw)
    expected = tuple(config.sliding_window if kind == "sliding_attention" else 0
                     for kind in config.layer_types)
    assert layer_windows(raw) == expected
    assert layer_windows(config.to_dict()) == expected


@pytest.mark.parametrize("model_type, fields, windowed", [
    ("llama", {}, False),  # LlamaAttention takes no window
    ("mistral", {}, True), ("mixtral", {}, True), ("phi3", {}, True),  # theirs: every layer
    ("qwen3_moe", {"use_sliding_window": False}, False),
    ("qwen3_moe", {"use_sliding_window": True, "max_window_layers": 2}, True),  # no split
])
def test_which_families_apply_a_configs_window(model_type: str, fields: dict,
                                               windowed: bool) -> None:
    """Families without layer_types in their configs: transformers' attention of Mistral,
    Mixtral and Phi-3 applies sliding_window to every layer, Qwen3-MoE's to every layer where
    use_sliding_window is on, Llama's never."""
    raw = {**TINY, "model_type": model_type, "sliding_window": 8, **fields}
    assert layer_windows(raw) == ((8, 8) if windowed else (0, 0))


def test_qwen2_with_its_window_off_serves_the_full_context(tmp_path) -> None:
    save_tiny("Qwen2ForCausalLM", "Qwen2Config", tmp_path, use_sliding_window=False,
              sliding_window=8)
    config = json.loads((tmp_path / "config.json").read_text())
    config["sliding_window"] = 8  # as Hub configs keep it, beside use_sliding_window: false
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = Engine(EngineConfig(model_path=str(tmp_path), dtype="float32",
                                 max_total_tokens=256, max_running_requests=2))
    assert engine.context_len == TINY["max_position_embeddings"]
    engine.shutdown()


@pytest.mark.parametrize("field, value", [("hidden_act", "gelu"), ("mlp_bias", True)])
def test_math_we_do_not_compute_is_refused(tmp_path, field: str, value) -> None:
    save_tiny("LlamaForCausalLM", "LlamaConfig", tmp_path, **{field: value})
    with pytest.raises(UnsupportedModel, match=f"{field}={value!r}"):
        Engine(EngineConfig(model_path=str(tmp_path), dtype="float32", max_total_tokens=256))


def test_refusal_is_one_line_at_start(tmp_path) -> None:
    save_tiny("LlamaForCausalLM", "LlamaConfig", tmp_path, hidden_act="gelu")
    out = subprocess.run([sys.executable, "-m", "minisgl", "generate", "--prompt", "x",
                          "--model", str(tmp_path), "--dtype", "float32"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "hidden_act='gelu'" in out.stderr
    assert "Traceback" not in out.stderr


def test_an_architecture_we_do_not_serve_names_those_we_do(tmp_path) -> None:
    save_tiny("GemmaForCausalLM", "GemmaConfig", tmp_path, head_dim=16)
    with pytest.raises(UnsupportedModel, match="unsupported architecture 'GemmaForCausalLM'.*"
                                               "LlamaForCausalLM"):
        Engine(EngineConfig(model_path=str(tmp_path), dtype="float32", max_total_tokens=256))


def test_a_multimodal_checkpoint_we_do_not_serve_is_refused_in_one_line(tmp_path) -> None:
    """Mistral 3 (like Llama 4) nests its text model's numbers under `text_config`: the
    refusal names its architecture and those we serve, in one line."""
    import transformers
    text = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    config = transformers.Mistral3Config(
        text_config=text,
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "head_dim": 16, "image_size": 64,
                       "patch_size": 16})
    torch.manual_seed(0)
    transformers.Mistral3ForConditionalGeneration(config).save_pretrained(tmp_path)
    assert "num_attention_heads" not in json.loads((tmp_path / "config.json").read_text())
    out = subprocess.run([sys.executable, "-m", "minisgl", "generate", "--prompt", "x",
                          "--model", str(tmp_path), "--dtype", "float32"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr, out.stderr
    assert ("unsupported architecture 'Mistral3ForConditionalGeneration'" in out.stderr
            and "LlamaForCausalLM" in out.stderr), out.stderr


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 32}


@pytest.mark.parametrize("spelling", ["transformers", "hub"])
@pytest.mark.parametrize("extra", [{}, {"attention_factor": 0.8, "beta_fast": 16,
                                        "beta_slow": 2}], ids=["defaults", "given"])
def test_yarn_rope_matches_transformers(tmp_path, spelling: str, extra: dict) -> None:
    """A tiny Qwen3 with YaRN scaling, positions well past its original 32-token context, in
    transformers 5's spelling (`rope_parameters`) and in the Hub's (`rope_theta` beside
    `rope_scaling` with "type")."""
    model = save_tiny("Qwen3ForCausalLM", "Qwen3Config", tmp_path, head_dim=32,
                      rope_parameters={**YARN, **extra})
    if spelling == "hub":
        config = json.loads((tmp_path / "config.json").read_text())
        rope = config.pop("rope_parameters")
        rope["type"] = rope.pop("rope_type")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope
        (tmp_path / "config.json").write_text(json.dumps(config))
    assert_logits_match(model, str(tmp_path), [(0, 100)] + [(p, p + 1) for p in range(100, 120)],
                        seed=2)


def test_a_context_past_the_models_positions_is_refused(mistral) -> None:
    with pytest.raises(ValueError, match="longer than the model's 256 positions"):
        Engine(EngineConfig(model_path=mistral[1], dtype="float32", context_length=512,
                            max_total_tokens=1024))


def test_windowed_tp2_equals_tp1(mistral) -> None:
    """Tensor parallelism splits the heads; each rank applies the same window."""
    from minisgl.llm import LLM
    _, path = mistral
    prompts = [list(range(3, 40)), list(range(100, 110))]
    params = {"max_new_tokens": 25, "temperature": 0, "ignore_eos": True}
    outputs = []
    for tp in (1, 2):
        with LLM(model=path, dtype="float32", max_total_tokens=1024, tp_size=tp) as llm:
            outputs.append([r["output_ids"] for r in llm.generate(input_ids=prompts,
                                                                  sampling_params=params)])
    assert outputs[0] == outputs[1]


PHI3_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=1)  # inside the tiny vocabulary


def test_phi3_fused_checkpoint_matches_transformers(tmp_path) -> None:
    """Phi-3 stores q/k/v and gate/up fused: each part lands where the unfused ones would."""
    model = save_tiny("Phi3ForCausalLM", "Phi3Config", tmp_path, **PHI3_IDS)
    assert_logits_match(model, str(tmp_path), STEPS["chunked prefill"], seed=4)


def test_phi3_tp2_equals_tp1(tmp_path) -> None:
    """Each rank reads its heads' rows out of the fused tensors."""
    from minisgl.llm import LLM
    save_tiny("Phi3ForCausalLM", "Phi3Config", tmp_path, **PHI3_IDS)
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    outputs = []
    for tp in (1, 2):
        with LLM(model=str(tmp_path), dtype="float32", max_total_tokens=1024, tp_size=tp) as llm:
            outputs.append(llm.generate(input_ids=list(range(5, 30)),
                                        sampling_params=params)["output_ids"])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
def test_phi4_mini_partial_rotary_matches_transformers(tmp_path, attention: str) -> None:
    """Phi-4-mini rotates the first 3/4 of each head's dimensions (frequencies over those);
    the rest pass through."""
    model = save_tiny("Phi3ForCausalLM", "Phi3Config", tmp_path, partial_rotary_factor=0.75,
                      **PHI3_IDS)
    def rotates_12_of_16(engine: Engine) -> None:
        assert engine.arch.head_dim == 16 and engine.arch.rotary_dim == 12

    assert_logits_match(model, str(tmp_path), STEPS["chunked prefill"], seed=12,
                        attention=attention, check=rotates_12_of_16)


def sharp_longrope_phi3(path) -> torch.nn.Module:
    """A tiny Phi-3 with LongRoPE (an original context of 32 in 256 positions) and a partial
    rotary factor, its queries and keys scaled up: random weights attend almost uniformly,
    whatever the rotation (the two factor sets' logprobs would differ by ~1e-3 only)."""
    model = save_tiny("Phi3ForCausalLM", "Phi3Config", path, partial_rotary_factor=0.5,
                      rope_parameters=longrope(32, 4), original_max_position_embeddings=32,
                      **PHI3_IDS)
    qk_rows = (TINY["num_attention_heads"] + TINY["num_key_value_heads"]) * 16  # head_dim 16
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight[:qk_rows] *= 8
    model.save_pretrained(path)
    return model


def longrope(original: int, half: int) -> dict:
    """(Phi3Config takes its own original_max_position_embeddings over the one given here.)"""
    gen = torch.Generator().manual_seed(13)
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "original_max_position_embeddings": original,
            "short_factor": (1 + torch.rand(half, generator=gen)).tolist(),
            "long_factor": (1 + 8 * torch.rand(half, generator=gen)).tolist()}


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
@pytest.mark.parametrize("context", ["short", "long"])
def test_phi3_longrope_matches_transformers(tmp_path, context: str, attention: str) -> None:
    """LongRoPE (Phi-3 128k), on sharp_longrope_phi3. Served with --context-length 32, every
    sequence rotates by the short factors, as transformers does up to 32 tokens; a sequence
    past 32 (60 tokens here, served with the whole 256) by the long ones from its first token,
    as transformers does."""
    model = sharp_longrope_phi3(tmp_path)
    if context == "short":
        spans = [(0, 20), (20, 28)] + [(p, p + 1) for p in range(28, 32)]
        assert_logits_match(model, str(tmp_path), spans, seed=13, attention=attention,
                            context_length=32)
    else:
        assert_logits_match(model, str(tmp_path), STEPS["chunked prefill"], seed=13,
                            attention=attention)


LOGPROB_TOLERANCE = 1e-4  # |ours - transformers'| per sampled token's logprob, float32


def cached_greedy(model: torch.nn.Module, ids: list[int], new_tokens: int
                  ) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs, one forward a token over its KV cache:
    each forward picks LongRoPE's factors by its own length, earlier keys keep theirs."""
    from transformers import DynamicCache
    tokens, logprobs, cache, step = [], [], DynamicCache(), ids
    with torch.inference_mode():
        for _ in range(new_tokens):
            out = model(input_ids=torch.tensor([step]), cache=cache, use_cache=True)
            scores = out.logits[0, -1].float().log_softmax(-1)
            tokens.append(int(scores.argmax()))
            logprobs.append(float(scores.max()))
            step = tokens[-1:]
    return tokens, logprobs


def assert_generated(result: dict, expected: tuple[list[int], list[float]], what: str) -> None:
    tokens, logprobs = expected
    assert result["output_ids"] == tokens, what
    ours = [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(ours, logprobs)) < LOGPROB_TOLERANCE, what


def test_phi3_longrope_picks_the_factors_per_sequence(tmp_path) -> None:
    """Served at the whole 256 positions (original 32), in one batch chunked by 16 tokens, at
    TP 1 and 2: a 10-token prompt decoding to 26 tokens rotates by the short factors, a
    40-token one by the long factors from its first token, and one of 20 decoding past 32 by
    the short ones, then the long ones from position 32 on (its earlier keys keep theirs;
    transformers' generate would recompute them at the crossing). The prefix cache never
    serves one rotation's KV to the other: the 40-token prompt's first 20 tokens run as a
    short prompt before the batch, and again after it."""
    from minisgl.llm import LLM
    model = sharp_longrope_phi3(tmp_path)
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen).tolist()
               for n in (10, 40, 20)]
    new_tokens = [16, 8, 24]
    expected = [cached_greedy(model, ids, n) for ids, n in zip(prompts, new_tokens)]
    head = cached_greedy(model, prompts[1][:20], 4)
    with torch.inference_mode():  # the reference is transformers' own generate where no
        for ids, n, (tokens, _) in zip(prompts[:2], new_tokens, expected):  # sequence crosses
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            assert out[0, len(ids):].tolist() == tokens
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in new_tokens]
    for tp in (1, 2):
        with LLM(model=str(tmp_path), dtype="float32", max_total_tokens=1024, tp_size=tp,
                 chunked_prefill_size=16) as llm:
            short = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
            first = llm.generate(input_ids=prompts[1][:20], sampling_params=short,
                                 return_logprob=True)
            outputs = llm.generate(input_ids=prompts, sampling_params=params,
                                   return_logprob=True)
            again = llm.generate(input_ids=prompts[1][:20], sampling_params=short,
                                 return_logprob=True)
            for i, (result, reference) in enumerate(zip(outputs, expected)):
                assert_generated(result, reference, f"tp {tp}, prompt {i}")
            assert_generated(first, head, f"tp {tp}, the short head, first")
            assert_generated(again, head, f"tp {tp}, the short head, again")


def test_dynamic_rope_is_the_default_within_the_context(tmp_path) -> None:
    """Dynamic NTK scaling changes the base only past max_position_embeddings, which the
    served context never is (a longer --context-length is refused)."""
    model = save_tiny("LlamaForCausalLM", "LlamaConfig", tmp_path, rope_parameters={
        "rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    assert_logits_match(model, str(tmp_path), STEPS["prefill + decode"], seed=14)


def tiny_gemma(path, model_class: str, config_class: str, fields: dict) -> torch.nn.Module:
    model = save_tiny(model_class, config_class, path, **fields)
    with torch.no_grad():  # the norms start at zero (1 + w = 1): give them values
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(path)
    return model


GEMMA3 = dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
              layer_types=["sliding_attention", "full_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                  "rope_theta": 100000.0},
                               "sliding_attention": {"rope_type": "default",
                                                     "rope_theta": 10000.0}})


def gemma3_hub_spelling(path) -> None:
    """Rewrite a saved Gemma 3 config as the Hub's configs spell it: rope_theta with
    rope_scaling for the full layers, rope_local_base_freq for the sliding ones, and
    sliding_window_pattern instead of layer_types."""
    config = json.loads((path / "config.json").read_text())
    ropes = config.pop("rope_parameters")
    config.pop("layer_types")
    full = dict(ropes["full_attention"])
    config["rope_theta"] = full.pop("rope_theta")
    config["rope_scaling"] = full
    config["rope_local_base_freq"] = ropes["sliding_attention"]["rope_theta"]
    config["sliding_window_pattern"] = 2
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("spelling", ["transformers", "hub"])
@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
def test_gemma3_matches_transformers(tmp_path, attention: str, spelling: str) -> None:
    """Gemma 3 text past its sliding window: scaled embeddings, (1 + w) norms, four norms a
    layer, q/k norms, GeGLU, query_pre_attn_scalar, local and global RoPE per layer type."""
    model = tiny_gemma(tmp_path, "Gemma3ForCausalLM", "Gemma3TextConfig", GEMMA3)
    if spelling == "hub":
        gemma3_hub_spelling(tmp_path)
    assert_logits_match(model, str(tmp_path), STEPS["chunked prefill"], seed=5,
                        attention=attention, check=lambda e: windows_are(e, (WINDOW, 0)))


def test_gemma3_greedy_generation_batched_and_tp2(tmp_path) -> None:
    """Through the scheduler, past the window: a batch equals transformers' greedy generation,
    and so does TP 2."""
    model = save_tiny("Gemma3ForCausalLM", "Gemma3TextConfig", tmp_path, **GEMMA3)
    assert_greedy_matches_transformers(model, tmp_path, (7, 30), new_tokens=24)


def test_multimodal_gemma3_is_served_as_its_text_model(tmp_path) -> None:
    """Gemma 3 4B and larger ship as Gemma3ForConditionalGeneration: the text model is read out
    of `text_config` (defaults the Hub leaves out filled in) and `language_model.*`, the vision
    tower skipped; the logits of a text prompt equal transformers' multimodal model's."""
    import transformers
    torch.manual_seed(0)
    text = {**TINY, **GEMMA3}
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, image_token_index=500,
                                       boi_token_index=501, eoi_token_index=502)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for default in ("rms_norm_eps", "hidden_activation", "final_logit_softcapping"):
        saved["text_config"].pop(default, None)  # as the Hub's configs leave them out
    (tmp_path / "config.json").write_text(json.dumps(saved))
    def text_model(engine: Engine) -> None:
        assert engine.arch.architecture == "Gemma3ForCausalLM"

    assert_logits_match(model, str(tmp_path), [(0, 30)] + [(p, p + 1) for p in range(30, 40)],
                        seed=6, vocab=500, check=text_model)  # below the image tokens


GEMMA2 = dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24,
              attn_logit_softcapping=0.01, final_logit_softcapping=0.5)  # small: they bite


def gemma2_hub_spelling(path) -> None:
    """As the Hub's Gemma 2 configs: no layer_types (sliding and full alternate), a
    hidden_act nothing reads, rope_theta at the top level."""
    config = json.loads((path / "config.json").read_text())
    config.pop("layer_types")
    config["hidden_act"] = "gelu_pytorch_tanh"
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    (path / "config.json").write_text(json.dumps(config))


def tiny_gemma2(path) -> torch.nn.Module:
    return tiny_gemma(path, "Gemma2ForCausalLM", "Gemma2Config", GEMMA2)


@pytest.mark.parametrize("spelling", ["transformers", "hub"])
@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
def test_gemma2_matches_transformers(tmp_path, attention: str, spelling: str) -> None:
    """Gemma 2 past its window: soft-capped attention scores (prefill, prefix, decode) and
    logits, alternating sliding and full layers, Gemma's norms and GeGLU. The caps are small
    enough that leaving either out moves the logits far past the tolerance (asserted)."""
    model = tiny_gemma2(tmp_path)
    if spelling == "hub":
        gemma2_hub_spelling(tmp_path)
    ids = torch.randint(0, TINY["vocab_size"], (60,), generator=torch.Generator().manual_seed(11))
    with torch.inference_mode():
        capped = model(input_ids=ids[None]).logits
        model.config.final_logit_softcapping = None
        without_final = model(input_ids=ids[None]).logits
        model.config.final_logit_softcapping = GEMMA2["final_logit_softcapping"]
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        without_attention = model(input_ids=ids[None]).logits
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = GEMMA2["attn_logit_softcapping"]
    for uncapped in (without_final, without_attention):
        assert (capped - uncapped).abs().max() > 100 * LOGIT_TOLERANCE

    def check(engine: Engine) -> None:
        windows_are(engine, (WINDOW, 0))
        assert engine.attn_backend.softcap == GEMMA2["attn_logit_softcapping"]

    assert_logits_match(model, str(tmp_path), STEPS["chunked prefill"], seed=11,
                        attention=attention, check=check)


def test_gemma2_greedy_generation_batched_and_tp2(tmp_path) -> None:
    """Through the scheduler, past the window: a batch equals transformers' greedy generation
    (soft-capped scores in prefill and decode), and so does TP 2."""
    assert_greedy_matches_transformers(tiny_gemma2(tmp_path), tmp_path, (9, 31), new_tokens=20)
