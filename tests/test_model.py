"""Our model code and engine against transformers float32 on the same SmolLM2 weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from minisgl.core import Batch
from minisgl.engine import Engine, EngineConfig
from tests import reference as ref

LOGIT_TOLERANCE = 1e-3  # max |ours - reference| over all vocab logits, float32


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(dtype="float32", max_total_tokens=4096, max_running_requests=4))


def forward_spans(engine: Engine, ids: list[int], spans: list[tuple[int, int]]) -> torch.Tensor:
    """Logits of every position of one request (page-table row 0), run as the given
    [start, end) steps through the paged KV pool: a step after the first has the earlier ones
    as its cached prefix, and a one-token step after the first is a decode. `ids` are the
    request's prompt (a LongRoPE table's rows follow from its length)."""
    assert engine.page_table.shape[1] >= len(ids)
    engine.page_table[0, : len(ids)] = torch.arange(len(ids), dtype=torch.int32)
    long_rope = engine.arch.long_rope
    logits = []
    for start, end in spans:
        positions = torch.arange(start, end)
        rope = (None if long_rope is None else
                long_rope.table_rows(positions, [start], [end - start], [len(ids)]))
        batch = Batch("decode" if end - start == 1 and start else "prefill", 1, table_rows=[0],
                      cached_lens=[start], seq_lens=[end], extend_lens=[end - start],
                      input_positions=positions, out_loc=positions.clone())
        engine.attn_backend.prepare_metadata(batch)
        with torch.inference_mode():
            logits.append(engine.model(torch.tensor(ids[start:end]),
                                       positions if rope is None else rope, batch,
                                       engine.attn_backend, None).float())
    return torch.cat(logits)


def forward_positions(engine: Engine, ids: list[int], prefill_len: int) -> torch.Tensor:
    """Logits for every position: a prefill of ids[:prefill_len], then one decode step per
    remaining token (teacher forcing), through both attention paths."""
    return forward_spans(engine, ids, [(0, prefill_len)] +
                         [(p, p + 1) for p in range(prefill_len, len(ids))])


@pytest.mark.parametrize("text", [ref.PLAIN_PROMPTS[0], ref.chat_prompt(ref.CHAT_QUESTIONS[0])])
def test_teacher_forced_logits_match_transformers(engine: Engine, text: str) -> None:
    ids = ref.prompt_ids(text) + ref.prompt_ids(" and then some more words follow here")
    ours = forward_positions(engine, ids, prefill_len=len(ids) - 8)
    theirs = ref.hf_logits(ids)
    diff = (ours - theirs).abs().max().item()
    print(f"max |logit diff| = {diff:.3g} over {len(ids)} positions")
    assert diff < LOGIT_TOLERANCE


def test_chunked_prefix_logits_match(engine: Engine) -> None:
    """A prefill over a cached prefix (masked SDPA path) gives the same logits."""
    ids = ref.prompt_ids(ref.PLAIN_PROMPTS[2] + " the old miller lived with his daughter")
    full = forward_positions(engine, ids, prefill_len=len(ids))
    # first half as one prefill, second half as a prefill over the cached first half
    half = len(ids) // 2
    forward_positions(engine, ids[:half], prefill_len=half)
    positions = torch.arange(half, len(ids))
    batch = Batch("prefill", 1, table_rows=[0], cached_lens=[half], seq_lens=[len(ids)],
                  extend_lens=[len(ids) - half], input_positions=positions,
                  out_loc=positions.clone())
    engine.page_table[0, : len(ids)] = torch.arange(len(ids), dtype=torch.int32)
    engine.attn_backend.prepare_metadata(batch)
    with torch.inference_mode():
        second = engine.model(torch.tensor(ids[half:]), positions, batch, engine.attn_backend,
                              None).float()
    assert (second - full[half:]).abs().max().item() < LOGIT_TOLERANCE


@pytest.fixture(scope="module")
def llm():
    from minisgl import LLM
    with LLM(dtype="float32", max_total_tokens=8192, max_running_requests=8) as llm:
        yield llm


def all_prompts() -> list[str]:
    return ref.PLAIN_PROMPTS + [ref.chat_prompt(q) for q in ref.CHAT_QUESTIONS]


def test_greedy_generation_matches_transformers(llm) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 24}
    for text in all_prompts():
        ids = ref.prompt_ids(text)
        out = llm.generate(input_ids=ids, sampling_params=greedy)
        expected = ref.hf_greedy(ids, 24)
        ref.assert_greedy_matches(ids, out["output_ids"], expected)
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["meta_info"]["completion_tokens"] == len(out["output_ids"])


def test_batch_equals_each_alone(llm) -> None:
    greedy = {"temperature": 0, "max_new_tokens": 24}
    prompts = all_prompts()
    together = llm.generate(prompt=prompts, sampling_params=greedy)
    for text, out in zip(prompts, together):
        alone = llm.generate(prompt=text, sampling_params=greedy)
        ids = ref.prompt_ids(text)
        ref.assert_greedy_matches(ids, out["output_ids"], alone["output_ids"])
        if out["output_ids"] == alone["output_ids"]:
            assert out["text"] == alone["text"]
    llm.check_integrity()


def test_generate_shapes(llm) -> None:
    out = llm.generate(prompt="Hello", sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert isinstance(out, dict) and set(out) == {"text", "output_ids", "meta_info"}
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    outs = llm.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params={"max_new_tokens": 2})
    assert isinstance(outs, list) and len(outs) == 2
    assert all(len(o["output_ids"]) == 2 for o in outs)


def test_sampled_generation_is_seeded(llm) -> None:
    params = {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 16, "sampling_seed": 7}
    a = llm.generate(prompt="Tell me a story", sampling_params=params)
    b = llm.generate(prompt=["Tell me a story", "Another prompt"],
                     sampling_params=[params, {"temperature": 1.0, "max_new_tokens": 20}])[0]
    assert a["output_ids"] == b["output_ids"]


@pytest.mark.parametrize("config, layers, dtype", [
    ("llama-3.1-8b", 2, "auto"), ("qwen3-0.6b", 2, "auto"), ("gemma3-4b", 2, "auto"),
    ("qwen3-30b-a3b", 1, "auto"), ("mixtral-8x7b", 1, "bfloat16")])
def test_dummy_weights_build_and_run(config: str, layers: int, dtype: str) -> None:
    # NOTE: few layers and a 32k vocabulary: the 8B shape's full embedding and head alone are
    # 1B parameters to fill with random values, one Mixtral layer's experts 1.4B
    engine = Engine(EngineConfig(
        model_path=config, load_format="dummy", max_total_tokens=256, max_running_requests=2,
        dtype=dtype, json_model_override_args=json.dumps({"num_hidden_layers": layers,
                                                          "vocab_size": 32000})))
    ids = list(range(100, 120))
    logits = forward_positions(engine, ids, prefill_len=16)
    assert logits.shape == (len(ids), engine.arch.vocab_size)
    assert torch.isfinite(logits).all()
    engine.shutdown()


def test_cli_generate_paris() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "minisgl", "generate", "--prompt", "The capital of France is",
         "--max-new-tokens", "8", "--temperature", "0", "--dtype", "float32",
         "--max-total-tokens", "1024"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(" Paris")


def test_cli_missing_model_is_one_clear_line() -> None:
    out = subprocess.run([sys.executable, "-m", "minisgl", "generate", "--prompt", "x",
                          "--model", "/no/such/model"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "not found" in out.stderr
    assert "Traceback" not in out.stderr


TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny_hf_model(kind: str):
    import transformers
    if kind == "llama3-rope":
        config = transformers.LlamaConfig(**TINY, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
        return transformers.LlamaForCausalLM(config)
    if kind == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY,
                                                                      tie_word_embeddings=True))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, head_dim=32,
                                                                  tie_word_embeddings=False))


@pytest.mark.parametrize("kind", ["llama3-rope", "qwen2", "qwen3"])
def test_architectures_match_transformers(kind: str, tmp_path) -> None:
    """Qwen2 (q/k/v bias), Qwen3 (q/k norm) and Llama 3 RoPE scaling, each a tiny random model
    saved as a Hugging Face folder, against transformers' own implementation."""
    torch.manual_seed(0)
    model = tiny_hf_model(kind).eval()
    with torch.no_grad():  # random biases: transformers initialises them to zero
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(tmp_path)
    engine = Engine(EngineConfig(model_path=str(tmp_path), dtype="float32",
                                 max_total_tokens=256, max_running_requests=2))
    ids = torch.randint(0, TINY["vocab_size"], (100,), generator=torch.Generator().manual_seed(1))
    ours = forward_positions(engine, ids.tolist(), prefill_len=90)
    with torch.inference_mode():
        theirs = model(ids[None]).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4
    engine.shutdown()
