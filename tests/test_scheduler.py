"""The scheduler on the real model: batching invariance, chunked prefill, prefix cache,
retraction, finish conditions, and aborts at random moments (a fuzz over KV integrity)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from minisgl import LLM
from minisgl.core import SamplingParams
from minisgl.errors import InvalidRequest
from minisgl.scheduler import RequestSpec
from minisgl.runtime import Runtime
from minisgl.args import ServerArgs
from tests import reference as ref

GREEDY = {"temperature": 0, "max_new_tokens": 8}
# float32 engine vs the float32 reference: input logprobs agree to this (measured ~1e-5)
LOGPROB_ABS_BOUND = 1e-3


def random_prompts(count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 20000) for _ in range(rng.randint(low, high))]
            for _ in range(count)]


def run(prompts: list[list[int]], params=GREEDY, **args) -> list[list[int]]:
    with LLM(dtype="float32", **args) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        llm.check_integrity()
        return [o["output_ids"] for o in outs]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(32, 5, 250)


@pytest.fixture(scope="module")
def alone(prompts) -> list[list[int]]:
    """Each prompt alone in its batch: one request may run at a time, one token per page
    (the other tests run the CPU default of 16)."""
    return run(prompts, max_running_requests=1, disable_radix_cache=True,
               max_total_tokens=4096, page_size=1)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_32_prompts_together_equal_each_alone(prompts, alone, overlap: bool) -> None:
    together = run(prompts, max_running_requests=32, max_total_tokens=24000,
                   disable_overlap_schedule=not overlap)
    for ids, ours, expected in zip(prompts, together, alone):
        ref.assert_greedy_matches(ids, ours, expected)


@pytest.mark.parametrize("chunk", [16, 64, 4096])
def test_chunked_prefill_equals_unchunked(prompts, alone, chunk: int) -> None:
    subset = prompts[:12]
    chunked = run(subset, chunked_prefill_size=chunk, max_running_requests=12,
                  max_total_tokens=12000)
    for ids, ours, expected in zip(subset, chunked, alone[:12]):
        ref.assert_greedy_matches(ids, ours, expected)


@pytest.mark.parametrize("page_size", [1, 4])
def test_shared_prefix_hits_cache_with_same_output(page_size: int) -> None:
    system = ref.prompt_ids(ref.chat_prompt("Summarise the plot of Hamlet in one sentence."))
    with LLM(dtype="float32", page_size=page_size, max_total_tokens=4096) as llm:
        first = llm.generate(input_ids=system, sampling_params=GREEDY)
        second = llm.generate(input_ids=system, sampling_params=GREEDY)
        longer = llm.generate(input_ids=system + ref.prompt_ids(" Sure"), sampling_params=GREEDY)
        llm.check_integrity()
    assert first["meta_info"]["cached_tokens"] == 0
    expected_hit = (len(system) - 1) // page_size * page_size
    assert second["meta_info"]["cached_tokens"] == expected_hit > 0
    assert longer["meta_info"]["cached_tokens"] >= expected_hit
    assert second["output_ids"] == first["output_ids"]
    without_cache = run([system + ref.prompt_ids(" Sure")], disable_radix_cache=True,
                        max_total_tokens=4096)[0]
    ref.assert_greedy_matches(system, longer["output_ids"], without_cache)


def test_lpm_policy_serves_shared_prefixes_first_with_same_outputs() -> None:
    shared = random_prompts(1, 120, 120, seed=5)[0]
    others = random_prompts(6, 20, 40, seed=6)
    prompts = [others[0], shared + [101], others[1], shared + [102], others[2], shared + [103]]
    fcfs = run(prompts, max_running_requests=1, max_total_tokens=4096, page_size=1)
    with LLM(dtype="float32", max_running_requests=1, max_total_tokens=4096, page_size=1,
             schedule_policy="lpm") as llm:
        llm.generate(input_ids=shared + [100], sampling_params=GREEDY)  # warm the cache
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY)
        llm.check_integrity()
    for ids, out, expected in zip(prompts, outs, fcfs):
        ref.assert_greedy_matches(ids, out["output_ids"], expected)
    hits = [out["meta_info"]["cached_tokens"] for out in outs]
    assert all(hits[i] >= 120 for i in (1, 3, 5)), hits
    latency = [out["meta_info"]["e2e_latency"] for out in outs]
    assert max(latency[i] for i in (1, 3, 5)) < min(latency[i] for i in (0, 2, 4)), latency


def test_page_size_does_not_change_outputs(prompts, alone) -> None:
    subset = prompts[:8]
    paged = run(subset, page_size=64, max_running_requests=8, max_total_tokens=8192)
    for ids, ours, expected in zip(subset, paged, alone[:8]):
        ref.assert_greedy_matches(ids, ours, expected)


def test_retraction_under_a_tiny_pool_completes_everything() -> None:
    prompts = random_prompts(12, 20, 60, seed=3)
    params = {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}
    roomy = run(prompts, params, max_total_tokens=8192, max_running_requests=12)
    with LLM(dtype="float32", max_total_tokens=400, max_running_requests=12) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                            logprob_start_len=0)
        retractions = llm.runtime.state()["retractions"]
        llm.check_integrity()
    assert retractions > 0, "the pool was meant to be too small to run everything at once"
    for ids, out, expected in zip(prompts, outs, roomy):
        assert len(out["output_ids"]) == 40
        ref.assert_greedy_matches(ids, out["output_ids"], expected)
        assert_input_logprobs_match(ids, 0, out["meta_info"])  # once, whole, after re-prefills


def test_schedule_conservativeness_scales_the_new_token_ratio() -> None:
    """The share of the running requests' remaining tokens that admission reserves starts at
    0.7 and decays to 0.1 over 600 decode steps, both times --schedule-conservativeness (capped
    at 1); a value <= 0 is refused."""
    from minisgl.args import ServerArgs
    with pytest.raises(ValueError, match="--schedule-conservativeness must be > 0"):
        ServerArgs(schedule_conservativeness=0)
    params = {"temperature": 0, "max_new_tokens": 700, "ignore_eos": True}
    for conservativeness, start, floor in ((0.5, 0.35, 0.05), (2.0, 1.0, 0.2)):
        with LLM(dtype="float32", load_format="dummy", max_total_tokens=2048,
                 json_model_override_args='{"num_hidden_layers": 2}',
                 schedule_conservativeness=conservativeness) as llm:
            assert llm.runtime.state()["new_token_ratio"] == pytest.approx(start)
            llm.generate(input_ids=[1, 2, 3], sampling_params=params)
            assert llm.runtime.state()["new_token_ratio"] == pytest.approx(floor)


def assert_input_logprobs_match(ids: list[int], start: int, meta: dict, top: int = 0) -> None:
    """SGLang's layout against the reference: entry i is (logprob of ids[start + i] given
    ids[:start + i], that id); entry 0 has None (nothing before it was scored)."""
    import torch
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == ids[start:]
    assert entries[0][0] is None and meta["input_top_logprobs"][0] is None
    want = torch.log_softmax(ref.hf_logits(ids), dim=-1)
    for i, (lp, tid, _) in enumerate(entries[1:], start=start + 1):
        assert abs(lp - want[i - 1, tid].item()) < LOGPROB_ABS_BOUND, (i, lp)
    tops = meta["input_top_logprobs"][1:]
    assert len(tops) == len(entries) - 1
    for i, step in enumerate(tops, start=start):
        assert len(step) == top
        want_top = want[i].topk(top).values.tolist() if top else []
        assert all(abs(lp - w) < LOGPROB_ABS_BOUND for (lp, _, _), w in zip(step, want_top))


def test_input_logprobs_match_transformers() -> None:
    """Scored prompt rows across prefill chunks, mixed in one batch with unscored requests,
    and again with the prompts in the prefix cache (the scored part must run again)."""
    prompts = random_prompts(4, 30, 70, seed=5)
    starts = [0, 7, -1, 40]
    with LLM(dtype="float32", chunked_prefill_size=32, page_size=1,
             max_total_tokens=4096) as llm:
        for attempt in range(2):
            outs = [llm.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                                 top_logprobs_num=2, logprob_start_len=s) for s in starts]
            for s, batch in zip(starts, outs):
                for ids, out in zip(prompts, batch):
                    start = len(ids) - 1 if s < 0 else s
                    if s < 0:  # as SGLang: the default starts at the prompt's end, none
                        assert out["meta_info"]["input_token_logprobs"] == []
                    else:
                        assert_input_logprobs_match(ids, start, out["meta_info"], top=2)
                    if attempt:  # served from the cache up to the scored part at most
                        assert out["meta_info"]["cached_tokens"] <= start
        scoring = llm.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0},
                               return_logprob=True, logprob_start_len=3)
        for ids, out in zip(prompts, scoring):  # a prefill only, no token
            assert out["output_ids"] == [] and out["meta_info"]["finish_reason"]["type"] == "length"
            assert_input_logprobs_match(ids, 3, out["meta_info"])
        # teacher forcing: scoring prompt + output gives the logprobs generation reported
        gen = llm.generate(input_ids=prompts[1], sampling_params=GREEDY, return_logprob=True)
        forced = llm.generate(input_ids=prompts[1] + gen["output_ids"],
                              sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=len(prompts[1]))
        scored = [e[0] for e in forced["meta_info"]["input_token_logprobs"][1:]]
        reported = [e[0] for e in gen["meta_info"]["output_token_logprobs"][1:]]
        assert scored == pytest.approx(reported, abs=LOGPROB_ABS_BOUND)
        with pytest.raises(InvalidRequest, match="logprob_start_len"):
            llm.generate(input_ids=prompts[0], sampling_params=GREEDY, return_logprob=True,
                         logprob_start_len=len(prompts[0]))
        plain = llm.generate(input_ids=prompts[0], sampling_params=GREEDY)
        assert "input_token_logprobs" not in plain["meta_info"]
        llm.check_integrity()


def test_request_larger_than_the_pool_gets_a_clear_error() -> None:
    with LLM(dtype="float32", max_total_tokens=64) as llm:
        with pytest.raises(InvalidRequest, match="pool holds only 64"):
            llm.generate(input_ids=list(range(100, 150)), sampling_params={"max_new_tokens": 30})
        ok = llm.generate(input_ids=list(range(100, 110)), sampling_params={"max_new_tokens": 4})
        assert len(ok["output_ids"]) == 4


def test_context_length_is_enforced_with_numbers_in_sglang_words() -> None:
    """SGLang's clients and tests match on its phrases."""
    with LLM(dtype="float32", context_length=64, max_total_tokens=512) as llm:
        with pytest.raises(InvalidRequest, match=r"maximum context length of 64 tokens\. You "
                           r"requested a total of 70 tokens: 50 tokens from the input"):
            llm.generate(input_ids=list(range(100, 150)), sampling_params={"max_new_tokens": 20})
        with pytest.raises(InvalidRequest, match=r"The input \(64 tokens\) is longer than the "
                           r"model's context length \(64 tokens\)"):
            llm.generate(input_ids=list(range(100, 164)), sampling_params={"max_new_tokens": 0})
        with pytest.raises(InvalidRequest, match=r"max_completion_tokens is too large: 100"):
            llm.generate(input_ids=list(range(100, 110)), sampling_params={"max_new_tokens": 100})


def test_finish_conditions() -> None:
    with LLM(dtype="float32", max_total_tokens=4096) as llm:
        ids = ref.prompt_ids(ref.chat_prompt("Say hi."))
        free = llm.generate(input_ids=ids, sampling_params={"temperature": 0,
                                                            "max_new_tokens": 64})
        assert free["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
        n = len(free["output_ids"])
        assert free["output_ids"][-1] == 2
        ignored = llm.generate(input_ids=ids, sampling_params={
            "temperature": 0, "max_new_tokens": n + 3, "ignore_eos": True})
        assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": n + 3}
        minimum = llm.generate(input_ids=ids, sampling_params={
            "temperature": 0, "max_new_tokens": n + 3, "min_new_tokens": n + 2})
        assert len(minimum["output_ids"]) >= n + 2 and 2 not in minimum["output_ids"][:n + 1]
        stop_id = free["output_ids"][1]
        stopped = llm.generate(input_ids=ids, sampling_params={
            "temperature": 0, "max_new_tokens": 64, "stop_token_ids": [stop_id]})
        assert stopped["output_ids"] == free["output_ids"][:2]
        assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
        zero = llm.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})
        assert zero["output_ids"] == [] and zero["meta_info"]["finish_reason"]["length"] == 0
        llm.check_integrity()


FUZZ_ARGS = dict(dtype="auto", max_total_tokens=3000, max_running_requests=24,
                 chunked_prefill_size=128, page_size=2, load_format="dummy",
                 json_model_override_args='{"num_hidden_layers": 4}')


def abort_fuzz(args: ServerArgs, priorities: tuple[int, ...] = (0,)) -> tuple[int, dict]:
    """Hundreds of requests of random lengths (and priorities); random ones aborted at random
    moments (waiting, prefilling, decoding). Integrity holds throughout, every page is free
    once the cache is flushed. Returns the aborts that landed and the scheduler's state."""
    rng = random.Random(11)

    async def scenario() -> tuple[int, dict]:
        runtime = Runtime(args)
        await runtime.start()
        manager = runtime.requests
        handles, aborted = [], 0
        shared = [rng.randrange(100, 20000) for _ in range(40)]
        for i in range(300):
            prompt = (shared if rng.random() < 0.3 else []) + [
                rng.randrange(100, 20000) for _ in range(rng.randint(1, 300))]
            params = SamplingParams(max_new_tokens=rng.randint(1, 40), ignore_eos=True,
                                    temperature=rng.choice([0, 1.0]))
            spec = RequestSpec(prompt, params, priority=rng.choice(priorities))
            handles += manager.submit([spec])
            for _ in range(rng.randint(0, 2)):
                await asyncio.sleep(rng.random() * 0.02)
            if rng.random() < 0.4:
                # Mostly recent requests, so that most aborts land on live ones (waiting,
                # prefilling or decoding) however fast this machine finishes the rest.
                victim = rng.choice(handles[-8:] if rng.random() < 0.8 else handles)
                aborted += manager.abort(victim.rid, "fuzz")
        results = await asyncio.gather(*(manager.wait(h) for h in handles))
        scheduler = runtime.scheduler
        while scheduler.has_work() or scheduler.to_release:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        scheduler.check_integrity()
        assert scheduler.stats.integrity_error is None
        for h in results:
            reason = h.finish_reason
            assert reason["type"] in ("length", "abort"), reason
            if reason["type"] == "length":
                assert len(h.output_ids) == reason["length"]
        state = runtime.state()
        scheduler.cache.reset_cache()
        assert scheduler.cache.num_free == scheduler.cache.num_pages, "pages leaked"
        await runtime.stop()
        return aborted, state

    return asyncio.run(scenario())


def test_abort_fuzz_keeps_every_page_accounted_for() -> None:
    # NOTE: the bookkeeping under test does not depend on the weights. A 4-layer dummy-weight
    # SmolLM2 is ~3x cheaper; ~97 of ~120 aborts land (on a Zen 5 core, 2026-11).
    aborted, _ = abort_fuzz(ServerArgs(**FUZZ_ARGS))
    assert aborted > 50, f"only {aborted} aborts landed on live requests"


def test_a_handle_that_finishes_while_its_reader_is_busy_still_yields_its_end() -> None:
    """A stream's writer awaits between two updates (a slow socket, a drain): the request may
    finish meanwhile, and its finished state is still yielded, so the client gets its last
    chunk (finish_reason) before [DONE]."""

    async def scenario() -> list[bool]:
        runtime = Runtime(ServerArgs(**FUZZ_ARGS))
        await runtime.start()
        manager = runtime.requests
        params = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0)
        [handle] = manager.submit([RequestSpec([1, 2, 3], params)])
        seen = []
        async for update in manager.updates(handle):
            seen.append(update.finished)
            while not handle.finished:  # the writer is busy until the request ended
                await asyncio.sleep(0.01)
        await runtime.stop()
        return seen

    seen = asyncio.run(scenario())
    assert seen[0] is False and seen[-1] is True, seen


def test_default_chunk_keeps_cpu_activations_under_the_allocator_limit() -> None:
    from minisgl.engine.chunking import CPU_ALLOCATION_LIMIT, default_chunk

    gate_up = 2 * 1536  # the bundled model's merged gate/up width
    assert default_chunk("cuda", False, gate_up * 2) == 8192
    assert default_chunk("cpu", True, gate_up * 2) == 256  # mixed: the stall bound wins
    bf16, fp32 = default_chunk("cpu", False, gate_up * 2), default_chunk("cpu", False, gate_up * 4)
    assert (bf16, fp32) == (4096, 2048)
    for chunk, row in ((bf16, gate_up * 2), (fp32, gate_up * 4)):
        assert chunk * row <= CPU_ALLOCATION_LIMIT < 2 * chunk * row
    assert default_chunk("cpu", False, 1 << 20) == 1024  # never below the floor
    with LLM(dtype="bfloat16", load_format="dummy", max_total_tokens=4096) as llm:
        assert llm.runtime.scheduler.config.chunked_prefill_size == 4096


def test_the_widest_activation_counts_a_linear_mixers_projection_and_a_mixtures_rows() -> None:
    """A hybrid's input projection can be wider than its gate/up, and a mixture holds k rows per
    token: either, not the dense gate/up alone, sets the CPU chunk."""
    from torch import nn

    from minisgl.engine.chunking import widest_row_width
    from minisgl.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear
    from minisgl.layers.moe import Experts

    gate_up = MergedColumnParallelLinear(64, [96, 96])
    assert widest_row_width(nn.ModuleList([gate_up]), 1) == 192
    in_proj = ColumnParallelLinear(64, 400)
    assert widest_row_width(nn.ModuleList([gate_up, in_proj]), 1) == 400
    experts = Experts(4, 64, 32)  # gated: gate/up 64 wide, as wide as the hidden state
    assert widest_row_width(nn.ModuleList([gate_up, experts]), 6) == 6 * 64


def test_integrity_check_finds_a_repeated_page_and_runs_idle_on_pools_it_can_afford(
        monkeypatch) -> None:
    """A free list holding one page twice (and so missing another) fails the check; the check
    runs on each idle turn unless the pool is past IDLE_CHECK_MAX_PAGES, where a pass over every
    page id would hold the scheduler up (then only check_integrity() runs it)."""
    from minisgl.errors import IntegrityError
    from minisgl.scheduler import scheduler as scheduler_module
    prompts = random_prompts(2, 5, 40)
    with LLM(dtype="float32", max_total_tokens=2048) as llm:
        llm.generate(input_ids=prompts, sampling_params=GREEDY)
        llm.check_integrity()
        scheduler = llm.runtime.scheduler
        free = scheduler.cache._free
        kept = free[0].item()
        free[0] = free[1]
        with pytest.raises(IntegrityError, match="counted twice"):
            llm.check_integrity()
        def error_after_idle() -> str | None:
            llm.generate(input_ids=prompts, sampling_params=GREEDY)
            for _ in range(50):  # the idle turn follows the last request's finish
                if scheduler.stats.integrity_error is not None:
                    break
                time.sleep(0.01)
            return scheduler.stats.integrity_error

        monkeypatch.setattr(scheduler_module, "IDLE_CHECK_MAX_PAGES", 0)
        assert error_after_idle() is None  # skipped: the pool is "too big"
        monkeypatch.undo()
        assert "counted twice" in error_after_idle()
        free[0] = kept
        llm.check_integrity()
