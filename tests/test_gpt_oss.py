"""gpt-oss (GptOssForCausalLM): attention sinks, alternating windowed and full layers, biased
q/k/v/o, YaRN, and experts with a biased router, biased projections and the clamped SwiGLU.
The reference is transformers float32 on a tiny random model built here (nothing downloaded),
its sinks and biases drawn large enough that each shows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from minisgl.engine import Engine, EngineConfig
from tests.test_model_configs import (STEPS, TINY, WINDOW, assert_greedy_matches_transformers,
                                      assert_logits_match)

SHAPE = dict(intermediate_size=32, num_hidden_layers=4, head_dim=16, num_local_experts=4,
             num_experts_per_tok=2, sliding_window=WINDOW, pad_token_id=0, bos_token_id=1,
             eos_token_id=1,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                              "original_max_position_embeddings": 64})


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[torch.nn.Module, str]:
    path = tmp_path_factory.mktemp("gpt-oss")
    return save_gpt_oss(path), str(path)


def save_gpt_oss(path: Path, **fields) -> torch.nn.Module:
    import transformers
    torch.manual_seed(0)
    config = transformers.GptOssConfig(**{**TINY, **SHAPE, **fields})
    model = transformers.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "sinks" in name or "bias" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("steps", STEPS)
@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
def test_gpt_oss_matches_transformers_past_the_window(gpt_oss, attention: str,
                                                      steps: str) -> None:
    """60 tokens, prefill or chunks over a cached prefix then decodes, on the compiled kernel
    and on the torch path: every layer's sinks, the windowed layers (0 and 2) seeing 16
    tokens."""
    def check(engine: Engine) -> None:
        assert engine.attn_backend.windows == (WINDOW, 0, WINDOW, 0)
        attention_ = engine.model.layers[0].self_attn
        assert attention_.sinks is not None and attention_.o_proj.bias is not None

    assert_logits_match(*gpt_oss, STEPS[steps], seed=9, attention=attention, check=check)


def test_gpt_oss_greedy_batched_over_one_and_two_ranks(gpt_oss) -> None:
    """Each rank holds half the query heads with their sinks, and half of every expert."""
    assert_greedy_matches_transformers(*gpt_oss, (7, 30, 45), 12)


def test_gpt_oss_flashinfer_is_refused_for_its_sinks(gpt_oss) -> None:
    with pytest.raises(ValueError, match="sinks") as refused:
        Engine(EngineConfig(model_path=gpt_oss[1], dtype="float32", max_total_tokens=256,
                            attention_backend="flashinfer"))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("quantization", [None, "mxfp4"])
def test_the_shipped_gpt_oss_20b_shape_builds_from_dummy_weights_and_decodes(quantization
                                                                             ) -> None:
    """The shipped shape-only config (the Hub's spelling: rope_scaling, rope_theta), narrowed
    to its first two layers (one windowed, one full): random weights reach every parameter
    (mxfp4: the experts random MXFP4 blocks, as the released checkpoints hold them) and a
    batch decodes."""
    import json

    from minisgl.llm import LLM
    from tests.test_hybrid import random_prompts
    narrow = {"num_hidden_layers": 2, "hidden_size": 128, "intermediate_size": 64,
              "num_local_experts": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
              "head_dim": 32, "vocab_size": 1024}
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    with LLM(model="gpt-oss-20b", load_format="dummy", dtype="float32", max_total_tokens=1024,
             json_model_override_args=json.dumps(narrow), quantization=quantization) as llm:
        engine = llm.runtime.engine
        assert engine.attn_backend.windows == (128, 0)
        experts = engine.model.layers[0].mlp.experts
        assert (experts.quantized is not None) == (quantization == "mxfp4")
        assert all(p.isfinite().all() for p in engine.model.parameters())
        outs = llm.generate(input_ids=random_prompts((12, 30)), sampling_params=params)
        llm.check_integrity()
    assert all(len(r["output_ids"]) == 6 for r in outs)


GGUF_VOCAB = 49152  # the bundled tokenizer's, which the file carries


@pytest.mark.parametrize("experts", [None, "MXFP4"])
def test_a_gpt_oss_gguf_file_serves_transformers_logits(tmp_path, experts: str | None) -> None:
    """llama.cpp's `gpt-oss` file (F32, or its experts MXFP4 as the released files hold them):
    the config from its metadata (YaRN, the window on every other layer),
    the experts' gate and up apart. The reference is transformers on the checkpoint, its
    experts replaced by the file's values (gguf's own dequantization)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, dequantize

    from tests.gguf_families import write_gpt_oss_gguf
    model = save_gpt_oss(tmp_path / "hf", vocab_size=GGUF_VOCAB, intermediate_size=64)
    kind = GGMLQuantizationType[experts] if experts else None
    gguf = write_gpt_oss_gguf(tmp_path / "hf", tmp_path / "tiny.gguf", kind)
    stored = {t.name: torch.from_numpy(np.array(dequantize(t.data, t.tensor_type),
                                                dtype=np.float32))
              for t in GGUFReader(str(gguf)).tensors if "_exps.weight" in t.name}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            gate, up, down = (stored[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate", "up",
                                                                                  "down"))
            interleaved = torch.stack((gate, up), dim=2).flatten(1, 2)  # [E, 2 I, hidden]
            layer.mlp.experts.gate_up_proj.copy_(interleaved.transpose(1, 2))
            layer.mlp.experts.down_proj.copy_(down.transpose(1, 2))

    def check(engine: Engine) -> None:
        assert type(engine.model).__name__ == "GptOssForCausalLM"
        assert engine.attn_backend.windows == (WINDOW, 0, WINDOW, 0)

    assert_logits_match(model, str(gguf), STEPS["chunked prefill"], seed=10, vocab=GGUF_VOCAB,
                        check=check)


@pytest.mark.parametrize("experts", ["Q8_0", "MXFP4"])
def test_a_gpt_oss_file_keeps_its_experts_as_blocks(tmp_path, experts: str) -> None:
    """--quantization gguf: each expert's gate/up and down are blocks (their biases added
    after; MXFP4's e2m1 codes through the kernel's table), with the logits of the same file
    dequantized (bfloat16 both; bound BF16_REL_BOUND). Every token takes every expert, so that
    no near-tie of the router's scores flips a choice between the two roundings."""
    from gguf import GGMLQuantizationType

    from tests.gguf_families import write_gpt_oss_gguf
    from tests.test_hybrid_gguf import assert_blocks_give_the_dequantized_logits
    save_gpt_oss(tmp_path / "hf", vocab_size=GGUF_VOCAB, intermediate_size=64,
                 num_experts_per_tok=4)
    gguf = write_gpt_oss_gguf(tmp_path / "hf", tmp_path / f"tiny.{experts}.gguf",
                              GGMLQuantizationType[experts])

    def check(engine: Engine, blocks: bool) -> None:
        experts = engine.model.layers[0].mlp.experts
        assert (experts.quantized is not None) == blocks
        assert experts.gate_up_bias is not None

    assert_blocks_give_the_dequantized_logits(gguf, check)
    # the converted folder leaves the quantized linears in the file (read from there, as
    # blocks or dequantized): the experts are never written out in float32
    from safetensors import safe_open

    from minisgl.models.weights import resolve_model_path
    with safe_open(str(resolve_model_path(str(gguf)) / "model.safetensors"), "pt") as f:
        assert not [name for name in f.keys() if ".experts." in name and "bias" not in name]


def test_a_gpt_oss_server_reads_its_answers_as_harmony(tmp_path) -> None:
    """Both parsers default to gpt-oss for the family; a chat answer goes through them."""
    import requests

    from minisgl.models.weights import resolve_model_path
    from tests.conftest import start_minisgl_server

    save_gpt_oss(tmp_path, vocab_size=49152)  # the bundled tokenizer's
    server = start_minisgl_server("--model", str(tmp_path), "--tokenizer-path",
                                  str(resolve_model_path(None)))
    try:
        info = requests.get(server.url + "/server_info").json()
        assert (info["reasoning_parser"], info["tool_call_parser"]) == ("gpt-oss", "gpt-oss")
        answer = requests.post(server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "reasoning_effort": "low"}).json()
        assert answer.get("choices", [answer])[0].get("finish_reason") == "length", answer
    finally:
        assert server.stop() == 0, server.log()


def write_mxfp4_checkpoint(source: Path, quantized: Path, dense: Path) -> None:
    """The checkpoint in `source` with its experts as the released gpt-oss files hold them
    (`{gate_up,down}_proj_blocks` and `_scales`, quant_method mxfp4; the blocks encoded by the
    gguf package's MXFP4 quantizer), and in `dense` the values those blocks hold."""
    import json
    import shutil

    import numpy as np
    from gguf import GGMLQuantizationType, quants
    from safetensors.torch import load_file, save_file

    state = load_file(source / "model.safetensors")
    for name in [n for n in state if n.endswith(("gate_up_proj", "down_proj"))]:
        weight = state.pop(name).transpose(1, 2).contiguous()  # [E, out, in]
        experts, out, in_features = weight.shape
        raw = quants.quantize(weight.reshape(-1, in_features).numpy(),
                              GGMLQuantizationType.MXFP4)
        values = quants.dequantize(raw, GGMLQuantizationType.MXFP4)
        blocks = raw.reshape(experts, out, in_features // 32, 17)
        codes = np.concatenate([blocks[..., 1:] & 15, blocks[..., 1:] >> 4], axis=-1)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)  # value 2k low, 2k + 1 high
        quantized_state = {name + "_blocks": torch.from_numpy(np.ascontiguousarray(packed)),
                           name + "_scales": torch.from_numpy(blocks[..., 0].copy())}
        state.update(quantized_state)
        dense_value = torch.from_numpy(values).view(experts, out, in_features)
        dense_state = load_file(dense / "model.safetensors") if (
            dense / "model.safetensors").exists() else load_file(source / "model.safetensors")
        dense_state[name] = dense_value.transpose(1, 2).contiguous()
        save_file(dense_state, dense / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    save_file(state, quantized / "model.safetensors")
    (quantized / "config.json").write_text(json.dumps(config))
    shutil.copy(source / "config.json", dense / "config.json")


def test_an_mxfp4_checkpoint_keeps_its_experts_as_blocks(tmp_path) -> None:
    """The released layout (MXFP4 experts, the rest bfloat16 or float32) loads its experts as
    blocks, never dense, under a third of bfloat16's bytes, and matches transformers in
    float32 on the values the blocks encode (bounds: tests.test_hf_quantized's int4 ones; the
    error is the kernel's activations' ~15 bits)."""
    from transformers import AutoModelForCausalLM

    from minisgl import LLM
    from minisgl.layers.gguf_weight import GgufWeight
    from tests.test_gguf_types import assert_matches_transformers
    from tests.test_hf_quantized import LOGPROB_TOLERANCE, MARGIN_BOUND

    source, quantized, dense = (tmp_path / name for name in ("source", "mxfp4", "dense"))
    for folder in (quantized, dense):
        folder.mkdir()
    save_gpt_oss(source, intermediate_size=64)
    write_mxfp4_checkpoint(source, quantized, dense)
    prompts = [torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (7, 40)]
    with LLM(str(quantized), dtype="float32", max_total_tokens=1024,
             max_running_requests=2) as llm:
        experts = llm.runtime.engine.model.layers[0].mlp.experts
        assert experts.gate_up is None and experts.gate_up_bias is not None
        gate_up, down = experts.quantized.parts[0]
        assert isinstance(gate_up, GgufWeight) and gate_up.kind == "MXFP4"
        assert gate_up.nbytes * 3 <= gate_up.out_features * gate_up.in_features * 2
        outs = llm.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
            return_logprob=True, logprob_start_len=0)
        llm.check_integrity()
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        assert_matches_transformers(hf, prompt, out, MARGIN_BOUND["int4"],
                                    LOGPROB_TOLERANCE["int4"])
    with LLM(str(quantized), dtype="float32", max_total_tokens=1024, max_running_requests=2,
             tp_size=2) as llm:  # each rank's experts: whole groups of 32 of the 64 rows
        split = llm.generate(input_ids=prompts, sampling_params={
            "temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    assert [o["output_ids"] for o in split] == [o["output_ids"] for o in outs]
