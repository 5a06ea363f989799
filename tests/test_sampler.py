"""Sampler tests on CPU with crafted logits (no model)."""

from __future__ import annotations

import math

import pytest
import torch

from minisgl.core import Req, SamplingParams
from minisgl.errors import InvalidRequest
from minisgl.engine.sampler import SampleOutput, Sampler, SamplingArgs, argmax

CPU = torch.device("cpu")
EOS = 5


def make_req(i: int, prompt: list[int] | None = None, seed: int | None = None,
             **params: object) -> Req:
    sampling = SamplingParams(**params)
    sampling.validate()  # as the server does (it also turns logit_bias keys into ints)
    req = Req(uid=i, rid=str(i), prompt_ids=prompt or [0], params=sampling)
    if seed is not None:
        req.generator = torch.Generator().manual_seed(seed)
    return req


def sampling_args(sampler: Sampler, reqs: list[Req], output_counts: list[int] | None = None,
            logprob_nums: list[int] | None = None) -> SamplingArgs:
    """Request i lives in token_pool row i and has produced nothing yet (unless told)."""
    lens = [len(r.prompt_ids) for r in reqs]
    counts = output_counts or [0] * len(reqs)
    return sampler.sampling_args(reqs, lens, counts, list(range(len(reqs))), lens, logprob_nums)


def sample(sampler: Sampler, logits: torch.Tensor, reqs: list[Req], **kw: object) -> SampleOutput:
    pool = torch.zeros(len(reqs), 8, dtype=torch.int32)
    for i, r in enumerate(reqs):
        pool[i, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids)
    return sampler.sample(logits, sampling_args(sampler, reqs, **kw), pool)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens.long(), minlength=vocab).float() / tokens.numel()


def seeded_sampler(vocab: int, seed: int = 0) -> Sampler:
    sampler = Sampler(vocab, CPU, [EOS])
    sampler.generator.manual_seed(seed)
    return sampler


def test_greedy_is_argmax() -> None:
    logits = torch.randn(6, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    reqs = [make_req(i, temperature=0.0) for i in range(3)]
    reqs += [make_req(i, top_k=1, temperature=1.3) for i in range(3, 6)]
    sampler = seeded_sampler(32)
    assert sampling_args(sampler, reqs).greedy_only
    out = sample(sampler, logits, reqs)
    assert out.next_tokens.dtype == torch.int32 and out.next_tokens.shape == (6,)
    assert torch.equal(out.next_tokens.long(), logits.float().argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None
    # greedy rows stay argmax in a batch that also samples
    mixed = reqs + [make_req(6, temperature=1.0)]
    logits7 = torch.cat([logits, logits[:1]])
    args = sampling_args(sampler, mixed)
    assert not args.greedy_only
    assert torch.equal(sample(sampler, logits7, mixed).next_tokens[:6].long(),
                       logits.float().argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 37, 49152, 49155])
def test_argmax_matches_torch(dtype: torch.dtype, vocab: int) -> None:
    """The sampler's argmax (the CPU kernel where it builds) is torch's: the first index of the
    largest value, ties, rows of -inf and rows holding NaN included."""
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randn(2, 9, vocab, generator=gen).to(dtype)
    x[0, 0] = float("-inf")
    x[0, 1, vocab // 2:] = 1e4  # a tie over half the row: its first index wins
    x[0, 2, vocab - 1] = float("inf")
    x[0, 3, vocab // 3] = float("nan")
    x[0, 4, ::2] = float("nan")
    x[1] = x[1].round()  # coarse values: many ties at the top
    assert torch.equal(argmax(x), x.argmax(-1))
    assert torch.equal(argmax(x[:, 0]), x[:, 0].argmax(-1))  # [rows, vocab]
    assert argmax(x[:0, 0]).shape == (0,)


# 4000 draws: a frequency's standard deviation is at most sqrt(0.25 / 4000) ~ 0.008, so a 0.03
# tolerance is ~4 sigma; with fixed seeds the tests are deterministic anyway.
N, TOL = 4000, 0.03


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_reshapes_distribution(temperature: float) -> None:
    p = torch.tensor([0.5, 0.3, 0.2])
    reqs = [make_req(i, temperature=temperature) for i in range(N)]
    out = sample(seeded_sampler(3), p.log().expand(N, 3), reqs)
    expected = p ** (1 / temperature)
    expected /= expected.sum()  # 0.5: [.66 .24 .11]; 2.0: [.42 .32 .26]
    assert torch.allclose(frequencies(out.next_tokens, 3), expected, atol=TOL)


def test_top_k_stays_in_top_k() -> None:
    logits = torch.randn(10, generator=torch.Generator().manual_seed(3)).expand(N, 10)
    reqs = [make_req(i, temperature=2.0, top_k=3) for i in range(N)]
    out = sample(seeded_sampler(10), logits, reqs)
    top3 = set(logits[0].topk(3).indices.tolist())
    assert set(out.next_tokens.tolist()) == top3  # all three drawn, nothing else
    expected = torch.softmax(logits[0] / 2.0, -1).masked_fill(
        ~torch.isin(torch.arange(10), torch.tensor(sorted(top3))), 0)
    assert torch.allclose(frequencies(out.next_tokens, 10), expected / expected.sum(), atol=TOL)


@pytest.mark.parametrize("top_p, kept", [(0.35, [0]), (0.65, [0, 1]), (0.75, [0, 1, 2]),
                                         (1.0, [0, 1, 2, 3])])
def test_top_p_keeps_smallest_covering_set(top_p: float, kept: list[int]) -> None:
    p = torch.tensor([0.4, 0.3, 0.2, 0.1])
    reqs = [make_req(i, top_p=top_p) for i in range(N)]
    out = sample(seeded_sampler(4), p.log().expand(N, 4), reqs)
    assert sorted(set(out.next_tokens.tolist())) == kept
    expected = torch.zeros(4)
    expected[kept] = p[kept] / p[kept].sum()
    assert torch.allclose(frequencies(out.next_tokens, 4), expected, atol=TOL)


@pytest.mark.parametrize("min_p, kept", [(0.2, [1, 2, 3]), (0.5, [1, 3]), (1.0, [1])])
def test_min_p_drops_low_tokens(min_p: float, kept: list[int]) -> None:
    p = torch.tensor([0.05, 0.5, 0.15, 0.3])  # thresholds: 0.1, 0.25, 0.5
    reqs = [make_req(i, min_p=min_p) for i in range(N)]
    out = sample(seeded_sampler(4), p.log().expand(N, 4), reqs)
    assert sorted(set(out.next_tokens.tolist())) == kept


def test_penalties_amounts() -> None:
    # prompt [1, 2], generated [2, 3, 3]; position 5 holds a stale token 4 that must be ignored.
    history = [1, 2, 2, 3, 3, 4]
    base = torch.tensor([1.0, 2.0, -1.0, 0.5, 3.0, -2.0])
    reqs = [make_req(0, [1, 2], repetition_penalty=2.0),
            make_req(1, [1, 2], frequency_penalty=0.5),
            make_req(2, [1, 2], presence_penalty=0.25),
            make_req(3, [1, 2]),
            make_req(4, [1, 2], repetition_penalty=0.5, frequency_penalty=-1.0,
                     presence_penalty=1.0)]
    pool = torch.zeros(7, 8, dtype=torch.int32)
    table_rows = [6, 2, 4, 0, 3]  # history scattered over token_pool rows
    for row in table_rows:
        pool[row, :6] = torch.tensor(history)
    sampler = seeded_sampler(6)
    args = sampler.sampling_args(reqs, [2] * 5, [3] * 5, table_rows, [5] * 5)
    logits = base.expand(5, 6)
    got = sampler._adjust_logits(logits.float(), args, pool)
    expected = base.expand(5, 6).clone()
    expected[0] = torch.tensor([1.0, 1.0, -2.0, 0.25, 3.0, -2.0])  # /2 if > 0, *2 if < 0
    expected[1] = base - 0.5 * torch.tensor([0, 0, 1, 2, 0, 0])  # counts over generated only
    expected[2] = base - 0.25 * torch.tensor([0, 0, 1, 1, 0, 0])  # presence in generated only
    expected[4] = torch.tensor([1.0, 4.0, -0.5, 1.0, 3.0, -2.0]) \
        + torch.tensor([0, 0, 1, 2, 0, 0]) - torch.tensor([0, 0, 1, 1, 0, 0])
    assert torch.allclose(got, expected)
    assert torch.equal(logits, base.expand(5, 6))  # input untouched
    # and through sampling: frequency penalty 2 makes token 3 (logit 0.5 - 4) lose to token 1
    greedy = [make_req(0, [1, 2], temperature=0.0, frequency_penalty=2.0,
                       repetition_penalty=1.0)]
    args = sampler.sampling_args(greedy, [2], [3], [6], [5])
    spiky = torch.tensor([[0.0, 1.0, 0.0, 4.0, 0.0, 0.0]])
    assert sampler.sample(spiky, args, pool).next_tokens.tolist() == [1]


def test_min_new_tokens_masks_eos_and_stop_ids() -> None:
    logits = torch.tensor([0.0, 1.0, 0.0, 0.0, 9.0, 10.0]).expand(4, 6)  # 5 = EOS, 4 = stop id
    reqs = [make_req(0, temperature=0.0, min_new_tokens=2, stop_token_ids=[4]),
            make_req(1, temperature=0.0, min_new_tokens=2, stop_token_ids=[4]),
            make_req(2, temperature=0.0, min_new_tokens=2, stop_token_ids=[4], ignore_eos=True),
            make_req(3, temperature=1.0, min_new_tokens=2, stop_token_ids=[4])]
    out = sample(seeded_sampler(6), logits, reqs, output_counts=[1, 2, 0, 0])
    assert out.next_tokens[:3].tolist() == [1, 5, 1]
    many = [make_req(i, temperature=1.0, min_new_tokens=1, stop_token_ids=[4]) for i in range(N)]
    out = sample(seeded_sampler(6), logits[:1].expand(N, 6), many)
    assert not torch.isin(out.next_tokens, torch.tensor([4, 5])).any()


MIXED = [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.3, top_k=4),
         dict(top_p=0.8), dict(min_p=0.1, temperature=0.9), dict(top_k=6, top_p=0.9, min_p=0.05),
         dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
         dict(temperature=0.8, logit_bias={"3": 2.5, 7: -1.0})]


def test_mixed_batch_equals_rows_alone() -> None:
    vocab, steps = 16, 20
    gen = torch.Generator().manual_seed(7)
    batch = [make_req(i, [i, 3, 3], seed=100 + i, **kw) for i, kw in enumerate(MIXED)]
    alone = [make_req(i, [i, 3, 3], seed=100 + i, **kw) for i, kw in enumerate(MIXED)]
    sampler = seeded_sampler(vocab)
    for _ in range(steps):
        logits = torch.randn(len(MIXED), vocab, generator=gen) * 2
        together = sample(sampler, logits, batch).next_tokens
        single = [sample(sampler, logits[i:i + 1], [r]).next_tokens.item()
                  for i, r in enumerate(alone)]
        assert together.tolist() == single


def test_same_seed_same_tokens_regardless_of_companions() -> None:
    vocab, steps = 50, 30
    logits_seq = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(9))

    def run(companions: list[Req], position: int, sampler_seed: int) -> list[int]:
        target = make_req(99, seed=1234, temperature=1.5, top_p=0.95)
        reqs = companions[:position] + [target] + companions[position:]
        sampler = seeded_sampler(vocab, sampler_seed)
        tokens = []
        for step in range(steps):
            logits = torch.randn(len(reqs), vocab)
            logits[position] = logits_seq[step]
            tokens.append(sample(sampler, logits, reqs).next_tokens[position].item())
        return tokens

    first = run([], 0, 0)
    assert len(set(first)) > 5  # it really samples
    assert run([make_req(i, temperature=1.0) for i in range(3)], 1, 1) == first
    assert run([make_req(i, seed=i, top_k=5) for i in range(5)], 4, 2) == first


def test_logprobs_are_raw_log_softmax() -> None:
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(5)).to(torch.float16)
    reqs = [make_req(0, temperature=0.0), make_req(1, temperature=0.5, repetition_penalty=1.5),
            make_req(2, temperature=0.0, seed=3)]
    sampler = seeded_sampler(12)
    out = sample(sampler, logits, reqs, logprob_nums=[-1, 0, 3])
    expected = torch.log_softmax(logits.float(), -1)
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, expected.gather(1, out.next_tokens.long()[:, None])[:, 0])
    assert out.top_logprobs is not None
    values, ids = out.top_logprobs
    assert values.shape == ids.shape == (3, 3) and ids.dtype == torch.int32
    assert torch.allclose(values, expected.topk(3).values)
    assert torch.equal(ids.long(), expected.topk(3).indices)
    only_chosen = sample(sampler, logits, reqs, logprob_nums=[0, -1, -1])
    assert only_chosen.logprobs is not None and only_chosen.top_logprobs is None
    assert sample(sampler, logits, reqs, logprob_nums=[-1, -1, -1]).logprobs is None
    assert math.isclose(out.logprobs[0].item(), expected[0].max().item(), rel_tol=1e-6)


def test_logit_bias_adds_to_the_chosen_logits() -> None:
    logits = torch.tensor([[0.0, 1.0, 3.0, 2.0, 0.5, -1.0]])
    sampler = seeded_sampler(6)
    forced = make_req(0, temperature=0.0, logit_bias={"4": 100})
    banned = make_req(1, temperature=0.0, logit_bias={2: -100.0})
    plain = make_req(2, temperature=0.0)
    out = sample(sampler, logits.expand(3, 6), [forced, banned, plain], logprob_nums=[0, 0, 0])
    assert out.next_tokens.tolist() == [4, 3, 2]  # forced; the runner-up; untouched
    raw = torch.log_softmax(logits, -1)[0]
    assert out.logprobs is not None  # logprobs stay those of the raw logits
    assert torch.allclose(out.logprobs, raw[[4, 3, 2]])
    # sampled rows draw from softmax(logits + bias)
    bias = {1: 1.5, 5: 2.0}
    many = [make_req(i, temperature=1.0, logit_bias=bias) for i in range(N)]
    tokens = sample(seeded_sampler(6, 1), logits.expand(N, 6), many).next_tokens
    shifted = logits[0] + torch.tensor([0.0, 1.5, 0.0, 0.0, 0.0, 2.0])
    assert (frequencies(tokens, 6) - torch.softmax(shifted, -1)).abs().max() < TOL


@pytest.mark.parametrize("bias", [[1, 2], {"x": 1.0}, {"-3": 1.0}, {"1": 101}, {"1": "5"},
                                  {"1": True}, {"1": float("nan")}])
def test_logit_bias_validation(bias: object) -> None:
    with pytest.raises(InvalidRequest, match="logit_bias"):
        SamplingParams.from_dict({"logit_bias": bias})


# Each row: its parameters and what a valid token is, given the row's raw logits. Row logits put
# EOS (5) on top and token 2 (in every prompt) next, so masks and boosts show.
def _argmax(row: torch.Tensor) -> set[int]:
    return {int(row.argmax())}


def _any(row: torch.Tensor) -> set[int]:
    return set(range(len(row)))


EXTREMES: list[tuple[dict, object]] = [
    (dict(temperature=1e-320), _argmax),  # below SAMPLING_EPS: greedy
    (dict(temperature=1e-39), _argmax),
    (dict(temperature=5e-7), _argmax),
    (dict(top_p=5e-324), _argmax),  # below SAMPLING_EPS: the top token only
    (dict(top_p=1e-7, temperature=2.0), _argmax),
    (dict(min_p=1.0), _argmax),
    (dict(top_k=1, temperature=1e300), _argmax),
    (dict(temperature=1e-6), _any),  # at the epsilon: sampled, no overflow
    (dict(temperature=1e300), _any),  # near-uniform, no inf / -inf = NaN
    (dict(temperature=1e300, min_new_tokens=3, max_new_tokens=8), lambda r: _any(r) - {EOS}),
    (dict(top_k=10**12, min_p=1e-320), _any),
    (dict(repetition_penalty=1e-300), lambda r: {2}),  # the seen token's logit is boosted
    (dict(repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=-2.0), _any),
    (dict(logit_bias={"3": 100, "5": -100}, temperature=1e-5), lambda r: {3}),
    (dict(logit_bias={"3": -100}, temperature=1e-320), _argmax),
    (dict(min_new_tokens=2, max_new_tokens=2, temperature=1e-320), lambda r: {2}),
]


@pytest.mark.parametrize("seeded", [False, True])
def test_extreme_parameters_give_greedy_or_a_valid_sample(seeded: bool) -> None:
    """The extremes run in one batch through the real sampler, unseeded (the shared
    generator) and seeded: each row's token is the greedy one or a valid sample, and the
    logprobs are finite."""
    vocab, steps = 12, 25
    gen = torch.Generator().manual_seed(21)
    sampler = seeded_sampler(vocab)
    for step in range(steps):
        reqs = [make_req(i, [2, 7], seed=(1000 + i + step) if seeded else None, **params)
                for i, (params, _) in enumerate(EXTREMES)]
        logits = torch.randn(len(reqs), vocab, generator=gen) * 3
        logits[:, EOS] = logits.amax(-1) + 2.0
        logits[:, 2] = logits[:, EOS] - 1.0
        logits[:, 7] = -1.0  # in the prompt too, but negative: a penalty lowers it
        out = sample(sampler, logits.to(torch.bfloat16), reqs,
                     logprob_nums=[2] * len(reqs))
        assert out.logprobs is not None and torch.isfinite(out.logprobs).all()
        for i, ((params, valid), token) in enumerate(zip(EXTREMES, out.next_tokens.tolist())):
            row = logits[i].to(torch.bfloat16).float()
            assert token in valid(row), (params, token, row)
    assert sampling_args(sampler, [make_req(0, temperature=1e-320)]).greedy_only


@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "frequency_penalty",
                                  "presence_penalty", "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_numbers_are_refused(name: str, value: float) -> None:
    with pytest.raises(InvalidRequest, match=name):
        SamplingParams.from_dict({name: value})
