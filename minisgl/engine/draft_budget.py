"""Which n-gram drafts a CPU verify step forwards: those expected to pay for their place.

On CPU a step's time grows with the tokens it forwards (past a few rows the linears are
compute-bound: BENCHMARKS.md, "Speculative decoding"), so a draft is worth forwarding only if
the chance that it is accepted beats what its token costs. `StepCost` fits a decode or verify
step's seconds as t0 + c * tokens to the steps that ran; `AcceptRates` estimates each draft's
chance of being accepted; `worth_verifying` keeps the drafts, best first, while each one raises
the step's expected tokens per second. `DraftBudget` is what engine.speculation holds of it.
"""

from __future__ import annotations

from collections.abc import Iterable


class StepCost:
    """Least squares of step seconds on forwarded tokens, weighting older steps down
    geometrically (the context grows, other work comes and goes)."""

    DECAY = 0.97
    MIN_STEPS = 6.0  # weighted steps before the fit is used

    def __init__(self) -> None:
        self.weight = self.tokens = self.seconds = self.tokens_sq = self.cross = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.DECAY
        self.weight = d * self.weight + 1.0
        self.tokens = d * self.tokens + tokens
        self.seconds = d * self.seconds + seconds
        self.tokens_sq = d * self.tokens_sq + tokens * tokens
        self.cross = d * self.cross + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(t0, c), or None until steps of different token counts ran."""
        w = self.weight
        spread = w * self.tokens_sq - self.tokens * self.tokens
        if w < self.MIN_STEPS or spread <= 0.5 * w * w:  # NOTE: token counts' variance < 0.5
            return None
        per_token = max(0.0, (w * self.cross - self.tokens * self.seconds) / spread)
        return max(0.0, (self.seconds - per_token * self.tokens) / w), per_token


class AcceptRates:
    """How likely n-gram drafts are accepted, learnt over all rows. A draft continuing a longer
    matched suffix is likelier right, and agreement comes in runs (a copied passage is copied
    on): so a draft's chance is the chance of a first draft at its match length (1, 2, 3, 4 or
    more tokens) times, for each draft after the first, the chance at that depth given the one
    before was accepted."""

    EMA = 0.05  # per verified row
    DRIFT = 0.02  # per step: a chance below what drafts need is tried again every ~100 steps
    FIRST, DEEPER = 0.5, 0.8  # before anything was seen
    LONGEST_MATCH = 4  # match lengths from here on share one chance

    def __init__(self, depth: int) -> None:
        self.first = [self.FIRST] * self.LONGEST_MATCH  # [n - 1]: a first draft after n matched
        self.deeper = [self.DEEPER] * max(0, depth - 1)  # [i]: draft i + 2 given i + 1

    def _bucket(self, match: int) -> int:
        return min(max(match, 1), self.LONGEST_MATCH) - 1

    def skipped(self, matches: Iterable[int]) -> None:
        """A step forwarded no drafts at these match lengths: their chances drift back toward
        the prior, once a step (they are learnt only from drafts that are verified)."""
        for b in {self._bucket(match) for match in matches}:
            self.first[b] += self.DRIFT * (self.FIRST - self.first[b])

    def observe(self, match: int, drafted: int, accepted: int) -> None:
        """A verify step accepted `accepted` of a row's `drafted` drafts, matched on `match`
        tokens."""
        b = self._bucket(match)
        self.first[b] += self.EMA * ((accepted > 0) - self.first[b])
        for depth in range(1, min(drafted, accepted + 1)):  # drafts tried after an accepted one
            self.deeper[depth - 1] += self.EMA * ((accepted > depth) - self.deeper[depth - 1])

    def gains(self, match: int, drafts: int) -> list[float]:
        """The chance that each of a row's `drafts` drafts, matched on `match` tokens, is
        accepted."""
        chance, out = self.first[self._bucket(match)], []
        for i in range(drafts):
            if i:
                chance *= self.deeper[min(i, len(self.deeper)) - 1]
            out.append(chance)
        return out


def worth_verifying(drafts: list[list[int]], gains: list[list[float]], cost: tuple[float, float]
                    ) -> list[list[int]]:
    """Each row's drafts cut to those worth forwarding. `gains`: each draft's chance of being
    accepted (AcceptRates.gains; non-increasing along a row; rows without drafts forward one
    token all the same); `cost`: StepCost.fit()."""
    t0, per_token = cost
    candidates = sorted(((g, i, row) for row, row_gains in enumerate(gains)
                         for i, g in enumerate(row_gains[:len(drafts[row])])),
                        key=lambda c: (-c[0], c[1]))
    tokens = expected = float(len(drafts))  # every row forwards its last token, emits one
    keep = [0] * len(drafts)
    for gain, i, row in candidates:  # a row's i-th draft after its (i-1)-th
        # NOTE: adding it raises expected / (t0 + c * tokens) iff gain beats this bound
        if gain * (t0 + per_token * tokens) <= expected * per_token:
            break
        keep[row] = i + 1
        tokens += 1
        expected += gain
    return [d[:k] for d, k in zip(drafts, keep)]


class DraftBudget:
    """The step cost and the acceptance chances one speculating CPU engine learns, and the cut
    they make of each verify step's n-gram drafts."""

    def __init__(self, depth: int) -> None:
        self.cost, self.rates = StepCost(), AcceptRates(depth)

    def cut(self, matched: list[tuple[list[int], int]]) -> list[list[int]]:
        """Each row's (drafts, match length) -> the drafts worth forwarding (all of them until
        the cost is known)."""
        drafts = [d for d, _ in matched]
        fit = self.cost.fit()
        if fit is None:
            return drafts
        kept = worth_verifying(drafts, [self.rates.gains(n, len(d)) for d, n in matched], fit)
        self.rates.skipped(n for (made, n), cut in zip(matched, kept) if made and not cut)
        return kept
