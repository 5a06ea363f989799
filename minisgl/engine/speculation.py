"""Speculative decoding on the engine side (`--speculative-algorithm NGRAM` / `STANDALONE`).

The data flow that keeps the overlap loop: when the host builds decode step N+1, step N (in
flight) has not said how many of its drafts were accepted, so the host cannot know where each
speculating request's next token sits. It does not need to. It reserves KV slots for the worst
case (every draft accepted, `VerifyRows`) and leaves the layout to the engine, which runs the
steps in launch order and so knows N's outcome when N+1 starts: `Speculator.resolve` reads each
row's committed length (kept on the device, advanced by every step), drafts (n-grams of the
row's prompt and output, or a draft model: engine.draft_model), writes the drafts into the
token pool and lays out the forward: the row's last token plus its drafts, at their true
positions. After the forward `Speculator.verify` accepts the longest agreeing prefix of drafts
plus one token of the target's (a grammar row's drafted positions masked by its matcher),
writes them into the token pool and advances the committed lengths.

On CPU resolving runs on the engine thread, after N's forward, while the scheduler processes
N's results: nothing waits. A CUDA launch runs on the scheduler's thread, so there the
scheduler settles N before launching a verify step (the one sync; see scheduler.Scheduler).
There verify steps replay CUDA graphs (engine.graph): every row forwards the same number of
tokens, its last token and drafts, then fillers (`pad_for_graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from minisgl.core import span_indices
from minisgl.engine.config import EngineConfig
from minisgl.engine.acceptance import accept_greedy, accept_sampled
from minisgl.engine.draft_budget import DraftBudget
from minisgl.engine.draft_model import DraftModel
from minisgl.engine.forward import ForwardInput, ForwardOutput, to_host
from minisgl.engine.ngram import NgramIndex
from minisgl.engine.sampler import SampleOutput, Sampler, argmax, to_device, unpack_bitmask
from minisgl.kvcache.state_pool import StatePool
from minisgl.layers.embedding import INT8_MAX_ROWS

MAX_COOLDOWN = 16  # steps a row drafts nothing after drafts it kept rejecting (doubling)
# Tokens a verify step may forward before drafts stop paying: beyond them the step's cost
# grows with its tokens (measured: BENCHMARKS.md, "Speculative decoding"). On CPU also the rows
# the LM head's 8-bit copy takes, as it takes a decode batch's (layers.embedding).
BATCH_TOKENS = {"cpu": INT8_MAX_ROWS, "cuda": 512}
# Committed tokens a draft model catches up on in one step (a prompt over several steps).
CATCH_UP_TOKENS = {"cpu": 512, "cuda": 8192}


@dataclass(frozen=True)
class SpecConfig:
    algorithm: str
    num_draft_tokens: int  # tokens per row in a verify forward: the last token and its drafts
    min_window: int
    max_window: int
    batch_tokens: int
    catch_up_tokens: int  # STANDALONE (engine.draft_model)
    budget: bool = True  # NGRAM on CPU: drafts cut to those worth their place (draft_budget)

    def drafts_per_row(self, rows: int) -> int:
        """Drafts each of `rows` rows may verify in one step: num_draft_tokens - 1, fewer once
        the step would forward more than batch_tokens tokens (none at all past that)."""
        return max(0, min(self.num_draft_tokens - 1, (self.batch_tokens - rows) // max(rows, 1)))


def spec_config(config: EngineConfig, device_type: str) -> SpecConfig | None:
    if config.speculative_algorithm is None:
        return None
    tokens = config.speculative_num_draft_tokens
    device = "cuda" if device_type == "cuda" else "cpu"
    return SpecConfig(config.speculative_algorithm, tokens,
                      config.speculative_ngram_min_match_window_size,
                      config.speculative_ngram_max_match_window_size,
                      BATCH_TOKENS[device], CATCH_UP_TOKENS[device],
                      budget=not config.speculative_always_draft)


@dataclass
class _RowDrafts:
    """A table row's drafting state, for the request `uid` that holds the row."""

    uid: int
    index: NgramIndex | None  # NGRAM's
    last_committed: int = 0
    last_drafts: int = 0
    last_match: int = 0  # NGRAM: the suffix length its last drafts were matched on
    misses: int = 0  # verifies in a row that accepted none of their drafts
    cooldown: int = 0


class Speculator:
    def __init__(self, config: SpecConfig, token_pool: torch.Tensor, page_table: torch.Tensor,
                 draft_model: DraftModel | None = None, states: StatePool | None = None
                 ) -> None:
        self.config, self.draft_model = config, draft_model
        # a hybrid model's recurrent states: a verify step saves each row's state after each of
        # its tokens but the last (in the pool's scratch rows); the row keeps the accepted one
        self.states = states
        self.token_pool, self.page_table = token_pool, page_table
        self.context_len = token_pool.shape[1]
        self.device = token_pool.device
        # per table row: tokens in the token pool that are the request's (prompt and output)
        self.committed = torch.zeros(token_pool.shape[0], dtype=torch.int64, device=self.device)
        self.rows: dict[int, _RowDrafts] = {}
        # NOTE: on CPU a step's time is its compute (the engine thread runs it to the end), so
        # n-gram drafts, free to make, are cut to those worth their tokens (engine.draft_budget)
        self.budget = (DraftBudget(config.num_draft_tokens - 1) if config.budget
                       and draft_model is None and self.device.type == "cpu" else None)
        # CUDA graphs of verify steps (engine.graph): up to `graph_rows` rows forward
        # `graph_width` tokens each, their own then fillers (0: every step packed)
        self.graph_width = self.graph_rows = 0
        self.dummy_loc = 0

    def pad_for_graphs(self, width: int, rows: int, dummy_loc: int) -> None:
        """Lay verify steps of up to `rows` rows out `width` tokens a row, as the captured
        verify graphs take them: a row's tokens past its drafts are fillers, which write their
        KV to `dummy_loc`, store no token and are never accepted (nothing after a row's real
        tokens attends to them: causal)."""
        self.graph_width, self.graph_rows, self.dummy_loc = width, rows, dummy_loc

    def record_step(self, fwd: ForwardInput) -> None:
        """A step that sampled one token per row at fwd.write_indices (flat token-pool indices;
        the dummy row's are harmless): each row now holds its tokens up to there. Its prefill
        rows start over in the draft model's KV."""
        write_indices = fwd.write_indices
        self.committed[write_indices // self.context_len] = write_indices % self.context_len + 1
        batch = fwd.batch
        if self.draft_model is not None and not batch.is_decode:
            self.draft_model.forget(batch.table_rows[:batch.size - batch.decode_rows])

    # ---- before the forward ------------------------------------------------------------------

    def resolve(self, fwd: ForwardInput) -> None:
        """Lay out a verify step (fwd.verify) now that every earlier step ran: drafts into the
        token pool, the batch's lengths and positions, the gather/write indices, logit rows."""
        verify, batch = fwd.verify, fwd.batch
        assert verify is not None
        table_rows = batch.table_rows[:batch.size]
        committed = self.committed[torch.tensor(table_rows)].tolist()
        fresh = self._tokens_past_indices(table_rows, verify.uids, committed)
        most = [self._row_drafts(row, uid, length, min(most, cap - length - 1), tokens)
                for row, uid, length, most, cap, tokens in zip(
                    table_rows, verify.uids, committed, verify.max_drafts, verify.max_lens,
                    fresh)]
        if self.draft_model is None:
            matched = [self.rows[row].index.draft_with_match(m)  # type: ignore[union-attr]
                       if m > 0 else ([], 0) for row, m in zip(table_rows, most)]
            verify.drafts = (self.budget.cut(matched) if self.budget is not None
                             else [d for d, _ in matched])
            for row, (_, n) in zip(table_rows, matched):
                self.rows[row].last_match = n
        else:
            assert fwd.sample_args is not None
            drafts = self.draft_model.draft(table_rows, committed, most, verify.greedy,
                                            fwd.sample_args)
            verify.drafts, verify.draft_probs = drafts.tokens, drafts.probs
        for row, d in zip(table_rows, verify.drafts):
            self.rows[row].last_drafts = len(d)
        verify.counts = [1 + len(d) for d in verify.drafts]
        starts = [c - 1 for c in committed]
        ctx = self.context_len
        width = self.graph_width if (
            1 < max(verify.counts) <= self.graph_width and len(table_rows) <= self.graph_rows
            and max(starts) + self.graph_width <= ctx) else 0
        spans = [width] * len(table_rows) if width else verify.counts
        positions, flat = span_indices(table_rows, starts, spans, ctx)
        written = span_indices(table_rows, starts, verify.counts, ctx)[1] if width else flat
        drafted = [(row * ctx + start + 1, d) for row, start, d in zip(table_rows, starts,
                                                                         verify.drafts) if d]
        if drafted:
            index = torch.tensor([i + j for i, d in drafted for j in range(len(d))])
            values = torch.tensor([t for _, d in drafted for t in d], dtype=torch.int32)
            self.token_pool.view(-1)[to_device(index, self.device)] = to_device(values, self.device)
        batch.phase = "decode" if max(spans) == 1 else "prefill"
        batch.cached_lens = starts
        batch.extend_lens = spans
        batch.seq_lens = [s + c for s, c in zip(starts, spans)]
        batch.row_tokens = width
        verify.offsets = list(accumulate(spans[:-1], initial=0))
        if self.states is not None:
            batch.state_saves = [(row, j, self.states.scratch_row(row, j - 1))
                                 for row, count in zip(table_rows, verify.counts)
                                 for j in range(1, count)]
        flat_d = to_device(flat, self.device)
        batch.input_positions = to_device(positions, self.device)
        batch.out_loc = self.page_table.view(-1)[flat_d].to(torch.int64)
        if width:
            real = torch.arange(width)[None, :] < torch.tensor(verify.counts)[:, None]
            batch.out_loc = torch.where(to_device(real.view(-1), self.device), batch.out_loc,
                                        self.dummy_loc)
        fwd.load_indices = flat_d
        # each real token row's prediction: its next position
        fwd.write_indices = to_device(written, self.device) + 1
        fwd.logit_rows = None if batch.is_decode else torch.arange(len(positions),
                                                                   device=self.device)
        fwd.verify_step = True

    def keep_accepted_states(self, fwd: ForwardInput) -> torch.Tensor | None:
        """After `verify`: each hybrid row's recurrent state back to the one after its accepted
        tokens (the last token and its accepted drafts), from the device's committed lengths
        (no sync). Returns the rows' sources (state rows, in batch order) for the other ranks
        (ModelRunner._keep_states_as_rank_0), or None for a model without states."""
        if self.states is None:
            return None
        batch, verify = fwd.batch, fwd.verify
        assert verify is not None
        rows = to_device(torch.tensor(batch.table_rows[:batch.size]), self.device)
        starts = to_device(torch.tensor(batch.cached_lens), self.device)
        counts = to_device(torch.tensor(verify.counts), self.device)
        kept = self.committed[rows] - starts - 1  # tokens of each row's span its state follows
        sources = torch.where(kept < counts,
                              self.states.scratch_row(rows, (kept - 1).clamp(min=0)), rows)
        self.states.copy(sources, rows)
        return sources

    def token_writes(self, fwd: ForwardInput) -> list[tuple[int, int, torch.Tensor]]:
        """The drafts `resolve` wrote, as token-pool writes (row, start, ids) for other ranks."""
        verify, batch = fwd.verify, fwd.batch
        assert verify is not None
        return [(row, start + 1, torch.tensor(d, dtype=torch.int32))
                for row, start, d in zip(batch.table_rows, batch.cached_lens, verify.drafts) if d]

    def _tokens_past_indices(self, table_rows: list[int], uids: list[int],
                             committed: list[int]) -> list[list[int]]:
        """Per row, its committed tokens that its n-gram index (a new request's: none) lacks,
        read from the token pool in one copy (one device sync, not one per row)."""
        if self.draft_model is not None:
            return [[] for _ in table_rows]
        starts = []
        for row, uid in zip(table_rows, uids):
            state = self.rows.get(row)
            starts.append(len(state.index.tokens) if state is not None and state.uid == uid
                          and state.index is not None else 0)
        counts = [max(0, end - start) for start, end in zip(starts, committed)]
        if not any(counts):
            return [[] for _ in table_rows]
        _, flat = span_indices(table_rows, starts, counts, self.context_len)
        tokens = self.token_pool.view(-1)[to_device(flat, self.device)].tolist()
        ends = list(accumulate(counts))
        return [tokens[end - count:end] for count, end in zip(counts, ends)]

    def _row_drafts(self, row: int, uid: int, committed: int, most: int,
                    fresh: list[int]) -> int:
        """How many drafts the row may take now (0 while it cools down after drafts it kept
        rejecting); brings its n-gram index up to its committed tokens (`fresh`: those it
        lacks)."""
        state = self.rows.get(row)
        if state is None or state.uid != uid:
            index = (NgramIndex(self.config.min_window, self.config.max_window)
                     if self.draft_model is None else None)
            state = self.rows[row] = _RowDrafts(uid, index)
        elif state.last_drafts:  # how the row's previous verify went (known now, no sync)
            if self.budget is not None:
                self.budget.rates.observe(state.last_match, state.last_drafts, min(
                    committed - state.last_committed - 1, state.last_drafts))
            if committed - state.last_committed > 1:
                state.misses = 0
            else:
                state.misses += 1
                state.cooldown = min(2 ** state.misses, MAX_COOLDOWN) if state.misses > 1 else 0
        index = state.index
        if index is not None and committed < len(index.tokens):
            index.truncate(committed)
        if index is not None and committed > len(index.tokens):
            index.extend(fresh)
        state.last_committed, state.last_drafts = committed, 0
        if most <= 0 or state.cooldown > 0:
            state.cooldown = max(0, state.cooldown - 1)
            return 0
        return most

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A decode or verify step forwarded `tokens` in `seconds` (CPU: its compute)."""
        if self.budget is not None:
            self.budget.cost.observe(tokens, seconds)

    # ---- after the forward -------------------------------------------------------------------

    def verify(self, fwd: ForwardInput, logits: torch.Tensor, sampler: Sampler,
               mask: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[ForwardOutput,
                                                                         torch.Tensor]:
        """Accept drafts (rank 0). `logits`: one row per forwarded token, row by row. Returns
        the host output (token_ids [B, W]: each row's emitted tokens, `counts` of them) and the
        tokens to store at fwd.write_indices (one per token row)."""
        verify, batch, args = fwd.verify, fwd.batch, fwd.sample_args
        assert verify is not None and args is not None
        size, device = batch.size, self.device
        if mask is not None and fwd.grammar is not None and any(
                verify.drafts[i] for i in fwd.grammar.row_ids):
            logits, mask = self._mask_drafted(fwd, logits), None
        if (device.type == "cpu" and mask is None and self.draft_model is None
                and args.raw_argmax and not args.return_logprobs):
            return self._verify_argmax(fwd, logits)
        counts = to_device(torch.tensor(verify.counts), device)
        width = max(verify.counts)
        first = to_device(torch.tensor(verify.offsets), device)  # each row's first token row
        sample = sampler.sample(logits[first], args, self.token_pool, mask)
        emitted = torch.zeros(size, width, dtype=torch.int64, device=device)
        emitted[:, 0] = sample.next_tokens
        accepted = torch.zeros(size, dtype=torch.int64, device=device)
        drafting = [i for i, d in enumerate(verify.drafts) if d]
        if drafting:
            rows = to_device(torch.tensor(drafting), device)
            lens = counts[rows] - 1
            drafts = torch.zeros(len(drafting), width - 1, dtype=torch.int64)
            for j, i in enumerate(drafting):
                drafts[j, :len(verify.drafts[i])] = torch.tensor(verify.drafts[i])
            drafts = to_device(drafts, device)
            at = (first[rows, None] + torch.arange(width, device=device)).clamp(
                max=len(logits) - 1)
            kept = torch.zeros_like(lens)
            out = torch.zeros(len(drafting), width, dtype=torch.int64, device=device)
            # NOTE: the split is known on the host: no sync inside a CUDA launch
            greedy = [j for j, i in enumerate(drafting) if verify.greedy[i]]
            sampled = [j for j, i in enumerate(drafting) if not verify.greedy[i]]
            if greedy:  # at [S, W]: past a row's count, ignored
                g = to_device(torch.tensor(greedy), device)
                kept[g], out[g] = accept_greedy(drafts[g], lens[g], argmax(logits)[at[g]])
            if sampled:
                s = to_device(torch.tensor(sampled), device)
                probs = sampler.target_probs(logits[at[s]].float(), args, rows[s])
                q = verify.draft_probs  # None: n-gram drafts, point masses
                kept[s], out[s] = accept_sampled(
                    drafts[s], lens[s], probs,
                    None if q is None else q[rows[s], :width - 1],
                    generator=sampler.generator)
            accepted[rows] = kept
            emitted[rows] = out
        table_rows = to_device(torch.tensor(batch.table_rows[:size]), device)
        if drafting and self.draft_model is not None:
            drafted = table_rows[rows]
            self.draft_model.accepted(drafted, self.committed[drafted], lens, kept)
        self.committed[table_rows] += accepted + 1
        token_row = [i for i, c in enumerate(verify.counts) for _ in range(c)]
        column = [j for c in verify.counts for j in range(c)]
        stored = emitted[to_device(torch.tensor(token_row), device),
                         to_device(torch.tensor(column), device)].to(torch.int32)
        output = ForwardOutput(token_ids=to_host(emitted.to(torch.int32)),
                               counts=to_host(accepted + 1), drafted=to_host(counts - 1))
        if args.return_logprobs:
            self._logprobs(output, logits, first, emitted, sample, counts > 1,
                           args.top_logprobs_num)
        return output, stored

    def _verify_argmax(self, fwd: ForwardInput, logits: torch.Tensor
                       ) -> tuple[ForwardOutput, torch.Tensor]:
        """verify() where every row takes the raw argmax (CPU): acceptance on the host's lists,
        one argmax over the step's logits, no per-row tensor ops."""
        verify, batch = fwd.verify, fwd.batch
        assert verify is not None
        targets = argmax(logits).tolist()
        width = max(verify.counts)
        emitted: list[list[int]] = []
        stored: list[int] = []
        counts: list[int] = []
        for offset, drafts, count in zip(verify.offsets, verify.drafts, verify.counts):
            kept = 0
            while kept < len(drafts) and drafts[kept] == targets[offset + kept]:
                kept += 1
            tokens = drafts[:kept] + [targets[offset + kept]]
            counts.append(len(tokens))
            row = tokens + [0] * (width - len(tokens))
            emitted.append(row)
            stored += row[:count]  # a token row per forwarded token: past `counts`, unused
        self.committed[torch.tensor(batch.table_rows[:batch.size])] += torch.tensor(counts)
        return ForwardOutput(token_ids=torch.tensor(emitted, dtype=torch.int32),
                             counts=torch.tensor(counts),
                             drafted=torch.tensor([c - 1 for c in verify.counts])
                             ), torch.tensor(stored, dtype=torch.int32)

    def _mask_drafted(self, fwd: ForwardInput, logits: torch.Tensor) -> torch.Tensor:
        """The logits of every token a grammar row forwards, under its grammar's mask there:
        the scheduler filled the first position's; each row's matcher walks its drafts for the
        rest and is rolled back (the scheduler has accepted the step before into it and
        accepts this one's tokens only once this returns). After a draft the grammar refuses
        nothing is masked: that draft cannot be accepted, so nothing after it is used."""
        verify, grammar = fwd.verify, fwd.grammar
        assert verify is not None and grammar is not None
        starts = verify.offsets
        token_rows: list[int] = []
        masks: list[torch.Tensor] = []
        for j, i in enumerate(grammar.row_ids):
            token_rows.append(starts[i])
            masks.append(grammar.bitmask[j:j + 1])
            drafts, matcher = verify.drafts[i], verify.matchers[i]
            if not drafts or matcher is None or matcher.is_terminated():
                continue
            after = torch.full((len(drafts), grammar.bitmask.shape[1]), -1, dtype=torch.int32)
            walked = 0
            for token in drafts:
                if not matcher.accept_token(token):
                    break
                walked += 1
                if matcher.is_terminated():  # the row ends at this draft if it is accepted
                    break
                matcher.fill_next_token_bitmask(after, walked - 1)
            if walked:
                matcher.rollback(walked)
            token_rows += range(starts[i] + 1, starts[i] + 1 + len(drafts))
            masks.append(after)
        rows = to_device(torch.tensor(token_rows), self.device)
        allowed = unpack_bitmask(to_device(torch.cat(masks), self.device), logits.shape[1])
        return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))

    @staticmethod
    def _logprobs(output: ForwardOutput, logits: torch.Tensor, first: torch.Tensor,
                  emitted: torch.Tensor, sample: SampleOutput, drafting: torch.Tensor,
                  top_k: int) -> None:
        """Raw log-softmax at each emitted token (the target's), and its top k, [B, W]; a row
        without drafts keeps the sampler's (a grammar row's are those of the masked logits)."""
        width = emitted.shape[1]
        at = (first[:, None] + torch.arange(width, device=first.device)).clamp(
            max=len(logits) - 1)
        logp = torch.log_softmax(logits[at].float(), dim=-1)  # [B, W, V]
        values = logp.gather(2, emitted[..., None])[..., 0]
        assert sample.logprobs is not None
        values[:, 0] = torch.where(drafting, values[:, 0], sample.logprobs)
        output.logprobs = to_host(values)
        if top_k > 0:
            top_values, ids = logp.topk(top_k, dim=-1)
            if sample.top_logprobs is not None:
                keep = drafting[:, None]
                top_values[:, 0] = torch.where(keep, top_values[:, 0], sample.top_logprobs[0])
                ids[:, 0] = torch.where(keep, ids[:, 0], sample.top_logprobs[1].long())
            output.top_logprobs = (to_host(top_values), to_host(ids.to(torch.int32)))
