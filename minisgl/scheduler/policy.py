"""The order of the waiting queue: priority first (with --enable-priority-scheduling), then the
schedule policy, and which running request a more urgent one may preempt.

Policies (`--schedule-policy`): fcfs (arrival; a retracted request goes first again), lpm
(longest cached prefix first, with in-batch prefix sharing: see scheduler.prefill), lof (longest
output first: most max_new_tokens), random.
"""

from __future__ import annotations

import random
from typing import Callable, Iterable

from minisgl.core import Req

POLICIES = ("fcfs", "lpm", "lof", "random")


class WaitingOrder:
    def __init__(self, policy: str, priorities: bool = False, low_values_first: bool = False,
                 preemption_threshold: int = 10, seed: int = 0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r} ({', '.join(POLICIES)})")
        self.policy, self.priorities = policy, priorities
        self.low_values_first = low_values_first
        self.preemption_threshold = preemption_threshold
        self._rng = random.Random(seed)

    @property
    def shares_in_batch(self) -> bool:
        return self.policy == "lpm"

    def urgency(self, priority: int) -> int:
        """Higher is served first; 0 for everyone without priority scheduling."""
        if not self.priorities:
            return 0
        return -priority if self.low_values_first else priority

    def order(self, waiting: Iterable[Req], cached_len: Callable[[Req], int]) -> list[Req]:
        reqs = list(waiting)
        if len(reqs) < 2:
            return reqs
        if self.policy == "lpm":
            lengths = {r: cached_len(r) for r in reqs}
            reqs.sort(key=lambda r: -lengths[r])
        elif self.policy == "lof":
            reqs.sort(key=lambda r: -(r.params.max_new_tokens or 0))
        elif self.policy == "random":
            self._rng.shuffle(reqs)
        if self.priorities:  # NOTE: a stable sort: the policy orders requests of equal priority
            reqs.sort(key=lambda r: -self.urgency(r.priority))
        return reqs

    def preemption_victim(self, waiting: Iterable[Req], running: Iterable[Req]) -> Req | None:
        """The running request the most urgent waiting one may preempt: the least urgent one
        whose urgency is at least the threshold below it (the newest admitted among equals),
        or None (also without priority scheduling)."""
        if not self.priorities:
            return None
        most_urgent = max((self.urgency(r.priority) for r in waiting), default=None)
        if most_urgent is None:
            return None
        floor = most_urgent - self.preemption_threshold
        candidates = [r for r in running if self.urgency(r.priority) <= floor]
        if not candidates:
            return None
        return min(candidates, key=lambda r: (self.urgency(r.priority), -r.admitted_at))

    def displaced(self, arrivals: list[int], waiting: Iterable[Req], count: int
                  ) -> list[Req] | None:
        """With the waiting queue full: `count` waiting requests, each less urgent than an
        arrival (`arrivals`: their priorities), that may be dropped to make room; None if
        there are not enough (the arrivals are refused instead)."""
        if not self.priorities:
            return None
        pool = sorted(waiting, key=lambda r: (self.urgency(r.priority), -r.uid))
        chosen = []
        for urgency in sorted(map(self.urgency, arrivals), reverse=True)[:count]:
            if not pool or self.urgency(pool[0].priority) >= urgency:
                return None
            chosen.append(pool.pop(0))
        return chosen if len(chosen) == count else None
