"""Speculative decoding's parts (issue 31, first part): n-gram drafts and the verification of
drafts, greedy and sampled. The sampled rule must leave the target's distribution unchanged:
checked on 200,000 rows at once, total variation distance within TV_BOUND (its sampling noise
is ~0.003 with 5 outcomes; a rule that accepted point-mass drafts outright would be off by
~0.5)."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.engine.acceptance import accept_greedy, accept_sampled
from minisgl.engine.ngram import NgramIndex

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
