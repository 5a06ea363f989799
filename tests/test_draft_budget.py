"""engine.draft_budget: the step-cost fit, the acceptance estimates and the cut of n-gram drafts
to those worth a verify step's place (pure functions; the served path is test_speculation's)."""

from __future__ import annotations

import pytest

from minisgl.engine.draft_budget import AcceptRates, StepCost, worth_verifying


def test_step_cost_fits_a_linear_cost() -> None:
    cost = StepCost()
    assert cost.fit() is None
    for _ in range(10):
        cost.observe(8, 0.020)
    assert cost.fit() is None  # one token count: no slope to fit
    for _ in range(10):
        cost.observe(8, 0.020)
        cost.observe(32, 0.044)
    t0, per_token = cost.fit()  # type: ignore[misc]
    assert t0 == pytest.approx(0.012) and per_token == pytest.approx(0.001)


def test_acceptance_by_match_length_and_depth() -> None:
    rates = AcceptRates(depth=4)
    assert rates.gains(1, 3) == pytest.approx([0.5, 0.4, 0.32])  # priors
    for _ in range(200):
        rates.observe(match=4, drafted=3, accepted=3)  # long matches: copied text
        rates.observe(match=1, drafted=3, accepted=0)  # one-token matches: wrong
    long, short = rates.gains(7, 3), rates.gains(1, 3)  # 4 tokens and more share a chance
    assert long[0] > 0.99 and long[2] > 0.99
    assert short[0] < 0.01
    assert rates.gains(2, 1) == pytest.approx([0.5])  # not seen yet
    before = short[0]
    rates.skipped([1, 1, 1])  # not verified: drifts back toward the prior, once a step
    once = rates.gains(1, 1)[0]
    assert before < once < 0.5 and once - before == pytest.approx(
        AcceptRates.DRIFT * (0.5 - before))
    for _ in range(300):
        rates.skipped([1])
    assert rates.gains(1, 1)[0] > 0.49  # so it is tried again


def test_worth_verifying_weighs_chance_against_cost() -> None:
    drafts = [[1, 2, 3]] * 8
    sure, unlikely = [[1.0, 1.0, 1.0]] * 8, [[0.3, 0.09, 0.027]] * 8
    assert worth_verifying(drafts, sure, (0.010, 0.001)) == drafts
    assert worth_verifying(drafts, unlikely, (0.010, 0.001)) == [[]] * 8
    # free tokens: every draft with a chance
    assert worth_verifying(drafts, unlikely, (0.010, 0.0)) == drafts
    # the same chances: a lone row (a whole step per token) verifies all three, 8 rows one each
    fair = [0.5, 0.4, 0.32]
    assert worth_verifying([[1, 2, 3]], [fair], (0.010, 0.001)) == [[1, 2, 3]]
    assert worth_verifying(drafts, [fair] * 8, (0.010, 0.001)) == [[1]] * 8
    # the best drafts first, a row's in order; rows without drafts still forward a token
    mixed = worth_verifying([[1, 2, 3], [4, 5, 6]] + [[]] * 14,
                            [[0.9, 0.8, 0.7], [0.5, 0.2, 0.1]] + [[]] * 14, (0.010, 0.001))
    assert mixed == [[1, 2, 3], []] + [[]] * 14
