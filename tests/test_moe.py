"""Mixture-of-experts decoders (Qwen3-MoE, Mixtral) against transformers float32 on tiny
random models built here: routing, renormalisation, sparse and dense layers, the checkpoint
spellings, batching and tensor parallelism."""

from __future__ import annotations

import json

import pytest
import torch

from minisgl.engine import Engine, EngineConfig
from minisgl.layers.quant import vnni_kernels
from minisgl.models.arch import MoEShape
from tests.test_model import TINY
from tests.test_model_configs import (
    STEPS,
    assert_greedy_matches_transformers,
    assert_logits_match,
    save_tiny,
)

BF16_REL_BOUND = 0.02  # relative L2 error of logits, two bfloat16 runs of one model

# each: (transformers model class, config class, MoE fields); expert width 32, 8 experts
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 norm_topk_prob=True)
MODELS = {
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", QWEN3_MOE),
    # top 3 not renormalised, and layer 1 a dense MLP of the config's intermediate_size
    "qwen3-moe-mixed": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                        {**QWEN3_MOE, "num_experts_per_tok": 3, "norm_topk_prob": False,
                         "mlp_only_layers": [1]}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
}


def experts_chosen(model: torch.nn.Module, ids: torch.Tensor) -> list[set[int]]:
    """Per sparse layer of the transformers model, the experts its router picks for `ids`."""
    chosen: list[set[int]] = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda _m, _i, out: chosen.append(set(out[2].flatten().tolist())))
        for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    with torch.inference_mode():
        model(input_ids=ids[None])
    for hook in hooks:
        hook.remove()
    return chosen


def hub_spelling(path) -> None:
    """transformers 5 saves Qwen3-MoE's expert count as num_local_experts; the Hub's configs
    say num_experts."""
    config = json.loads((path / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    (path / "config.json").write_text(json.dumps(config))


def stacked_experts(path) -> None:
    """Rewrite the checkpoint with every layer's experts stacked into [E, 2I, H] gate_up_proj
    and [E, H, I] down_proj tensors (transformers 5's in-memory layout)."""
    from safetensors.torch import load_file, save_file
    state = load_file(path / "model.safetensors")
    stacked: dict[str, torch.Tensor] = {}
    for name in sorted(n for n in state if ".experts.0.gate_proj" in n):
        prefix = name.split(".experts.")[0] + ".experts."
        count = sum(1 for n in state if n.startswith(prefix) and n.endswith("gate_proj.weight"))
        parts = {part: [state.pop(f"{prefix}{e}.{part}.weight") for e in range(count)]
                 for part in ("gate_proj", "up_proj", "down_proj")}
        stacked[prefix + "gate_up_proj"] = torch.stack(
            [torch.cat([g, u]) for g, u in zip(parts["gate_proj"], parts["up_proj"])])
        stacked[prefix + "down_proj"] = torch.stack(parts["down_proj"])
    save_file({**state, **stacked}, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("attention", ["kernel", "sdpa"])
@pytest.mark.parametrize("kind", MODELS)
def test_moe_matches_transformers(tmp_path, kind: str, attention: str) -> None:
    """Prefill, chunked prefill over a cached prefix, and decode: the tokens of one sequence go
    to different experts (asserted), and the logits equal transformers'."""
    model_class, config_class, fields = MODELS[kind]
    model = save_tiny(model_class, config_class, tmp_path, **fields)
    ids = torch.randint(0, TINY["vocab_size"], (60,), generator=torch.Generator().manual_seed(8))
    assert all(len(experts) > 2 for experts in experts_chosen(model, ids))

    def sparse_layers_are(engine: Engine) -> None:
        sparse = (0,) if kind == "qwen3-moe-mixed" else (0, 1)
        assert engine.arch.moe.sparse_layers == sparse

    assert_logits_match(model, str(tmp_path), STEPS["chunked prefill"], seed=8,
                        attention=attention, check=sparse_layers_are)


@pytest.mark.parametrize("layout", ["hub config", "stacked experts"])
def test_qwen3_moe_checkpoint_spellings(tmp_path, layout: str) -> None:
    model = save_tiny(*MODELS["qwen3-moe"][:2], tmp_path, **QWEN3_MOE)
    (hub_spelling if layout == "hub config" else stacked_experts)(tmp_path)
    assert_logits_match(model, str(tmp_path), STEPS["prefill + decode"], seed=9)


def test_moe_shape_from_either_spelling() -> None:
    base = {"num_hidden_layers": 4, "intermediate_size": 64}
    qwen = MoEShape.from_config({**base, "num_experts": 8, "num_experts_per_tok": 2,
                                 "moe_intermediate_size": 16, "decoder_sparse_step": 2})
    assert qwen == MoEShape(8, 2, 16, False, (1, 3))
    mixtral = MoEShape.from_config({**base, "model_type": "mixtral", "num_local_experts": 8})
    assert mixtral == MoEShape(8, 2, 64, True, (0, 1, 2, 3))
    assert MoEShape.from_config(base) is None


def test_moe_greedy_generation_batched_and_tp2(tmp_path) -> None:
    """Through the scheduler: a batch of prompts equals transformers' greedy generation, and
    so does TP 2, which splits every expert's intermediate dimension."""
    model = save_tiny(*MODELS["mixtral"][:2], tmp_path, **MODELS["mixtral"][2])
    assert_greedy_matches_transformers(model, tmp_path, (6, 25, 13), new_tokens=20)


def test_tp_size_must_split_the_experts(tmp_path) -> None:
    save_tiny(*MODELS["qwen3-moe"][:2], tmp_path, **{**QWEN3_MOE, "moe_intermediate_size": 30})
    with pytest.raises(ValueError, match="expert width 30"):
        Engine(EngineConfig(model_path=str(tmp_path), dtype="float32", max_total_tokens=256,
                            tp_size=4))


@pytest.mark.parametrize("rows, num_experts", [(12, 32), (90, 4)])
@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_grouped_and_per_expert_matmuls_equal_each_token_through_its_experts(
        monkeypatch, rows: int, num_experts: int, path: str) -> None:
    """Each way the experts run (our CPU kernel, torch's grouped matmul, one matmul per
    expert for quantized weights and GPUs without a grouped matmul) against each token sent
    through its 2 experts one by one in float64. 12 rows over 32 experts: some get none, some
    several; 90 rows over 4: groups past the kernel's 32 rows (it hands those to a GEMM)."""
    from minisgl.layers import moe
    if path == "torch":
        monkeypatch.setattr(moe, "cpu_kernels", lambda: None)
    elif moe.cpu_kernels() is None:
        pytest.skip("the CPU kernels are not built here")
    gen = torch.Generator().manual_seed(10)
    experts = moe.Experts(num_experts=num_experts, hidden_size=16, intermediate_size=8)
    experts.gate_up.data = torch.randn(num_experts, 16, 16, generator=gen)
    experts.down.data = torch.randn(num_experts, 16, 8, generator=gen)
    router = moe.TopKRouter(16, num_experts, top_k=2, renormalize=True)
    router.weight.data = torch.randn(num_experts, 16, generator=gen)
    x = torch.randn(rows, 16, generator=gen)
    weights, ids = router(x)
    expected = torch.zeros(rows, 16, dtype=torch.float64)
    for row in range(rows):
        for weight, expert in zip(weights[row].tolist(), ids[row].tolist()):
            gate, up = (experts.gate_up[expert].double() @ x[row].double()).chunk(2)
            expected[row] += weight * (experts.down[expert].double()
                                       @ (torch.nn.functional.silu(gate) * up))
    grouped = experts(x, weights, ids)
    counts = torch.bincount(ids.flatten(), minlength=num_experts).tolist()
    assert max(counts) > (1 if rows < 32 else 32)
    monkeypatch.setattr(experts, "per_expert", lambda x: True)
    per_expert = experts(x, weights, ids)
    for out in (grouped, per_expert):
        assert (out.double() - expected).abs().max().item() < 1e-4


@pytest.mark.skipif(vnni_kernels() is None, reason="no AVX-512 VNNI here")
def test_w8a8_quantizes_the_experts(tmp_path) -> None:
    """--quantization w8a8_int8 makes every expert's weights int8 (run one matmul per expert)
    and stays as close to float32 as on a dense model (tests/test_w8a8.LOGIT_REL_BOUND)."""
    from minisgl.layers.w8a8 import Int8ChannelWeight
    from tests.engine_probe import prefill_logits
    from tests.test_quantization import relative_error
    from tests.test_w8a8 import LOGIT_REL_BOUND
    save_tiny(*MODELS["qwen3-moe"][:2], tmp_path, **QWEN3_MOE)
    ids = list(range(3, 40))
    logits = {}
    for method, dtype in (("w8a8_int8", "bfloat16"), ("none", "float32")):
        engine = Engine(EngineConfig(model_path=str(tmp_path), dtype=dtype, quantization=method,
                                     max_total_tokens=256))
        if method != "none":
            experts = engine.model.layers[0].mlp.experts
            assert isinstance(experts.quantized.parts[0][0], Int8ChannelWeight)
        logits[method] = prefill_logits(engine, ids).float()
        engine.shutdown()
    assert relative_error(logits["w8a8_int8"], logits["none"]) < LOGIT_REL_BOUND


def test_qwen3_moe_from_a_gguf_file(tmp_path) -> None:
    """The GGUF route of a new family: a Qwen3-MoE written as llama.cpp lays it out (experts
    stacked per layer, expert_feed_forward_length, which transformers' GGUF reader leaves out
    and the conversion reads itself) serves transformers' logits."""
    from tests.gguf_families import write_qwen3moe_gguf
    model = save_tiny(*MODELS["qwen3-moe"][:2], tmp_path / "hf", **QWEN3_MOE,
                      vocab_size=49152)  # the bundled tokenizer's
    gguf = write_qwen3moe_gguf(model, tmp_path / "tiny-qwen3moe.gguf")

    def experts_from_the_file(engine: Engine) -> None:
        assert engine.arch.moe.intermediate_size == QWEN3_MOE["moe_intermediate_size"]

    assert_logits_match(model, str(gguf), STEPS["chunked prefill"], seed=15, vocab=49152,
                        check=experts_from_the_file)


def test_gguf_quantization_keeps_the_experts_blocks(tmp_path) -> None:
    """--quantization gguf on a Q4_0 Qwen3-MoE file: every expert's weights stay 4-bit blocks
    (never dense), and the logits are those of the same file dequantized (bfloat16 both;
    bound: BF16_REL_BOUND)."""
    from gguf import GGMLQuantizationType
    from minisgl.layers.moe import QuantizedExperts
    from tests.engine_probe import prefill_logits
    from tests.gguf_families import write_qwen3moe_gguf
    from tests.test_quantization import relative_error
    model = save_tiny(*MODELS["qwen3-moe"][:2], tmp_path / "hf", **QWEN3_MOE,
                      vocab_size=49152)
    gguf = write_qwen3moe_gguf(model, tmp_path / "tiny-qwen3moe.Q4_0.gguf",
                               GGMLQuantizationType.Q4_0)
    ids = list(range(300, 340))
    logits = {}
    for method in ("gguf", "none"):
        engine = Engine(EngineConfig(model_path=str(gguf), dtype="bfloat16", quantization=method,
                                     max_total_tokens=256))
        experts = engine.model.layers[0].mlp.experts
        assert isinstance(experts.quantized, QuantizedExperts) == (method == "gguf")
        assert (experts.gate_up is None) == (method == "gguf")
        logits[method] = prefill_logits(engine, ids).float()
        engine.shutdown()
    assert relative_error(logits["gguf"], logits["none"]) < BF16_REL_BOUND
