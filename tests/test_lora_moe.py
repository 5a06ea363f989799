"""LoRA on mixture-of-experts layers (Qwen3-MoE, Mixtral) against PEFT in float32: tiny random
models and adapters built here (fixed seeds). Adapters come in the layouts users have: PEFT's
stacked expert parameters as transformers 5 makes them (gate/up/down targets converted to the
fused gate_up_proj at twice the rank, or `target_parameters` directly) and the per-expert
modules of adapters trained on transformers 4 (written here in PEFT's layout; PEFT converts
them on loading, which is the reference). Rows of adapters and of the base share a batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minisgl.layers.lora import ExpertLora, LoraContext, slot_layout
from minisgl.layers.moe import Experts, TopKRouter
from minisgl.llm import LLM
from minisgl.models.peft import AdapterError, read_adapter
from minisgl.layers.quant import vnni_kernels
from tests.lora_fixtures import (assert_lora_greedy, assert_within_margin_of_merged, merged_greedy,
                                 save_adapter, save_base)

NEW_TOKENS = 10
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
# logit units: bfloat16 activations and int8 experts; measured 0.004 (bfloat16 alone: 0.001),
# the bound of the int4 / k-quant LoRA tests (tests.test_lora_quantized)
INT8_MARGIN = 0.05
# expert width 48 (splits over 3 ranks), 8 experts, top 2; Mixtral 4 experts
BASES = {
    "qwen3-moe": ("Qwen3Moe", dict(num_experts=8, num_experts_per_tok=2,
                                   moe_intermediate_size=48, head_dim=16)),
    # layer 1 a dense MLP: its gate/up/down are linears, the experts' are stacked
    "qwen3-moe-mixed": ("Qwen3Moe", dict(num_experts=8, num_experts_per_tok=2,
                                         moe_intermediate_size=48, head_dim=16,
                                         mlp_only_layers=[1])),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2,
                                intermediate_size=48)),
}
EXPERT_NAMES = {"Qwen3Moe": ("mlp.experts", ("gate_proj", "up_proj", "down_proj")),
                "Mixtral": ("block_sparse_moe.experts", ("w1", "w3", "w2"))}


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (6, 19, 33)]


def save_per_expert_adapter(base: Path, path: Path, family: str, layers: list[int],
                            experts: int, hidden: int, width: int, rank: int = 4,
                            seed: int = 0) -> Path:
    """A LoRA on every expert's projections in transformers 4's per-expert modules (the
    layout of adapters trained before transformers 5), written in PEFT's format."""
    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(seed)
    prefix, (gate, up, down) = EXPERT_NAMES[family]
    shapes = {gate: (hidden, width), up: (hidden, width), down: (width, hidden)}
    tensors = {}
    for layer in layers:
        for e in range(experts):
            for part, (inputs, outputs) in shapes.items():
                name = f"base_model.model.model.layers.{layer}.{prefix}.{e}.{part}"
                tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inputs, generator=gen) * 0.3
                tensors[f"{name}.lora_B.weight"] = torch.randn(outputs, rank, generator=gen)
    path.mkdir(parents=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "task_type": "CAUSAL_LM",
        "target_modules": list(shapes), "base_model_name_or_path": str(base)}))
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """Per base: the base, a PEFT adapter on every linear and the experts ("all"), one on
    q/v and the experts' stacked parameters at their own rank ("params"), one in the
    per-expert layout ("per-expert")."""
    root = tmp_path_factory.mktemp("lora-moe")
    out = {}
    for kind, (family, fields) in BASES.items():
        base = root / kind
        save_base(base, family=family, **fields)
        gate, up, down = EXPERT_NAMES[family][1]
        experts = fields.get("num_experts", fields.get("num_local_experts"))
        width = fields.get("moe_intermediate_size", fields.get("intermediate_size"))
        out[kind] = {
            "base": base,
            "all": save_adapter(base, root / f"{kind}-all", seed=1, rank=4, b_scale=2.0,
                                targets=["q_proj", "k_proj", "v_proj", "o_proj", gate, up,
                                         down]),
            "per-expert": save_per_expert_adapter(
                base, root / f"{kind}-v4", family, [0] if "mlp_only_layers" in fields
                else [0, 1], experts, 96, width, seed=3),
        }
        if family == "Qwen3Moe":
            out[kind]["params"] = save_adapter(
                base, root / f"{kind}-params", seed=2, rank=6, b_scale=2.0,
                targets=["q_proj", "v_proj"], alpha_pattern={"down_proj": 24},
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return out


def generate(models: dict[str, Path], names: list[str | None], state: dict | None = None,
             new_tokens: int = NEW_TOKENS, **flags) -> list[list[int]]:
    """Greedy rows of prompts() in one batch, row i with adapter names[i]; `state`: filled
    with the runtime's counters after."""
    adapters = sorted({n for n in names if n is not None})
    rows = [prompts()[i % 3] for i in range(len(names))]
    with LLM(model=str(models["base"]), dtype="float32", max_total_tokens=4096,
             lora_paths=[f"{n}={models[n]}" for n in adapters], **flags) as llm:
        outs = [r["output_ids"] for r in llm.generate(
            input_ids=rows, sampling_params={**GREEDY, "max_new_tokens": new_tokens},
            lora_path=names)]
        llm.check_integrity()
        (state if state is not None else {}).update(llm.runtime.state())
    return outs


def check(models: dict[str, Path], names: list[str | None], outs: list[list[int]]) -> None:
    for i, (name, ours) in enumerate(zip(names, outs)):
        adapter = None if name is None else models[name]
        prompt = prompts()[i % 3]
        assert_lora_greedy(models["base"], adapter, prompt, ours,
                           merged_greedy(models["base"], adapter, [prompt], len(ours))[0])


@pytest.mark.parametrize("kind", BASES)
def test_expert_adapters_match_peft_merged(models, kind: str) -> None:
    """Each layout's adapter beside base rows in one batch equals PEFT's merged model, and
    changes the output of every prompt."""
    m = models[kind]
    adapters = [n for n in m if n != "base"]
    names = [None, *adapters, *adapters, None]
    check(m, names, generate(m, names))
    for name in adapters:
        assert all(a != b for a, b in zip(merged_greedy(m["base"], m[name], prompts(),
                                                        NEW_TOKENS),
                                           merged_greedy(m["base"], None, prompts(),
                                                         NEW_TOKENS))), name


@pytest.mark.parametrize("flags", [
    {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
    {"speculative_algorithm": "NGRAM", "speculative_always_draft": True},
], ids=["chunked-mixed", "ngram"])
def test_only_the_experts_adapted_changes_the_output(models, tmp_path, flags) -> None:
    """An adapter on the experts alone: the experts' term is what the reference sees, in
    chunks mixed with decode rows and in verify steps (a row's drafts take its adapter)."""
    m = {**models["qwen3-moe"]}
    m["experts"] = save_adapter(m["base"], tmp_path / "experts", seed=4, rank=4, b_scale=2.0,
                                targets=["gate_proj", "up_proj", "down_proj"])
    assert read_adapter(m["experts"]).targets == {"gate_proj", "up_proj", "down_proj"}
    names = ["experts", None, "experts"]
    state: dict = {}
    outs = generate(m, names, state, new_tokens=24, **flags)  # long enough to repeat itself
    check(m, names, outs)
    if "speculative_algorithm" in flags:
        assert state["spec_accepted_tokens"] > 0, state
    assert outs[0] != merged_greedy(m["base"], None, prompts()[:1], len(outs[0]))[0]


@pytest.mark.slow
def test_tensor_parallel_3_equals_references(models) -> None:
    m = models["qwen3-moe"]
    names = ["all", None, "per-expert", "params"]
    check(m, names, generate(m, names, tp_size=3))


def test_expert_adapters_are_checked(models) -> None:
    """Targets outside --lora-target-modules, a rank above --max-lora-rank: one clear line."""
    m = models["qwen3-moe"]
    with pytest.raises(ValueError, match="outside --lora-target-modules"):
        LLM(model=str(m["base"]), dtype="float32", max_total_tokens=1024,
            lora_paths=[f"a={m['all']}"], lora_target_modules=["q_proj", "k_proj", "v_proj",
                                                                 "o_proj"])
    # PEFT doubles the rank of gate/up fused into gate_up_proj: rank 4 each, 8 stacked
    with pytest.raises(ValueError, match="rank 4 is above --max-lora-rank 2"):
        LLM(model=str(m["base"]), dtype="float32", max_total_tokens=1024,
            lora_paths=[f"a={m['all']}"], max_lora_rank=2)


def test_factors_shared_across_experts_are_refused(models, tmp_path) -> None:
    """A stacked adapter whose A is not rank r for each expert (one A shared by all experts,
    as some trainers export): refused, not read as a smaller rank per expert."""
    from safetensors.torch import load_file, save_file
    m = models["qwen3-moe"]
    shared = tmp_path / "shared"
    shared.mkdir()
    config = json.loads((m["params"] / "adapter_config.json").read_text())
    (shared / "adapter_config.json").write_text(json.dumps({**config, "r": 48}))
    tensors = load_file(m["params"] / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "experts" in k},
              shared / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="factors shared across experts"):
        LLM(model=str(m["base"]), dtype="float32", max_total_tokens=1024,
            lora_paths=[f"a={shared}"])


@pytest.mark.parametrize("module, message", [
    ("mlp.experts.9.down_proj", "the model has 8 experts"),  # an expert-pruned model's slot
    ("mlp.experts.down_proj", "not a linear layer"),  # no expert named
])
def test_expert_names_the_model_lacks_are_refused(models, tmp_path, module: str,
                                                  message: str) -> None:
    """One clear line, and nothing written into another adapter's slot."""
    from safetensors.torch import save_file
    path = tmp_path / "bad"
    path.mkdir()
    name = f"base_model.model.model.layers.0.{module}"
    save_file({f"{name}.lora_A.weight": torch.randn(4, 48),
               f"{name}.lora_B.weight": torch.randn(96, 4)},
              path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["down_proj"]}))
    with pytest.raises(ValueError, match=message):
        LLM(model=str(models["qwen3-moe"]["base"]), dtype="float32", max_total_tokens=1024,
            lora_paths=[f"a={path}"])


def test_parameters_minisgl_does_not_adapt_are_refused(models, tmp_path) -> None:
    path = tmp_path / "other"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "target_parameters": ["mlp.experts.router_bias"]}))
    from safetensors.torch import save_file
    save_file({"base_model.model.model.layers.0.mlp.experts.lora_A.weight": torch.ones(16, 4),
               "base_model.model.model.layers.0.mlp.experts.lora_B.weight": torch.ones(4, 16)},
              path / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="router_bias"):
        read_adapter(path)


@pytest.mark.parametrize("layout", ["segmented", "segmented-long", "masked", "per_expert",
                                    "per_token"])
def test_every_layout_adds_each_pairs_adapter(layout: str) -> None:
    """Each (token, expert) pair takes its token's adapter at that expert, whatever the path:
    the segmented CPU kernel (segmented-long: a prefill of one adapter, past the kernel's 32
    rows a (slot, expert), which it hands to GEMMs), the masked GEMM, the experts' per-expert
    matmuls, the per-token Triton kernel (run by triton's interpreter), against each token
    through its experts with the adapters' weights merged, in float64."""
    from minisgl.kernels import cpu_kernels
    from tests.test_fp8 import interpreter_runs_the_kernel, run_interpreted
    if layout.startswith("segmented") and cpu_kernels() is None:
        pytest.skip("no compiled CPU kernels")
    if layout == "segmented-long":
        check_expert_layout("segmented", [2] * 150)
        return
    if layout != "per_token":
        check_expert_layout(layout)
        return
    if not interpreter_runs_the_kernel():
        pytest.skip("needs triton >= 3.9")
    run_interpreted("from tests.test_lora_moe import check_expert_layout as c; "
                    "c('per_token'); print('ok')")


def check_expert_layout(layout: str, slots: list[int] | None = None) -> None:
    """`slots`: each token's adapter slot (-1: none)."""
    token_slots = torch.tensor(slots or [2, -1, 0, 0, 2, -1, 2] * 3 + [0, -1])
    gen = torch.Generator().manual_seed(11)
    num_experts, hidden, width, rank, tokens = 6, 16, 8, 3, len(token_slots)
    experts = Experts(num_experts, hidden, width)
    experts.gate_up.data = torch.randn(num_experts, 2 * width, hidden, generator=gen)
    experts.down.data = torch.randn(num_experts, hidden, width, generator=gen)
    context = LoraContext()
    experts.lora = ExpertLora(context, 3, rank, num_experts, hidden, width,
                              {"gate", "up", "down"}, torch.float32, torch.device("cpu"))
    merged = {}  # (slot, expert) -> (gate_up, down) weights with the adapter's terms
    for slot in (0, 2):
        for e in range(num_experts):
            a_gu, b_gu = torch.randn(2 * rank, hidden, generator=gen), torch.randn(
                2 * width, 2 * rank, generator=gen)
            a_d, b_d = torch.randn(rank, width, generator=gen), torch.randn(
                hidden, rank, generator=gen)
            experts.lora.write(slot, (e, "gate_up"), a_gu, b_gu)
            experts.lora.write(slot, (e, "down"), a_d, b_d)
            merged[slot, e] = (experts.gate_up[e] + b_gu @ a_gu, experts.down[e] + b_d @ a_d)
    router = TopKRouter(hidden, num_experts, top_k=2, renormalize=True)
    router.weight.data = torch.randn(num_experts, hidden, generator=gen)
    x = torch.randn(tokens, hidden, generator=gen)
    step_layout = "segmented" if layout == "segmented" else "masked"
    context.step = slot_layout(token_slots, 3, step_layout, torch.float32)
    if layout == "per_token":
        context.step.token_slots = token_slots.to(torch.int32)
        context.step.mask = None  # what a CUDA step holds; the kernel runs here interpreted
    if layout == "per_expert":
        experts.per_expert = lambda x: True
    weights, ids = router(x)
    if slots:
        assert torch.bincount(ids.flatten()).max() > 32  # past the kernel's rows a slot
    out = experts(x, weights, ids).double()
    expected = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for weight, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate_up, down = merged.get((int(token_slots[t]), e), (experts.gate_up[e],
                                                                  experts.down[e]))
            gate, up = (gate_up.double() @ x[t].double()).chunk(2)
            expected[t] += weight * (down.double() @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-3)


@pytest.mark.skipif(vnni_kernels() is None, reason="no AVX-512 VNNI here")
def test_adapters_on_int8_experts_stay_within_bfloat16_margin(models) -> None:
    """--quantization w8a8_int8 in bfloat16: the experts run one int8 matmul each and the
    adapters' terms are added in bfloat16; each greedy token stays within MARGIN (logit
    units) of the argmax of PEFT's merged float32 model, teacher-forced."""
    from minisgl.layers.w8a8 import Int8ChannelWeight
    m = models["qwen3-moe"]
    names = ["all", None, "per-expert", "params"]
    rows = [prompts()[i % 3] for i in range(len(names))]
    with LLM(model=str(m["base"]), dtype="bfloat16", quantization="w8a8_int8",
             max_total_tokens=4096, lora_paths=[f"{n}={m[n]}" for n in set(names) - {None}]
             ) as llm:
        experts = llm.runtime.engine.model.layers[0].mlp.experts
        assert isinstance(experts.quantized.parts[0][0], Int8ChannelWeight) and experts.lora
        outs = llm.generate(input_ids=rows, sampling_params=GREEDY, lora_path=names)
        llm.check_integrity()
    assert_within_margin_of_merged(m["base"], m, rows, names, outs, INT8_MARGIN)
