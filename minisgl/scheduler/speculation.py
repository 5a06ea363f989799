"""Speculative decoding on the host side: which requests speculate, the KV slots a verify step
reserves, and giving back what its drafts did not use.

A verify step is built before the step in flight says how many drafts it accepted, so a
speculating request's kv_len and device_len are upper bounds: each verify step reserves KV
slots at [kv_len, kv_len + 1 + drafts) and advances both by that much. As long as the true
token count never exceeds device_len, the slots any step writes (from the true last token on)
are reserved. When the step's result arrives the surplus (drafts it reserved but did not
emit) comes off both again, and whole pages past the new kv_len go back to the pool: the
step in flight after it writes below that bound.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from minisgl.core import Req
from minisgl.engine import ForwardOutput
from minisgl.engine.speculation import SpecConfig
from minisgl.scheduler.batch_builder import ScheduledBatch
from minisgl.scheduler.memory import CacheManager, TableManager
from minisgl.scheduler.stats import SchedulerStats


@dataclass(slots=True)
class SpecTally:
    """A speculating request's state (`Req.spec`): its verify steps, the drafts they verified
    and the drafts accepted, reported in its meta_info."""

    verify_ct: int = 0
    drafted: int = 0
    accepted: int = 0


def speculates(req: Req, grammar_drafts: bool) -> bool:
    """Whether a request may verify drafts: its token at each position must depend on nothing
    a draft changes but the tokens before it. Penalties, logit_bias and min_new_tokens shape
    each position's logits from the output so far (per step, not per drafted position); a
    sampling_seed promises the same output as without speculation. A grammar's masks for the
    drafted positions come from its matcher walking the drafts on the engine thread, between
    the scheduler's mask fill and its processing of the step (`grammar_drafts`: the engine
    runs steps in order, the CPU engine thread; a CUDA launch does not wait for masks). Other
    requests decode one token a step."""
    params = req.params
    return not (params.needs_penalties or params.logit_bias or params.min_new_tokens
                or (req.matcher is not None and not grammar_drafts)
                or (params.sampling_seed is not None and not params.is_greedy))


def verify_counts(reqs: list[Req], drafts_per_row: int) -> list[int]:
    """Tokens to reserve for each request in a verify step: its last token and its drafts,
    never past what it may still produce."""
    return [max(1, min(1 + drafts_per_row, r.remain_len)) if r.spec is not None else 1
            for r in reqs]


def release_surplus(req: Req, surplus: int, cache: CacheManager, table: TableManager) -> None:
    """A verify step emitted `surplus` tokens fewer than it reserved for `req`: lower its bounds
    and free the whole pages past the new kv_len."""
    if surplus <= 0:
        return
    ps = cache.page_size
    old = req.kv_len
    req.kv_len -= surplus
    req.device_len -= surplus
    kept = -(-req.kv_len // ps) * ps
    locations = table.locations(req.table_idx, old)
    cache.free_locations(locations[kept:])
    req.tail_loc = int(locations[req.kv_len - 1]) if req.kv_len else -1


class HostSpeculation:
    """Speculative decoding as the scheduler meets it, in one place: which requests speculate
    (`admit`), the KV slots a verify step reserves (`verify_counts`), when a step must wait for
    a verify step's result (`waits_for_verify`, `rides_mixed`), and after each step the slots
    its drafts did not use (`release_surplus`) and the governor's timing (`after_step`). The
    scheduler holds one only with --speculative-algorithm; a request that does not speculate
    (`req.spec` None) never reaches it."""

    def __init__(self, config: SpecConfig, grammar_drafts: bool, governed: bool,
                 cache: CacheManager, table: TableManager, stats: SchedulerStats) -> None:
        self.config, self.grammar_drafts = config, grammar_drafts
        self.governor = DraftGovernor() if governed else None
        self.cache, self.table, self.stats = cache, table, stats

    def admit(self, req: Req) -> None:
        if speculates(req, self.grammar_drafts):
            req.spec = SpecTally()

    def verify_counts(self, reqs: list[Req]) -> list[int] | None:
        """KV slots each request reserves in a verify step; None: a plain decode step (no
        request speculates, or drafting is off for now)."""
        if not any(r.spec is not None for r in reqs) or (
                self.governor is not None and not self.governor.drafting):
            return None
        drafts = self.config.drafts_per_row(len(reqs))
        return verify_counts(reqs, drafts) if drafts else None

    @staticmethod
    def waits_for_verify(reqs: list[Req], verify_in_flight: bool) -> bool:
        """Whether a plain decode step of `reqs` must wait for the verify step in flight: a
        speculating request's lengths are upper bounds until it is processed."""
        return verify_in_flight and any(r.spec is not None for r in reqs)

    @staticmethod
    def rides_mixed(req: Req, verify_in_flight: bool) -> bool:
        """Whether a running request may decode one token in a mixed prefill batch now (a
        speculating one: once no verify step is in flight, its lengths exact)."""
        return req.spec is None or not verify_in_flight

    def release_surplus(self, req: Req, surplus: int) -> None:
        release_surplus(req, surplus, self.cache, self.table)

    def after_step(self, done: ScheduledBatch, out: ForwardOutput) -> None:
        """Count a verify step's drafts; time the decode step for the governor."""
        gain = self.stats.count_verify(done, out) if out.counts is not None else None
        if self.governor is None:
            return
        if done.fwd.verify is None and not done.fwd.batch.is_decode:
            self.governor.interrupted()
            return
        self.governor.observe(time.perf_counter(), done.fwd.verify is not None, gain)


class DraftGovernor:
    """Turns drafting off while it does not pay, by measurement: the wall time of decode steps
    with drafts (and the tokens a speculating row gains per step) against steps without. A
    period of drafting ends with a short probe without; the faster rate of tokens per row and
    second wins the next period; a period without drafting ends with a short probe with.
    On CUDA a verify step waits for the step before it and runs without a graph: for a small
    model that costs more than the drafts save, which this finds out."""

    SPEC_STEPS, PLAIN_STEPS, PROBE_STEPS = 64, 64, 6
    EMA = 0.2

    def __init__(self) -> None:
        self.phase, self.left = "spec", 2 * self.PROBE_STEPS
        self.seconds: dict[bool, float | None] = {True: None, False: None}  # drafting -> step
        self.gain = 1.0  # tokens a speculating row emits per verify step
        self._last: tuple[float, bool] | None = None  # the previous decode step: when, which

    @property
    def drafting(self) -> bool:
        return self.phase in ("spec", "probe_spec")

    def observe(self, now: float, drafting: bool, gain: float | None) -> None:
        """A decode step's result was processed at `now`; `gain`: its speculating rows' mean
        emitted tokens (None: it had none)."""
        last, self._last = self._last, (now, drafting)
        if last is not None and last[1] == drafting:  # NOTE: the first step of a kind is mixed
            seconds = now - last[0]
            known = self.seconds[drafting]
            self.seconds[drafting] = seconds if known is None else (
                known + self.EMA * (seconds - known))
        if drafting and gain is not None:
            self.gain += self.EMA * (gain - self.gain)
        self.left -= 1
        if self.left <= 0:
            self._next_phase()

    def interrupted(self) -> None:
        """Another kind of step (a prefill) ran between decode steps: no interval to time."""
        self._last = None

    def _next_phase(self) -> None:
        if self.phase == "spec":
            self.phase, self.left = "probe_plain", self.PROBE_STEPS
        elif self.phase == "plain":
            self.phase, self.left = "probe_spec", self.PROBE_STEPS
        elif self._drafting_pays():
            self.phase, self.left = "spec", self.SPEC_STEPS
        else:
            self.phase, self.left = "plain", self.PLAIN_STEPS

    def _drafting_pays(self) -> bool:
        spec, plain = self.seconds[True], self.seconds[False]
        if spec is None or plain is None:
            return True
        return self.gain / spec >= 1.0 / plain
