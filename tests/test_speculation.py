"""Speculative decoding (--speculative-algorithm NGRAM and STANDALONE). Its parts: n-gram
drafts and the verification of drafts, greedy and sampled; the sampled rule must leave the target's
distribution unchanged, checked on 200,000 rows at once, total variation distance within
TV_BOUND (its sampling noise is ~0.003 with 5 outcomes; a rule that accepted point-mass drafts
outright would be off by ~0.5). Then the whole path on the real model: greedy output equal to
plain decoding under every scheduling variant, limits, stops and logprobs inside accepted runs,
retraction, tensor parallelism, the sampled distribution, an abort fuzz, and bad flags. A
draft model is the bundled model itself (its drafts are nearly all accepted, so a drop in
acceptance shows draft KV gone wrong) or its first layers alone (mostly rejected)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl import LLM
from minisgl.args import ServerArgs
from minisgl.core import Batch, span_indices
from minisgl.engine.acceptance import accept_greedy, accept_sampled
from minisgl.engine.forward import ForwardInput, VerifyRows
from minisgl.engine.ngram import NgramIndex
from minisgl.engine.speculation import SpecConfig, Speculator
from minisgl.engine.tp_message import StepMessage
from minisgl.layers.quant import vnni_kernels
from minisgl.models import resolve_model_path
from tests import reference as ref
from tests.test_scheduler import FUZZ_ARGS, abort_fuzz

TV_BOUND = 0.01
ROWS = 200_000


def test_ngram_drafts_what_followed_the_longest_earlier_match():
    index = NgramIndex(min_window=1, max_window=3)
    index.extend([5, 6, 7, 8, 9, 1, 6, 7, 2, 6, 7])
    # the suffix (2,) 6, 7: "2 6 7" never came before, "6 7" did, last followed by 2
    assert index.draft(3) == [2, 6, 7]
    index.extend([8])  # "6 7 8": seen once, at the start
    assert index.draft(4) == [9, 1, 6, 7]
    assert NgramIndex().draft(3) == []  # nothing to match
    single = NgramIndex()
    single.extend([4])
    assert single.draft(2) == []  # its own suffix is not a match


def test_ngram_truncate_forgets_the_tail():
    index = NgramIndex(1, 2)
    index.extend([1, 2, 3, 1, 2, 9])
    index.truncate(5)  # back to 1 2 3 1 2
    assert index.draft(2) == [3, 1]
    assert index.tokens == [1, 2, 3, 1, 2]


def test_ngram_windows_are_checked():
    with pytest.raises(ValueError, match="1 <= min"):
        NgramIndex(0, 3)


def greedy_by_hand(drafts: list[int], target: list[int]) -> list[int]:
    out = []
    for draft, best in zip(drafts, target):
        if draft != best:
            break
        out.append(draft)
    return out + [target[len(out)]]


def test_greedy_acceptance_is_the_longest_matching_prefix_then_the_target():
    rng = random.Random(0)
    rows, k = 300, 4
    drafts = [[rng.randrange(3) for _ in range(k)] for _ in range(rows)]
    lens = [rng.randint(0, k) for _ in range(rows)]
    target = [[rng.randrange(3) for _ in range(k + 1)] for _ in range(rows)]
    accepted, emitted = accept_greedy(torch.tensor(drafts), torch.tensor(lens),
                                      torch.tensor(target))
    for row in range(rows):
        want = greedy_by_hand(drafts[row][:lens[row]], target[row])
        assert accepted[row] == len(want) - 1
        assert emitted[row, :len(want)].tolist() == want


def tv(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    return float((counts / counts.sum() - probs.double()).abs().sum() / 2)


@pytest.mark.parametrize("drafter", ["point masses", "draft model"])
def test_sampled_acceptance_keeps_the_target_distribution(drafter: str):
    gen = torch.Generator().manual_seed(1)
    vocab, k = 5, 2
    p = torch.softmax(torch.randn(k + 1, vocab, generator=gen) * 1.5, dim=-1)
    q = torch.softmax(torch.randn(k, vocab, generator=gen) * 1.5, dim=-1)
    if drafter == "point masses":  # an n-gram drafter: a fixed guess per position
        drafts = torch.tensor([[int(p[0].argmin()), int(p[1].argmax())]]).repeat(ROWS, 1)
        draft_probs = None
    else:  # drafts drawn from q
        drafts = torch.stack([torch.multinomial(q[i], ROWS, replacement=True, generator=gen)
                              for i in range(k)], dim=1)
        draft_probs = q[None].expand(ROWS, k, vocab)
    target = p[None].expand(ROWS, k + 1, vocab)
    accepted, emitted = accept_sampled(drafts, torch.full((ROWS,), k), target, draft_probs,
                                       generator=gen)
    assert tv(emitted[:, 0], p[0]) < TV_BOUND
    second = emitted[accepted >= 1, 1]  # the next token wherever the first draft was kept
    assert len(second) > ROWS // 20
    assert tv(second, p[1]) < TV_BOUND
    # a row that drafted nothing samples from p_0 alone
    none, emitted = accept_sampled(drafts, torch.zeros(ROWS, dtype=torch.long), target,
                                   draft_probs, generator=gen)
    assert (none == 0).all() and tv(emitted[:, 0], p[0]) < TV_BOUND


# ---- the whole path: the real model through the scheduler (float32) -------------------------

# NOTE: drafting at every step, so what a test counts does not depend on its timing (the
# "adaptive" variant runs the governor, test_draft_governor_* its decisions)
SPEC = {"speculative_algorithm": "NGRAM", "speculative_always_draft": True}
GREEDY = {"temperature": 0, "max_new_tokens": 40}


def copy_prompts() -> list[list[int]]:
    """Prompts the model continues by copying: n-gram drafts are mostly right. Two chat
    questions too, where they are mostly wrong."""
    rng = random.Random(5)
    prompts = []
    for length in (12, 25, 40, 60):
        passage = [rng.randrange(100, 20000) for _ in range(length)]
        prompts.append(passage + passage + passage[:4])
    passage = ref.prompt_ids(" ".join(ref.PLAIN_PROMPTS))
    prompts.append(ref.prompt_ids("Repeat after me: ") + passage + ref.prompt_ids(
        "\nAgain: ") + passage[:3])
    return prompts + [ref.prompt_ids(ref.chat_prompt(q)) for q in ref.CHAT_QUESTIONS]


def shallow_model(folder: Path, layers: int) -> str:
    """The bundled model cut to its first `layers` layers: a draft model that is often wrong."""
    source = resolve_model_path(None)
    folder.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.name != "config.json" and not (folder / file.name).exists():
            (folder / file.name).symlink_to(file)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    return str(folder)


@pytest.fixture(scope="module")
def drafts(tmp_path_factory) -> dict[str, dict]:
    """STANDALONE flags with the bundled model itself, and with its first 4 layers, as draft."""
    shallow = shallow_model(tmp_path_factory.mktemp("draft") / "shallow", 4)
    standalone = {"speculative_algorithm": "STANDALONE", "speculative_always_draft": True}
    return {"self": {**standalone, "speculative_draft_model_path": str(resolve_model_path(None))},
            "shallow": {**standalone, "speculative_draft_model_path": shallow}}


def generate(prompts: list[list[int]], params: dict = GREEDY, **args) -> tuple[list[dict],
                                                                                dict]:
    with LLM(**{"dtype": "float32", **args}) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        llm.check_integrity()
        return outs, llm.runtime.state()


@pytest.fixture(scope="module")
def plain() -> list[dict]:
    return generate(copy_prompts(), max_total_tokens=8192)[0]


def assert_same_greedy(prompts: list[list[int]], outs: list[dict], plain: list[dict]) -> None:
    for ids, out, want in zip(prompts, outs, plain):
        ref.assert_greedy_matches(ids, out["output_ids"], want["output_ids"])
        if out["output_ids"] == want["output_ids"]:
            assert out["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


@pytest.mark.parametrize("args", [
    {}, {"disable_overlap_schedule": True}, {"chunked_prefill_size": 16},
    {"page_size": 1}, {"enable_mixed_chunk": True, "chunked_prefill_size": 16},
    {"speculative_num_draft_tokens": 8, "speculative_ngram_max_match_window_size": 3},
    {"speculative_always_draft": False},
], ids=["overlap", "no-overlap", "chunk-16", "page-1", "mixed", "k8-window3", "adaptive"])
def test_greedy_output_equals_plain_decoding(plain, args: dict) -> None:
    prompts = copy_prompts()
    outs, state = generate(prompts, max_total_tokens=8192, **{**SPEC, **args})
    assert_same_greedy(prompts, outs, plain)
    if args.get("enable_mixed_chunk"):  # speculating rows ride in prefill chunks (no drafts)
        assert state["engine_mixed_steps"] > 0, state
    if not {**SPEC, **args}["speculative_always_draft"]:
        return  # the governor may have stopped drafting: only the outputs are compared
    # the copying prompts accept most drafts: the comparison exercised speculation
    assert state["spec_accepted_tokens"] > 60 and state["spec_accept_length"] > 1.5, state
    copied = outs[4]["meta_info"]
    assert copied["spec_verify_ct"] < copied["completion_tokens"] / 2, copied
    assert copied["spec_accept_length"] == pytest.approx(
        copied["completion_tokens"] / copied["spec_verify_ct"])


@pytest.mark.skipif(vnni_kernels() is None, reason="the 4-bit block kernel needs AVX-512 VNNI")
def test_served_in_bfloat16_blocks_the_output_is_exactly_plain_decodings() -> None:
    """The CPU serving default (bfloat16, the GGUF's 4-bit blocks, the LM head's 8-bit copy):
    every kernel a token row goes through computes it the same whatever rows share the call, so
    verify steps of 4 requests' drafts (up to 16 tokens) give plain decoding's tokens exactly,
    not merely within float noise."""
    questions = ["Describe your ideal weekend.", "Write a haiku about autumn.",
                 "Give me three tips for learning a new language.", "How do vaccines work?"]
    outs = []
    for spec in ({}, SPEC):
        with LLM(dtype="bfloat16", max_total_tokens=8192, max_running_requests=4,
                 **spec) as llm:
            assert llm.runtime.engine.quantization == "gguf"
            chats = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                       tokenize=False, add_generation_prompt=True)
                     for q in questions]
            outs.append(llm.generate(chats, {"temperature": 0, "max_new_tokens": 96}))
            state = llm.runtime.state()
    assert [o["output_ids"] for o in outs[1]] == [o["output_ids"] for o in outs[0]]
    assert state["spec_accepted_tokens"] > 30, state


@pytest.mark.parametrize("draft, args", [
    ("self", {}), ("self", {"disable_overlap_schedule": True}),
    ("shallow", {"chunked_prefill_size": 16}),
    ("shallow", {"page_size": 1, "speculative_num_draft_tokens": 6}),
], ids=["self", "self-no-overlap", "shallow-chunk-16", "shallow-page-1-k6"])
def test_draft_model_greedy_output_equals_plain_decoding(plain, drafts, draft: str,
                                                         args: dict) -> None:
    prompts = copy_prompts()
    outs, state = generate(prompts, max_total_tokens=8192, **{**drafts[draft], **args})
    assert_same_greedy(prompts, outs, plain)
    assert state["spec_drafted_tokens"] > 80, state  # rows that keep rejecting cool down
    if draft == "self":  # the target's own drafts: accepted nearly always
        assert state["spec_accept_length"] > 3.5, state
    else:  # so the comparison went through many rejections
        assert state["spec_accept_length"] < 3.0, state


@pytest.mark.parametrize("count", [0, 1, 4, 20], ids=["empty", "decode", "verify", "prefill"])
def test_span_indices_list_each_span_in_order(count: int) -> None:
    """A step's few tokens take a path of lists, a prefill's of tensor ops: the same spans."""
    rows, starts = [3, 0, 7, 5], [10, 0, 250, 33]
    counts = [count, 2 * count, count, count // 2]
    positions, flat = span_indices(rows, starts, counts, 256)
    want = [(row, start + j) for row, start, n in zip(rows, starts, counts) for j in range(n)]
    assert positions.dtype == flat.dtype == torch.int64
    assert positions.tolist() == [p for _, p in want]
    assert flat.tolist() == [row * 256 + p for row, p in want]


@pytest.mark.parametrize("graph_rows", [2, 1], ids=["padded", "packed"])
def test_verify_layout_sends_fillers_to_the_dummy_location(graph_rows: int) -> None:
    """Speculator.resolve on a hand-made table: a row that copies (3 drafts) and one without
    a match. Laid out for verify graphs of width 6, each row forwards 6 tokens at its next
    positions; only its own tokens write KV (its page-table slots) and store predictions; the
    fillers' KV goes to the dummy location. Past the graphs' rows, the step stays packed."""
    ctx, dummy = 32, 7
    token_pool = torch.zeros(4, ctx, dtype=torch.int32)
    page_table = torch.arange(4 * ctx, dtype=torch.int32).view(4, ctx) + 1000
    config = SpecConfig("NGRAM", num_draft_tokens=4, min_window=1, max_window=4,
                        batch_tokens=32, catch_up_tokens=512, budget=False)
    speculator = Speculator(config, token_pool, page_table)
    speculator.pad_for_graphs(6, graph_rows, dummy)
    token_pool[0, :9] = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5])
    token_pool[2, :3] = torch.tensor([1, 2, 3])
    speculator.committed[0], speculator.committed[2] = 9, 3
    batch = Batch("decode", 2, table_rows=[0, 2], cached_lens=[], seq_lens=[], extend_lens=[])
    verify = VerifyRows(uids=[1, 2], max_drafts=[3, 3], max_lens=[30, 30], greedy=[True] * 2)
    empty = torch.zeros(0, dtype=torch.int64)
    fwd = ForwardInput(batch, empty, empty, logit_rows=None, sample_args=None, verify=verify)
    speculator.resolve(fwd)
    assert verify.drafts == [[6, 7, 8], []] and verify.counts == [4, 1]
    assert token_pool[0, 9:12].tolist() == [6, 7, 8]
    assert fwd.write_indices.tolist() == [9, 10, 11, 12, 2 * ctx + 3]
    assert batch.cached_lens == [8, 2]
    if graph_rows == 1:  # more rows than the graphs take
        assert batch.row_tokens == 0 and batch.extend_lens == [4, 1] and verify.offsets == [0, 4]
        assert batch.out_loc.tolist() == [1008, 1009, 1010, 1011, 1000 + ctx * 2 + 2]
        return
    assert batch.row_tokens == 6 and batch.extend_lens == [6, 6] and batch.seq_lens == [14, 8]
    assert batch.input_positions.tolist() == list(range(8, 14)) + list(range(2, 8))
    assert fwd.load_indices.tolist() == [*range(8, 14), *range(2 * ctx + 2, 2 * ctx + 8)]
    assert batch.out_loc.tolist() == [1008, 1009, 1010, 1011, dummy, dummy,
                                      1000 + ctx * 2 + 2] + [dummy] * 5
    assert verify.offsets == [0, 6] and fwd.logit_rows.tolist() == list(range(12))
    # what tensor-parallel workers rebuild (their graphs need the width too)
    message = StepMessage("decode", 2, [0, 2], [], [], [], empty, empty, empty, empty, None)
    message.resolve(batch, fwd.load_indices, fwd.write_indices, fwd.logit_rows,
                    speculator.token_writes(fwd))
    worker = StepMessage.unpack(message.pack()).batch(torch.device("cpu"))
    assert worker.row_tokens == 6 and worker.extend_lens == [6, 6]
    assert torch.equal(worker.out_loc, batch.out_loc)


def test_verify_steps_laid_out_for_cuda_graphs_equal_plain(plain) -> None:
    """The layout CUDA graphs of verify steps replay (engine.graph): every row forwards the
    same number of tokens, its own then fillers that write KV to the dummy location and are
    never accepted. Run eagerly here: greedy output equals plain decoding, each chosen token's
    logprob is its top one (read at the right token row), and every page is accounted for."""
    prompts = copy_prompts()
    with LLM(dtype="float32", max_total_tokens=8192, **SPEC) as llm:
        engine = llm.runtime.engine
        engine.runner.speculator.pad_for_graphs(6, 8, engine.kv_pool.dummy_loc)
        outs = llm.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True,
                            top_logprobs_num=2)
        llm.check_integrity()
        state = llm.runtime.state()
    assert_same_greedy(prompts, outs, plain)
    assert state["spec_accepted_tokens"] > 60, state
    for out in outs:
        meta = out["meta_info"]
        for (logprob, token, _), top in zip(meta["output_token_logprobs"],
                                            meta["output_top_logprobs"]):
            assert token == top[0][1] and logprob == pytest.approx(top[0][0], abs=1e-5)


def test_draft_model_kv_follows_prefix_hits_retraction_and_long_prompts(plain, drafts) -> None:
    """The draft's KV must hold each row's true tokens, also where the target skipped work: a
    prefix-cache hit (the draft recomputes the cached prompt), a retraction (the pages are
    gone, the request is prefilled again) and a prompt longer than one step's catch-up. With
    the target itself as draft nearly every draft is accepted only if it does."""
    prompts = copy_prompts()
    rng = random.Random(9)
    passage = [rng.randrange(100, 20000) for _ in range(400)]
    long_prompt = passage + passage[:300]  # 700 tokens: caught up over two steps
    with LLM(dtype="float32", max_total_tokens=8192) as llm:
        long_plain = llm.generate(input_ids=long_prompt, sampling_params=GREEDY)
    with LLM(dtype="float32", max_total_tokens=8192, **drafts["self"]) as llm:
        llm.generate(input_ids=prompts, sampling_params=GREEDY)
        second = llm.generate(input_ids=prompts, sampling_params=GREEDY)
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in second)
        assert_same_greedy(prompts, second, plain)
        out = llm.generate(input_ids=long_prompt, sampling_params=GREEDY)
        assert out["output_ids"] == long_plain["output_ids"]
        llm.check_integrity()
    for o in second + [out]:
        assert o["meta_info"]["spec_accept_length"] > 3.0, o["meta_info"]
    outs, state = generate(prompts, max_total_tokens=360, max_running_requests=8,
                           **drafts["self"])
    assert state["retractions"] > 0, "the pool was meant to be too small for everything"
    assert_same_greedy(prompts, outs, plain)
    assert state["spec_accept_length"] > 3.0, state


def test_prefix_cache_hit_and_tight_limits(plain) -> None:
    """The second round hits the prefix cache (prompt and output pages of the first); a
    request whose max_new_tokens ends inside an accepted run of drafts stops exactly there;
    a stop token in the middle of a run cuts the run there."""
    prompts = copy_prompts()
    with LLM(dtype="float32", max_total_tokens=8192, **SPEC) as llm:
        first = llm.generate(input_ids=prompts, sampling_params=GREEDY)
        second = llm.generate(input_ids=prompts, sampling_params=GREEDY)
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in second)
        assert [o["output_ids"] for o in second] == [o["output_ids"] for o in first]
        assert_same_greedy(prompts, second, plain)
        want = plain[0]["output_ids"]
        for cap in (1, 2, 3, 5, 7):
            out = llm.generate(input_ids=prompts[0], sampling_params={
                "temperature": 0, "max_new_tokens": cap})
            assert out["output_ids"] == want[:cap]
            assert out["meta_info"]["finish_reason"] == {"type": "length", "length": cap}
        stop = want[6]
        cut = want[:want.index(stop) + 1]
        out = llm.generate(input_ids=prompts[0], sampling_params={
            **GREEDY, "stop_token_ids": [stop]})
        assert out["output_ids"] == cut
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        llm.check_integrity()


def test_stop_strings_cut_inside_a_verified_run(plain) -> None:
    prompts = copy_prompts()
    with LLM(dtype="float32", max_total_tokens=8192, **SPEC) as llm:
        text = llm.generate(input_ids=prompts[4], sampling_params=GREEDY)["text"]
        plain_text = llm.tokenizer.decode(plain[4]["output_ids"])
        assert text == plain_text
        words = text.split()
        stop = words[len(words) // 2]
        out = llm.generate(input_ids=prompts[4], sampling_params={**GREEDY, "stop": stop})
        assert out["text"] == text[:text.index(stop)]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_logprobs_are_the_targets_for_every_accepted_token(drafts, algorithm: str) -> None:
    prompts = copy_prompts()[:3]
    params = {**GREEDY, "max_new_tokens": 24}
    kwargs = dict(return_logprob=True, top_logprobs_num=3)
    with LLM(dtype="float32", max_total_tokens=8192) as llm:
        want = llm.generate(input_ids=prompts, sampling_params=params, **kwargs)
    spec = SPEC if algorithm == "NGRAM" else drafts["shallow"]
    with LLM(dtype="float32", max_total_tokens=8192, **spec) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params, **kwargs)
    for out, base in zip(outs, want):
        assert out["output_ids"] == base["output_ids"]
        got, expected = out["meta_info"], base["meta_info"]
        assert len(got["output_token_logprobs"]) == len(out["output_ids"])
        for (lp, tid, _), (wlp, wid, _) in zip(got["output_token_logprobs"],
                                               expected["output_token_logprobs"]):
            assert tid == wid and abs(lp - wlp) < 1e-3
        for step, wstep in zip(got["output_top_logprobs"], expected["output_top_logprobs"]):
            assert [t for _, t, _ in step] == [t for _, t, _ in wstep]
            assert all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(step, wstep))


def test_retraction_in_a_small_pool(plain) -> None:
    prompts = copy_prompts()
    outs, state = generate(prompts, max_total_tokens=360, max_running_requests=8, **SPEC)
    assert state["retractions"] > 0, "the pool was meant to be too small for everything"
    assert_same_greedy(prompts, outs, plain)


def test_requests_that_cannot_speculate_decode_alongside(plain) -> None:
    """A grammar, penalties, a seed or min_new_tokens keep a request to one token a step, in
    the same batches as speculating ones; greedy rows still equal plain decoding."""
    prompts = copy_prompts()[:3]
    schema = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    plain_params = [{**GREEDY, "json_schema": schema}, {**GREEDY, "frequency_penalty": 0.5},
                    {**GREEDY, "min_new_tokens": 2}]
    with LLM(dtype="float32", max_total_tokens=8192) as llm:
        want = llm.generate(input_ids=prompts * 2, sampling_params=plain_params + [GREEDY] * 3)
    with LLM(dtype="float32", max_total_tokens=8192, **SPEC) as llm:
        outs = llm.generate(input_ids=prompts * 2, sampling_params=plain_params + [GREEDY] * 3)
        llm.check_integrity()
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in want]
    assert all(o["meta_info"].get("spec_verify_ct") is None for o in outs[1:3])
    assert outs[0]["meta_info"]["spec_verify_ct"] > 0  # the grammar row verifies (its drafts)
    assert outs[3]["meta_info"]["spec_accept_token_num"] > 0


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_grammar_rows_verify_drafts_under_their_masks(drafts, algorithm: str) -> None:
    """A JSON-schema request copies a JSON object from its prompt: the drafts the grammar
    allows are accepted, each drafted position sampled under the mask its matcher reaches
    after the drafts before it (then rolled back). Greedy output equals plain constrained
    decoding, also for a regex and for grammar rows whose drafts it mostly refuses."""
    record = ('{"name": "Ada Lovelace", "born": 1815, "city": "London", '
              '"field": "mathematics", "known for": "the first computer program"}')
    schema = json.dumps({"type": "object", "required": ["name", "born", "city", "field"],
                         "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                                        "city": {"type": "string"},
                                        "field": {"type": "string"}}})
    prompts = [ref.prompt_ids(ref.chat_prompt(f"Repeat this JSON object exactly:\n{record}")),
               ref.prompt_ids(ref.chat_prompt("Count from 1 to 30, separated by commas.")),
               copy_prompts()[0], copy_prompts()[4]]
    params = [{**GREEDY, "max_new_tokens": 48, "json_schema": schema},
              {**GREEDY, "regex": "([0-9]+, ){5,}[0-9]+"},
              {**GREEDY, "json_schema": schema}, {**GREEDY, "regex": "[a-z ]+[.]"}]
    with LLM(dtype="float32", max_total_tokens=8192) as llm:
        want = llm.generate(input_ids=prompts, sampling_params=params)
    spec = SPEC if algorithm == "NGRAM" else drafts["self"]
    with LLM(dtype="float32", max_total_tokens=8192, **spec) as llm:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        llm.check_integrity()
    for out, base in zip(outs, want):
        assert out["output_ids"] == base["output_ids"]
        assert out["meta_info"]["finish_reason"] == base["meta_info"]["finish_reason"]
    json.loads(outs[0]["text"])
    assert outs[0]["meta_info"]["spec_accept_token_num"] > 10, outs[0]["meta_info"]


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_tensor_parallel_3_equals_plain(plain, drafts, algorithm: str) -> None:
    prompts = copy_prompts()
    spec = SPEC if algorithm == "NGRAM" else drafts["self"]
    outs, state = generate(prompts, max_total_tokens=8192, tp_size=3, **spec)
    assert_same_greedy(prompts, outs, plain)
    assert state["spec_accepted_tokens"] > 100


# Sampled output keeps its distribution: at the first two positions drafts are verified at
# (output tokens 1 and 2 of a prompt the model copies), SAMPLES requests with and without
# speculation, tokens bucketed as the plain run's 5 likeliest and the rest. Two such empirical
# distributions differ by TV ~0.02-0.05 by chance; a rule that accepted n-gram drafts outright
# would take the copied token's share at position 1 from ~0.85 to 1 (TV >= 0.15).
# Both sides run the default weights (--dtype auto: the GGUF blocks where a kernel runs
# them): the rule under test does not depend on the numerics, and dense float32 is slow here.
SAMPLES = 800
SAMPLED_TV_BOUND = 0.1


def sampled_outputs(**args) -> tuple[torch.Tensor, dict]:
    params = {"temperature": 1.0, "max_new_tokens": 3, "ignore_eos": True}
    outs, state = generate([copy_prompts()[4]] * SAMPLES, params, max_total_tokens=8192,
                           max_running_requests=8, dtype="auto", **args)
    return torch.tensor([o["output_ids"] for o in outs]), state


@pytest.fixture(scope="module")
def plain_samples() -> torch.Tensor:
    return sampled_outputs()[0]


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_sampled_output_keeps_its_distribution(plain_samples, drafts, algorithm: str) -> None:
    """NGRAM drafts are point masses; a draft model's are drawn from its own distribution q,
    which the acceptance rule divides out (the shallow draft's q is far from the target's p:
    most drafts are rejected and the token is drawn from the residual, so a rule that got q
    wrong would move the distribution)."""
    plain_ids = plain_samples
    spec_ids, state = sampled_outputs(**(SPEC if algorithm == "NGRAM" else drafts["shallow"]))
    assert state["spec_drafted_tokens"] > SAMPLES / 2
    if algorithm == "NGRAM":
        assert state["spec_accepted_tokens"] > SAMPLES / 4
    else:  # mostly rejected: the tokens come from the residual max(0, p - q), renormalised
        assert 0 < state["spec_accepted_tokens"] < state["spec_drafted_tokens"] / 2
    for position in (1, 2):
        a, b = plain_ids[:, position], spec_ids[:, position]
        top = torch.bincount(a).topk(5).indices
        buckets = [(a[:, None] == top).long(), (b[:, None] == top).long()]
        share = [torch.cat([x.sum(0), (x.sum(1) == 0).sum()[None]]).double() / SAMPLES
                 for x in buckets]
        assert float((share[0] - share[1]).abs().sum() / 2) < SAMPLED_TV_BOUND, (position, share)
    assert 0.5 < float((plain_ids[:, 1] == torch.bincount(plain_ids[:, 1]).argmax()).double()
                       .mean()) < 0.97, "the test needs a likely but uncertain copied token"


@pytest.mark.parametrize("algorithm", ["NGRAM", "STANDALONE"])
def test_abort_fuzz_with_speculation_keeps_every_page_accounted_for(tmp_path, algorithm: str
                                                                    ) -> None:
    spec = SPEC if algorithm == "NGRAM" else {
        "speculative_algorithm": "STANDALONE", "speculative_always_draft": True,
        "speculative_draft_model_path": shallow_model(tmp_path, 2)}  # dummy weights too
    aborted, state = abort_fuzz(ServerArgs(**FUZZ_ARGS, **spec))
    assert aborted > 50, f"only {aborted} aborts landed on live requests"
    assert state["spec_verified_rows"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--speculative-algorithm", "EAGLE"], "is not supported; minisgl speculates with NGRAM"),
    (["--speculative-algorithm", "STANDALONE"], "needs --speculative-draft-model-path"),
    (["--speculative-num-draft-tokens", "4"], "needs --speculative-algorithm"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"], ">= 2"),
    (["--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3",
      "--speculative-num-draft-tokens", "5"], "must be --speculative-num-steps (3) + 1"),
    (["--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "4"], "chains"),
    (["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "5",
      "--speculative-ngram-max-match-window-size", "2"], "must not exceed"),
    (["--speculative-algorithm", "NGRAM", "--speculative-draft-model-path", "x"],
     "STANDALONE"),
])
def test_bad_speculation_flags_exit_2_with_one_line(flags: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "minisgl", "serve", *flags],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_draft_model_with_another_vocabulary_exits_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "minisgl", "serve", "--load-format", "dummy",
                           "--speculative-algorithm", "STANDALONE",
                           "--speculative-draft-model-path", "qwen3-0.6b"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]  # after the start-up log lines
    assert "its vocabulary has 151936 tokens, the target's 49152" in last, proc.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_rows_linear_matches_float64(dtype: torch.dtype) -> None:
    """A verify step's 2-8 rows run the CPU kernel (layers.linear.FEW_ROWS): against float64
    math, as close as torch's own GEMM."""
    from minisgl.layers.linear import FEW_ROWS, few_rows_matmul
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(300, 577, generator=gen).to(dtype)  # odd widths: the tails too
    for rows in range(2, FEW_ROWS + 1):
        x = torch.randn(rows, 577, generator=gen).to(dtype)
        out = few_rows_matmul(x, weight)
        if out is None and dtype == torch.bfloat16 and rows < 3:
            continue  # torch's own GEMM runs these
        if out is None:
            pytest.skip("the CPU kernels are not built here")
        exact = x.double() @ weight.double().T
        torch_error = (torch.nn.functional.linear(x, weight).double() - exact).abs().max()
        ours = (out.double() - exact).abs().max()
        assert ours <= max(2 * torch_error, 1e-4), (rows, float(ours), float(torch_error))


def test_draft_governor_keeps_the_faster_kind_of_step() -> None:
    """The governor times decode steps with drafts and without (here: given step times) and
    drafts in the periods where tokens per row and second are higher with drafts."""
    from minisgl.scheduler.speculation import DraftGovernor

    def run(spec_seconds: float, gain: float, steps: int = 600) -> float:
        governor, now, drafted = DraftGovernor(), 0.0, 0
        for _ in range(steps):
            drafting = governor.drafting
            now += spec_seconds if drafting else 0.010
            drafted += drafting
            governor.observe(now, drafting, gain if drafting else None)
        return drafted / steps

    assert run(0.015, gain=3.0) > 0.9  # 200 tok/s per row with drafts vs 100 without
    assert run(0.040, gain=1.5) < 0.2  # 37 vs 100: only the short probes draft
    governor = DraftGovernor()
    governor.observe(0.0, True, 2.0)
    governor.interrupted()  # a prefill between two decode steps: that interval is not timed
    governor.observe(5.0, True, 2.0)
    assert governor.seconds[True] is None
