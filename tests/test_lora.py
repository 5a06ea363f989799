"""Multi-LoRA serving against PEFT in float32: a tiny random Llama and random adapters made and
saved by PEFT here (fixed seeds); each adapter's greedy output equals PEFT's merged model,
alone or in a batch mixing adapters and base rows, chunked or not, over one or three ranks;
the prefix cache never serves one adapter's KV to another; adapters wait for slots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from minisgl.errors import InvalidRequest
from minisgl.llm import LLM
from tests.lora_fixtures import (ALL_TARGETS, TINY_LORA_BASE, assert_lora_greedy,
                                 merged_greedy, save_adapter, save_base)

NEW_TOKENS = 12
LENGTHS = (5, 17, 40)
GREEDY = {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory) -> dict[str, Path]:
    """The base and four adapters: every linear at rank 8; q/v only at rank 4; rsLoRA at
    rank 16; per-module ranks and alphas (rank_pattern / alpha_pattern)."""
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    save_base(base)
    return {
        "base": base,
        "all8": save_adapter(base, root / "all8", seed=1),
        "qv4": save_adapter(base, root / "qv4", seed=2, rank=4, targets=["q_proj", "v_proj"]),
        "rs16": save_adapter(base, root / "rs16", seed=3, rank=16, alpha=16, use_rslora=True),
        "pattern": save_adapter(base, root / "pattern", seed=4, rank=8,
                                rank_pattern={"o_proj": 4, "down_proj": 2},
                                alpha_pattern={"gate_proj": 64}),
    }


ADAPTERS = ("all8", "qv4", "rs16", "pattern")


def prompts() -> list[list[int]]:
    return [torch.randint(0, TINY_LORA_BASE["vocab_size"], (n,),
                          generator=torch.Generator().manual_seed(n)).tolist() for n in LENGTHS]


def lora_llm(models: dict[str, Path], names=ADAPTERS, **flags) -> LLM:
    return LLM(model=str(models["base"]), dtype="float32",
               lora_paths=[f"{n}={models[n]}" for n in names],
               **{"max_total_tokens": 4096, **flags})


def reference(models: dict[str, Path], name: str | None) -> list[list[int]]:
    return merged_greedy(models["base"], None if name is None else models[name], prompts(),
                         NEW_TOKENS)


def check_rows(models: dict[str, Path], names: list[str | None], outputs: list[list[int]]
               ) -> None:
    """Row i used adapter names[i] on prompts()[i % len(LENGTHS)]."""
    for i, (name, ours) in enumerate(zip(names, outputs)):
        prompt = prompts()[i % len(LENGTHS)]
        ref = reference(models, name)[i % len(LENGTHS)]
        assert_lora_greedy(models["base"], None if name is None else models[name], prompt,
                           ours, ref)


def test_each_adapter_matches_peft_merged(lora_models) -> None:
    with lora_llm(lora_models) as llm:
        for name in (None, *ADAPTERS):
            out = [r["output_ids"] for r in llm.generate(input_ids=prompts(),
                                                         sampling_params=GREEDY,
                                                         lora_path=name)]
            check_rows(lora_models, [name] * len(LENGTHS), out)
        llm.check_integrity()
    # the adapters change the output (else the comparison above proves little)
    assert len({str(reference(lora_models, n)) for n in (None, *ADAPTERS)}) == 5


MIXED = [None, "all8", "qv4", "rs16", None, "all8", "pattern", "qv4", None]


@pytest.mark.parametrize("flags", [
    {},
    {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
    {"disable_overlap_schedule": True, "page_size": 1},
], ids=["default", "chunked-mixed", "no-overlap"])
def test_mixed_batch_rows_equal_each_alone(lora_models, flags) -> None:
    """Rows of four adapters and of none in one batch: each equals PEFT's merged model."""
    rows = [prompts()[i % len(LENGTHS)] for i in range(len(MIXED))]
    with lora_llm(lora_models, **flags) as llm:
        out = [r["output_ids"] for r in llm.generate(input_ids=rows, sampling_params=GREEDY,
                                                     lora_path=MIXED)]
        llm.check_integrity()
    check_rows(lora_models, MIXED, out)


PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


@pytest.mark.parametrize("tp_size", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_phi3_fused_targets_match_peft_merged(tmp_path, tp_size: int) -> None:
    """Phi-3 checkpoints fuse q/k/v (qkv_proj) and gate/up (gate_up_proj), and so do its PEFT
    adapters: each fused B is cut into the parts our merged linears hold (and shard), sharing
    A. Greedy rows of the adapter beside base rows equal PEFT's merged model; a fused name is
    taken by --lora-target-modules."""
    base = tmp_path / "phi3"
    save_base(base, family="Phi3", pad_token_id=0)  # its default, 32000, is past the vocab
    adapter = save_adapter(base, tmp_path / "fused", seed=5, targets=PHI3_TARGETS)
    names = [None, "fused", "fused"]
    with LLM(model=str(base), dtype="float32", max_total_tokens=4096, tp_size=tp_size,
             lora_paths=[f"fused={adapter}"], lora_target_modules=PHI3_TARGETS) as llm:
        out = [r["output_ids"] for r in llm.generate(input_ids=prompts(), sampling_params=GREEDY,
                                                     lora_path=names)]
        llm.check_integrity()
    for name, prompt, ours in zip(names, prompts(), out):
        path = None if name is None else adapter
        assert_lora_greedy(base, path, prompt, ours, merged_greedy(base, path, [prompt],
                                                                    NEW_TOKENS)[0])
    assert merged_greedy(base, adapter, prompts(), NEW_TOKENS) != merged_greedy(
        base, None, prompts(), NEW_TOKENS)


@pytest.mark.parametrize("algorithm, tp_size", [
    ("NGRAM", 1), ("STANDALONE", 1), pytest.param("NGRAM", 3, marks=pytest.mark.slow)])
def test_speculating_rows_keep_their_adapters(lora_models, algorithm: str, tp_size: int
                                              ) -> None:
    """Every token of a verify step (the row's next token and its drafts) takes its row's
    adapter. STANDALONE's draft model (here the base) drafts without adapters, so adapter rows
    accept fewer drafts, and output what the adapter would: rows of four adapters and of none
    in one batch equal PEFT's merged models, and drafts were accepted."""
    rows = [prompts()[i % len(LENGTHS)] for i in range(len(MIXED))]
    spec = {"speculative_algorithm": algorithm, "speculative_always_draft": True,
            "tp_size": tp_size}
    if algorithm == "STANDALONE":
        spec["speculative_draft_model_path"] = str(lora_models["base"])
    with lora_llm(lora_models, **spec) as llm:
        out = [r["output_ids"] for r in llm.generate(input_ids=rows, sampling_params=GREEDY,
                                                     lora_path=MIXED)]
        state = llm.runtime.state()
        llm.check_integrity()
    check_rows(lora_models, MIXED, out)
    assert state["spec_accepted_tokens"] > 0, state


@pytest.mark.slow
def test_tensor_parallel_3_equals_references(lora_models) -> None:
    """TP 3: column layers shard B's rows, row layers A's columns (q/k/v and gate/up parts
    sharded like their weights); the mixed batch equals PEFT's merged models."""
    rows = [prompts()[i % len(LENGTHS)] for i in range(len(MIXED))]
    with lora_llm(lora_models, tp_size=3) as llm:
        out = [r["output_ids"] for r in llm.generate(input_ids=rows, sampling_params=GREEDY,
                                                     lora_path=MIXED)]
    check_rows(lora_models, MIXED, out)


def test_prefix_cache_is_keyed_by_adapter(lora_models) -> None:
    """The same prompt under another adapter (or none) never reuses cached KV; under the
    same adapter it does."""
    prompt = torch.randint(0, 512, (80,), generator=torch.Generator().manual_seed(7)).tolist()
    params = {**GREEDY, "max_new_tokens": 4}
    with lora_llm(lora_models, page_size=16) as llm:
        def run(name: str | None) -> tuple[list[int], int]:
            out = llm.generate(input_ids=prompt, sampling_params=params, lora_path=name)
            return out["output_ids"], out["meta_info"]["cached_tokens"]

        first, cached = run("all8")
        assert cached == 0
        for name in ("qv4", None, "rs16"):
            ids, cached = run(name)
            assert cached == 0, f"{name} reused another adapter's KV"
            ref = merged_greedy(lora_models["base"], None if name is None else lora_models[name],
                                [prompt], 4)[0]
            assert_lora_greedy(lora_models["base"], None if name is None else lora_models[name],
                               prompt, ids, ref)
        again, cached = run("all8")
        assert cached >= 64 and again == first
        llm.check_integrity()


def test_adapters_wait_for_slots(lora_models) -> None:
    """Two slots, four adapters and base rows submitted together: requests whose adapter has
    no free slot wait (others pass them), slots are reloaded, every row is right."""
    names = [ADAPTERS[i % 4] if i % 5 else None for i in range(12)]
    rows = [prompts()[i % len(LENGTHS)] for i in range(len(names))]
    with lora_llm(lora_models, max_loras_per_batch=2) as llm:
        out = [r["output_ids"] for r in llm.generate(input_ids=rows, sampling_params=GREEDY,
                                                     lora_path=names)]
        llm.check_integrity()
    check_rows(lora_models, names, out)


def test_retraction_keeps_each_rows_adapter(lora_models) -> None:
    """A pool too small for everything at once: retracted requests (their adapters' slots
    released) come back under the same adapter, and every row equals its reference."""
    names = [ADAPTERS[i % 4] if i % 3 else None for i in range(9)]
    rows = [prompts()[i % len(LENGTHS)] for i in range(len(names))]
    params = {**GREEDY, "max_new_tokens": 40}
    with lora_llm(lora_models, max_total_tokens=240, page_size=8,
                  max_loras_per_batch=3) as llm:
        out = [r["output_ids"] for r in llm.generate(input_ids=rows, sampling_params=params,
                                                     lora_path=names)]
        assert llm.runtime.state()["retractions"] > 0, "the pool was meant to be too small"
        llm.check_integrity()
    for i, (name, ours) in enumerate(zip(names, out)):
        adapter = None if name is None else lora_models[name]
        ref = merged_greedy(lora_models["base"], adapter, [rows[i]], 40)[0]
        assert_lora_greedy(lora_models["base"], adapter, rows[i], ours, ref)


def test_load_and_unload_at_run_time(lora_models) -> None:
    with LLM(model=str(lora_models["base"]), dtype="float32") as plain:
        base_only = [r["output_ids"] for r in plain.generate(input_ids=prompts(),
                                                             sampling_params=GREEDY)]
    with LLM(model=str(lora_models["base"]), dtype="float32", enable_lora=True,
             max_lora_rank=16, lora_target_modules=["all"]) as llm:
        out = [r["output_ids"] for r in llm.generate(input_ids=prompts(), sampling_params=GREEDY)]
        assert out == base_only
        llm.load_lora_adapter("x", str(lora_models["rs16"]))
        out = [r["output_ids"] for r in llm.generate(input_ids=prompts(), sampling_params=GREEDY,
                                                     lora_path="x")]
        check_rows(lora_models, ["rs16"] * 3, out)
        llm.unload_lora_adapter("x")
        with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'x'"):
            llm.generate(input_ids=prompts()[0], lora_path="x")
        # the name again, another adapter: nothing of the old one is reused (slot, cache)
        llm.load_lora_adapter("x", str(lora_models["qv4"]))
        out = [r["output_ids"] for r in llm.generate(input_ids=prompts(), sampling_params=GREEDY,
                                                     lora_path="x")]
        check_rows(lora_models, ["qv4"] * 3, out)
        llm.check_integrity()


def refused_adapters(root: Path, base: Path) -> dict[str, tuple[Path, str]]:
    """Adapters minisgl must refuse, each with what the error names."""
    dora = save_adapter(base, root / "dora", seed=5, use_dora=True)
    embed = save_adapter(base, root / "embed", seed=6, targets=["embed_tokens", "q_proj"])
    saved = save_adapter(base, root / "saved", seed=7, modules_to_save=["lm_head"])
    big = save_adapter(base, root / "big", seed=8, rank=32)
    narrow = save_adapter(base, root / "narrow", seed=9, rank=4, targets=["gate_proj"])
    broken = root / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    return {"dora": (dora, "DoRA"), "embed": (embed, "embedding"),
            "saved": (saved, "modules_to_save"), "big": (big, "--max-lora-rank"),
            "narrow": (narrow, "--lora-target-modules"), "broken": (broken, "adapter_model"),
            "missing": (root / "nowhere", "not a PEFT adapter folder")}


def test_adapters_minisgl_cannot_serve_are_refused(lora_models, tmp_path) -> None:
    refused = refused_adapters(tmp_path, lora_models["base"])
    with LLM(model=str(lora_models["base"]), dtype="float32", enable_lora=True,
             max_lora_rank=16, lora_target_modules=["q_proj", "v_proj"],
             max_loras_per_batch=2) as llm:
        for name, (path, says) in refused.items():
            with pytest.raises(InvalidRequest, match=says):
                llm.load_lora_adapter(name, str(path))
        llm.load_lora_adapter("ok", str(lora_models["qv4"]))
        with pytest.raises(InvalidRequest, match="already loaded"):
            llm.load_lora_adapter("ok", str(lora_models["qv4"]))
        with pytest.raises(InvalidRequest, match="at most 1 adapters may be pinned"):
            llm.load_lora_adapter("p1", str(lora_models["qv4"]), pinned=True)
            llm.load_lora_adapter("p2", str(lora_models["qv4"]), pinned=True)
        # one unknown adapter refuses the whole batch, nothing of it runs
        with pytest.raises(InvalidRequest, match="unknown LoRA adapter 'nope'"):
            llm.generate(input_ids=prompts(), lora_path=["ok", None, "nope"])
        with pytest.raises(InvalidRequest, match="no LoRA adapter named"):
            llm.unload_lora_adapter("nope")
        llm.check_integrity()


def test_start_up_flags_are_checked(lora_models) -> None:
    from minisgl.args import ServerArgs
    with pytest.raises(ValueError, match="--max-loaded-loras must be at least"):
        ServerArgs(enable_lora=True, max_loras_per_batch=4, max_loaded_loras=2)
    with pytest.raises(ValueError, match="JSON object"):
        ServerArgs(lora_paths=['{"lora_name": "x"}'])
    with pytest.raises(ValueError, match="no LoRA-capable lm_head"):
        LLM(model=str(lora_models["base"]), dtype="float32", enable_lora=True,
            lora_target_modules=["lm_head"])
    with pytest.raises(ValueError, match="--lora-paths: cannot load LoRA adapter 'x'"):
        LLM(model=str(lora_models["base"]), dtype="float32", max_lora_rank=16,
            lora_target_modules=ALL_TARGETS, lora_paths=[f"x={lora_models['base']}"])


@pytest.mark.parametrize("layout", ["segmented", "segmented-bf16", "masked", "per_token"])
def test_every_lora_layout_equals_per_token_products(layout: str) -> None:
    """The CPU kernel path (segmented; in bfloat16 too, its AVX-512 BF16 tiles where built),
    the masked path (a CPU without the kernels) and the per-token Triton kernel (what CUDA
    runs: under Triton's interpreter here, in a child process; also with parts wide enough to
    split a token's columns over programs) against x A^T B^T per token, on
    a batch of prefill and decode rows (a slot with 6 rows: a tile of 4 and one of 2; one with
    38, past the float32 kernel's rows), some of no adapter, one slot unused; 40 inputs and
    parts of 24 / 8 / 8 outputs (partial vectors)."""
    from minisgl.kernels import cpu_kernels
    from tests.test_fp8 import interpreter_runs_the_kernel, run_interpreted

    if layout.startswith("segmented") and cpu_kernels() is None:
        pytest.skip("no compiled CPU kernels")
    if layout == "segmented-bf16":
        check_lora_layout("segmented", torch.bfloat16)
        return
    if layout != "per_token":
        check_lora_layout(layout)
        return
    if not interpreter_runs_the_kernel():
        pytest.skip("needs triton >= 3.9")
    run_interpreted("from tests.test_lora import check_lora_layout as c; c('per_token'); "
                    "c('per_token', parts=[300, 136, 8]); print('ok')")


def check_lora_layout(layout: str, dtype: torch.dtype = torch.float32,
                      parts: list[int] | None = None) -> None:
    """bfloat16: inputs and weights in it, the expected sums in float64 on those values; the
    result within bfloat16's rounding of the output (2^-8 relative) plus the sums' order.
    `parts`: the linear's output parts (wide ones spread a token over several programs)."""
    from minisgl.core import Batch
    from minisgl.engine.lora import lora_step
    from minisgl.layers.lora import LoraContext, LoraSlots

    torch.manual_seed(0)
    context, rank, width = LoraContext(), 4, 40
    parts = parts or [24, 8, 8]
    slots = LoraSlots(context, 4, rank, width, parts, dtype, torch.device("cpu"))
    weights = {}
    for slot in (0, 2, 3):
        for part, size in enumerate(parts):
            r = rank - part  # ranks below the buffer's
            weights[slot, part] = (torch.randn(r, width).to(dtype).float(),
                                   torch.randn(size, r).to(dtype).float())
            slots.write(slot, part, *weights[slot, part])
    row_slots, extend = [2, -1, 0, 3, 2, -1, 3], [5, 3, 1, 1, 1, 2, 37]
    batch = Batch("mixed", len(row_slots), list(range(6)), [0] * 6, extend, extend,
                  input_positions=torch.zeros(sum(extend), dtype=torch.int64),
                  lora_slots=row_slots)
    context.step = lora_step(batch, layout, dtype)
    x = torch.randn(sum(extend), width).to(dtype).float()
    base = torch.randn(sum(extend), sum(parts)).to(dtype).float()
    out = slots.add(x.to(dtype), base.to(dtype, copy=True)).float()
    token_slots = torch.repeat_interleave(torch.tensor(row_slots), torch.tensor(extend))
    expected = base.clone()
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            expected[t] += torch.cat([x[t] @ a.t() @ b.t() for a, b in
                                      (weights[slot, p] for p in range(len(parts)))])
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(out, expected, rtol=2**-7, atol=1e-2)


def test_lora_in_bfloat16_on_cpu_matches_peft(tmp_path) -> None:
    """The served default on a CPU with AVX-512 BF16 (bfloat16; elsewhere float32 runs it):
    rows of two adapters and of none, each greedy token within bfloat16's margin of PEFT's
    merged float32 model, teacher-forced (the bound of the GPU test)."""
    from tests.lora_fixtures import assert_within_margin_of_merged, save_adapter, save_base
    base = tmp_path / "base"
    save_base(base)
    adapters = {n: save_adapter(base, tmp_path / n, seed=i) for i, n in enumerate("ab")}
    prompts = [[5 + i, 17, 33, 250 - i, 7] * (2 + 4 * i) for i in range(4)]
    names = ["a", None, "b", "a"]
    with LLM(model=str(base), dtype="bfloat16", max_total_tokens=4096,
             lora_paths=[f"{n}={p}" for n, p in adapters.items()]) as llm:
        outs = llm.generate(input_ids=prompts, lora_path=names, sampling_params={
            "temperature": 0, "max_new_tokens": 8, "ignore_eos": True})
        llm.check_integrity()
    assert_within_margin_of_merged(base, adapters, prompts, names, outs, 0.25)
