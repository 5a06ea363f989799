"""Scheduling policies on the real model: priorities (order, preemption, queue displacement),
mixed chunked prefill, lof / random, and lpm's in-batch prefix sharing. Outputs are compared in
float32 (tests.reference.assert_greedy_matches: equal, or first differing where the reference's
top-2 margin is below its bound)."""

from __future__ import annotations

import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from minisgl import LLM
from minisgl.args import ServerArgs
from minisgl.errors import InvalidRequest
from tests import reference as ref
from tests.test_scheduler import FUZZ_ARGS, abort_fuzz, random_prompts
from tests.test_server import get, post, state, wait_for

LONG = {"temperature": 0, "max_new_tokens": 64, "ignore_eos": True}
SHORT = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


class Clock:
    """Requests sent from threads; each result is stamped with the time it came back."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.pool = ThreadPoolExecutor(16)

    def send(self, body: dict[str, Any], path: str = "/generate") -> Future:
        def call() -> tuple[float, Any]:
            response = post(self.server, path, body)
            assert response.status_code == 200, response.text
            return time.monotonic(), response.json()
        return self.pool.submit(call)


def waiting(server: Any) -> dict[str, int]:
    return state(server)["waiting_by_priority"]


# ---- priorities --------------------------------------------------------------------------------

@pytest.mark.parametrize("enabled", [True, False], ids=["priority", "fcfs"])
def test_urgent_requests_overtake_earlier_ones_on_a_saturated_server(minisgl_server_factory,
                                                                     enabled: bool):
    """Two slots, both busy; four requests wait, then two more urgent ones arrive (by less than
    the preemption threshold). With priority scheduling the urgent ones finish first; without
    it, `priority` is accepted and ignored (arrival order)."""
    flags = ["--max-running-requests", "2"] + (["--enable-priority-scheduling"] if enabled else [])
    server = minisgl_server_factory(*flags)
    prompts = random_prompts(8, 10, 30, seed=21)
    clock = Clock(server)
    blockers = [clock.send({"input_ids": p, "sampling_params": LONG}) for p in prompts[:2]]
    wait_for(lambda: state(server)["num_running_reqs"] == 2, what="two running")
    low = [clock.send({"input_ids": p, "sampling_params": SHORT, "priority": 0})
           for p in prompts[2:6]]
    wait_for(lambda: waiting(server) == {"0": 4}, what="four waiting")
    high = [clock.send({"input_ids": p, "sampling_params": SHORT, "priority": 5})
            for p in prompts[6:]]
    wait_for(lambda: waiting(server) == {"5": 2, "0": 4}, what="six waiting by priority")
    for f in blockers:
        f.result()
    low_done = [f.result()[0] for f in low]
    high_done = [f.result()[0] for f in high]
    if enabled:
        assert max(high_done) < min(low_done)
    else:
        assert max(low_done) < min(high_done)
    assert state(server)["preemptions"] == 0


def test_preempted_requests_resume_with_the_same_greedy_output(minisgl_server_factory):
    """Urgent requests (by more than the threshold) preempt both running ones, through
    /generate and both OpenAI endpoints; the preempted ones finish as they would alone."""
    server = minisgl_server_factory("--max-running-requests", "2", "--enable-priority-scheduling")
    prompts = random_prompts(3, 20, 40, seed=22)
    alone = [post(server, "/generate", {"input_ids": p, "sampling_params": LONG}).json()
             for p in prompts[:2]]
    post(server, "/flush_cache")
    clock = Clock(server)
    blockers = [clock.send({"input_ids": p, "sampling_params": LONG, "priority": 0})
                for p in prompts[:2]]
    wait_for(lambda: state(server)["generated_tokens"] >= 2 * 64 + 8, what="both decoding")
    urgent = [clock.send({"input_ids": prompts[2], "sampling_params": SHORT, "priority": 20}),
              clock.send({"prompt": prompts[2], "max_tokens": 6,
                          "temperature": 0, "priority": 20}, "/v1/completions"),
              clock.send({"max_tokens": 6, "temperature": 0,
                          "priority": 20, "messages": [{"role": "user", "content": "Hi"}]},
                         "/v1/chat/completions")]
    urgent_done = [f.result()[0] for f in urgent]
    results = [f.result() for f in blockers]
    assert max(urgent_done) < min(done for done, _ in results)
    assert state(server)["preemptions"] >= 2
    for prompt, (_, out), solo in zip(prompts, results, alone):
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        ref.assert_greedy_matches(prompt, out["output_ids"], solo["output_ids"])
    metrics = get(server, "/metrics").text
    assert "minisgl_preemptions_total" in metrics


def test_an_urgent_arrival_displaces_the_least_urgent_waiting_request(minisgl_server_factory):
    server = minisgl_server_factory("--max-running-requests", "1", "--max-queued-requests", "2",
                                    "--enable-priority-scheduling")
    prompts = random_prompts(5, 10, 20, seed=23)
    clock = Clock(server)
    blocker = clock.send({"input_ids": prompts[0], "sampling_params": LONG})
    wait_for(lambda: state(server)["num_running_reqs"] == 1, what="one running")
    older = clock.send({"input_ids": prompts[1], "sampling_params": SHORT, "priority": 0})
    wait_for(lambda: waiting(server) == {"0": 1}, what="one waiting")
    newer = clock.send({"input_ids": prompts[2], "sampling_params": SHORT, "priority": 0})
    wait_for(lambda: waiting(server) == {"0": 2}, what="queue full")
    equal = post(server, "/generate", {"input_ids": prompts[3], "sampling_params": SHORT,
                                       "priority": 0})
    assert equal.status_code == 503 and "full" in equal.json()["error"]["message"]
    urgent = clock.send({"input_ids": prompts[4], "sampling_params": SHORT, "priority": 1})
    _, displaced = newer.result()
    reason = displaced["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "displaced" in reason["message"], reason
    assert urgent.result()[1]["meta_info"]["finish_reason"]["type"] == "length"
    assert older.result()[1]["meta_info"]["finish_reason"]["type"] == "length"
    assert urgent.result()[0] < older.result()[0]
    blocker.result()


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": "Hi", "priority": "high"}),
    ("/generate", {"text": "Hi", "priority": 1.5}),
    ("/generate", {"text": ["Hi", "Yo"], "priority": [1, True]}),
    ("/v1/completions", {"prompt": "Hi", "priority": "1"}),
    ("/v1/chat/completions", {"priority": [1],
                              "messages": [{"role": "user", "content": "Hi"}]}),
])
def test_priority_must_be_an_integer(minisgl_server, path, body):
    response = post(minisgl_server, path, body)
    assert response.status_code == 400, response.text
    assert "priority" in response.json()["error"]["message"]


def test_offline_priority_is_checked():
    with LLM(dtype="bfloat16", load_format="dummy",
             json_model_override_args='{"num_hidden_layers": 2}') as llm:
        with pytest.raises(InvalidRequest, match="priority"):
            llm.generate(input_ids=[1, 2, 3], priority="urgent")
        out = llm.generate(input_ids=[1, 2, 3], priority=-7, sampling_params=SHORT)
        assert len(out["output_ids"]) == 6


# ---- mixed chunked prefill ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def mixed_prompts() -> list[list[int]]:
    """Random lengths, and four prompts sharing a 200-token prefix (so some hit the cache)."""
    shared = random_prompts(1, 200, 200, seed=31)[0]
    return random_prompts(10, 5, 500, seed=30) + [shared + p for p in random_prompts(4, 3, 40,
                                                                                     seed=32)]


def run_all(prompts: list[list[int]], **args: Any) -> tuple[list[dict], dict]:
    params = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
    with LLM(dtype="float32", max_total_tokens=16000, max_running_requests=16, **args) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        llm.check_integrity()
        return outs, llm.runtime.state()


@pytest.fixture(scope="module")
def unmixed(mixed_prompts) -> list[dict]:
    return run_all(mixed_prompts)[0]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_mixed_batches_give_the_unmixed_greedy_output(mixed_prompts, unmixed, overlap: bool):
    outs, stats = run_all(mixed_prompts, enable_mixed_chunk=True, chunked_prefill_size=64,
                          disable_overlap_schedule=not overlap)
    assert stats["engine_mixed_steps"] > 0 and stats["cached_prompt_tokens"] > 0, stats
    for ids, out, expected in zip(mixed_prompts, outs, unmixed):
        ref.assert_greedy_matches(ids, out["output_ids"], expected["output_ids"])


def test_mixed_preempting_abort_fuzz_keeps_every_page_accounted_for():
    aborted, stats = abort_fuzz(ServerArgs(**FUZZ_ARGS, enable_mixed_chunk=True,
                                           enable_priority_scheduling=True),
                                priorities=(0, 0, 0, 20))
    assert aborted > 50 and stats["engine_mixed_steps"] > 0, stats
    if stats["preemptions"] == 0:  # integrity held; the timing never set up a preemption
        pytest.xfail("no preemption happened on this machine (seen on a 2-core AVX2 VM, at "
                     "the issue-28 base commit too): the scenario depends on timing")


# ---- policies ----------------------------------------------------------------------------------

def test_lof_serves_the_longest_output_first():
    prompts = random_prompts(4, 5, 10, seed=41)
    lengths = [3, 12, 6, 9]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
    with LLM(dtype="bfloat16", max_running_requests=1, schedule_policy="lof") as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
    done = [out["meta_info"]["e2e_latency"] for out in outs]
    assert sorted(range(4), key=lambda i: done[i]) == sorted(range(4), key=lambda i: -lengths[i])


@pytest.mark.parametrize("policy", ["lpm", "random", "lof"])
def test_policies_keep_outputs_and_lpm_shares_in_batch(policy: str):
    """Four groups of three requests, each group sharing a 96-token prefix nobody cached yet,
    all arriving at once. fcfs admits them all in one round (no hits: the chunk holds all
    1212 prompt tokens); lpm admits one per group first, so the other two hit its pages."""
    rng = random.Random(42)
    prompts = []
    for group in random_prompts(4, 96, 96, seed=43):
        prompts += [group + [rng.randrange(100, 20000) for _ in range(5)] for _ in range(3)]
    fcfs, fcfs_stats = run_all(prompts, chunked_prefill_size=2048)
    outs, stats = run_all(prompts, schedule_policy=policy, chunked_prefill_size=2048)
    for ids, out, expected in zip(prompts, outs, fcfs):
        ref.assert_greedy_matches(ids, out["output_ids"], expected["output_ids"])
    assert fcfs_stats["cached_prompt_tokens"] == 0
    if policy == "lpm":
        assert stats["cached_prompt_tokens"] == 8 * 96, stats["cached_prompt_tokens"]
