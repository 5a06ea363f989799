"""Continuous decode steps (--num-continuous-decode-steps): a run of decode steps in one launch
gives the tokens, logprobs and finishes that one step at a time gives, on the real model in
float32, and launches fewer batches.

NOTE: the CPU kernels' sums depend on the batch's rows, and a row that stops at EOS leaves a
batch of single steps one step after its token is processed but a run's batch at the run's
end: requests together are compared with EOS ignored, so that every step holds the same rows
either way."""

from __future__ import annotations

import pytest

from minisgl import LLM
from minisgl.args import ServerArgs
from tests import reference as ref
from tests.test_scheduler import random_prompts

# a seeded sampled request with logprobs, a greedy one, one that may stop at EOS part-way
# through a run, and requests whose sampling changes with their length (decoded one step at a
# time until min_new_tokens is reached; with penalties always)
REQUESTS = [
    {"max_new_tokens": 40, "temperature": 0},  # a chat turn that ends at EOS
    {"max_new_tokens": 23, "temperature": 0.9, "sampling_seed": 7},
    {"max_new_tokens": 30, "temperature": 0},
    {"max_new_tokens": 40, "temperature": 1.3, "sampling_seed": 3},
    {"max_new_tokens": 17, "temperature": 0.7, "sampling_seed": 11, "min_new_tokens": 6},
    {"max_new_tokens": 12, "temperature": 0, "frequency_penalty": 0.5},
]


def outputs(steps: int, together: bool, **args) -> tuple[list[dict], int]:
    """Each request's output ids, logprobs and finish; and the batches launched."""
    with LLM(dtype="float32", num_continuous_decode_steps=steps, **args) as llm:
        chat = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Say hello in one word."}], add_generation_prompt=True,
            tokenize=False), add_special_tokens=False)
        prompts = [chat] + random_prompts(len(REQUESTS) - 1, 5, 40, seed=1)
        if together:  # NOTE: no row stops at EOS, so each step has the same rows either way
            params = [dict(r, ignore_eos=True) for r in REQUESTS]
            outs = llm.generate(input_ids=prompts, sampling_params=params,
                                return_logprob=True, top_logprobs_num=3)
        else:
            outs = [llm.generate(input_ids=p, sampling_params=r, return_logprob=True,
                                 top_logprobs_num=3) for p, r in zip(prompts, REQUESTS)]
        llm.check_integrity()
        batches = llm.runtime.scheduler.stats.batches
    return [{"ids": o["output_ids"], "finish": o["meta_info"]["finish_reason"],
             "logprobs": o["meta_info"]["output_token_logprobs"],
             "top": o["meta_info"]["output_top_logprobs"]} for o in outs], batches


@pytest.mark.parametrize("together", [False, True], ids=["alone", "together"])
def test_a_run_of_steps_gives_what_single_steps_give(together: bool) -> None:
    single, single_batches = outputs(1, together)
    runs, run_batches = outputs(5, together)
    assert runs == single
    if not together:
        assert single[0]["finish"]["type"] == "stop"  # a run ended part-way
    assert run_batches < single_batches


@pytest.mark.parametrize("page_size", [1, 16])
def test_runs_across_pages_give_what_single_steps_give(page_size: int) -> None:
    """Runs of 7 steps whose slots cross pages of one token and of 16."""
    assert outputs(7, True, page_size=page_size)[0] == outputs(1, True, page_size=page_size)[0]


def test_a_pool_too_small_for_the_runs_retracts_and_loses_nothing() -> None:
    """Short of pages for a run, the batch decodes one step, then retracts: every request
    still ends whole, greedy tokens as single steps give them, every page accounted for."""
    prompts = random_prompts(6, 30, 60, seed=2)
    params = {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True}
    results = {}
    for steps in (1, 7):
        with LLM(dtype="float32", num_continuous_decode_steps=steps, max_total_tokens=256,
                 page_size=16) as llm:
            outs = llm.generate(input_ids=prompts, sampling_params=params)
            llm.check_integrity()
            results[steps] = ([o["output_ids"] for o in outs],
                              llm.runtime.scheduler.stats.retractions)
    (single, _), (runs, retractions) = results[1], results[7]
    assert retractions > 0
    for prompt, ours, expected in zip(prompts, runs, single):
        assert len(ours) == 40
        ref.assert_greedy_matches(prompt, ours, expected)


def test_the_default_runs_a_lone_request_only() -> None:
    """No flag: a lone request's decode steps go in runs."""
    alone, alone_batches = outputs(1, False)
    default_alone, default_alone_batches = outputs(None, False)  # type: ignore[arg-type]
    assert default_alone == alone and default_alone_batches < alone_batches


@pytest.mark.parametrize("value", [0, -2])
def test_the_flag_takes_a_positive_count(value: int) -> None:
    with pytest.raises(ValueError, match="--num-continuous-decode-steps"):
        ServerArgs(num_continuous_decode_steps=value)
