"""STANDALONE drafts (`--speculative-algorithm STANDALONE`): a second model with the target's
vocabulary proposes each speculating row's next tokens, one draft forward per token: its
argmax for a greedy request, a token drawn from its own sampling distribution (the request's
temperature and filters applied to the draft's logits) for a sampled one, whose probabilities
then go to the speculative-sampling rule (engine.acceptance).

The draft's KV pool is laid out like the target's: the one page table maps a row's positions
to slots in both pools, so a draft forward writes only where the target has the row's slots
(its committed positions, and the verify step's reservation for the drafts). Per table row
the draft keeps how many leading positions of its KV hold the row's true tokens (`valid`).
A prefill sets it to 0: a new request, or a retracted one prefilled again into other slots;
and a prefix the target found in its cache is recomputed by the draft too, since no request
need have drafted over those slots. Drafting first catches a row up from `valid` to its
committed tokens, in the same forward that yields the first draft (at most `catch_up_tokens`
a step: a row further behind only catches up that step); the verify step then lowers `valid`
to the positions whose tokens were accepted. Whatever the draft KV holds, verification keeps
the output exact: it only decides how many drafts are accepted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention.base import AttentionBackend
from minisgl.core import Batch, span_indices
from minisgl.distributed.context import TPInfo, tp_context
from minisgl.engine.sampler import Sampler, SamplingArgs, argmax, to_device


@dataclass
class Drafts:
    tokens: list[list[int]]  # per batch row (empty: no drafts this step)
    probs: torch.Tensor | None  # [B, K, V]: sampled rows' draft distributions (None: greedy)


class DraftModel:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, sampler: Sampler,
                 token_pool: torch.Tensor, page_table: torch.Tensor, catch_up_tokens: int
                 ) -> None:
        self.model, self.backend, self.sampler = model, backend, sampler
        self.token_pool, self.page_table = token_pool, page_table
        self.context_len = token_pool.shape[1]
        self.device = token_pool.device
        self.catch_up_tokens = catch_up_tokens
        self.valid = torch.zeros(token_pool.shape[0], dtype=torch.int64, device=self.device)

    def forget(self, rows: list[int]) -> None:
        """Rows being prefilled: their draft KV holds nothing of theirs."""
        if rows:
            self.valid[self._ints(rows)] = 0

    def accepted(self, rows: torch.Tensor, committed: torch.Tensor, drafted: torch.Tensor,
                 kept: torch.Tensor) -> None:
        """After a verify step (device tensors, no sync): table rows that drafted, their
        committed lengths before it, the drafts each verified and kept. Drafting wrote KV
        from the last committed token through the next-to-last draft."""
        self.valid[rows] = committed + torch.minimum(kept, drafted - 1)

    def draft(self, rows: list[int], committed: list[int], most: list[int], greedy: list[bool],
              args: SamplingArgs) -> Drafts:
        """Up to most[i] drafts for each batch row i (table row rows[i], committed[i] tokens)."""
        tokens: list[list[int]] = [[] for _ in rows]
        wanted = [i for i, m in enumerate(most) if m > 0]
        if not wanted:
            return Drafts(tokens, None)
        valid = self.valid[self._ints([rows[i] for i in wanted])]
        spans: list[tuple[int, int, int]] = []  # (batch row, first position, tokens)
        budget = self.catch_up_tokens
        for i, start in sorted(zip(wanted, valid.tolist()), key=lambda x: committed[x[0]] - x[1]):
            count = min(committed[i] - start, budget)
            if count > 0:
                spans.append((i, start, count))
                budget -= count
        reaching = [n for n, (i, start, count) in enumerate(spans)
                    if start + count == committed[i]]
        drafting = [spans[n][0] for n in reaching]
        with tp_context(TPInfo(), None):  # NOTE: the draft is whole on rank 0: no collectives
            first = self._catch_up(rows, spans, reaching)
            ids, probs = self._chain(rows, committed, most, greedy, args, drafting, first)
        behind = [(rows[i], start + count) for i, start, count in spans
                  if start + count < committed[i]]
        if behind:
            self.valid[self._ints([r for r, _ in behind])] = self._ints([v for _, v in behind])
        for j, row in enumerate(ids.tolist()):
            tokens[drafting[j]] = row[:most[drafting[j]]]
        return Drafts(tokens, probs)

    def _catch_up(self, rows: list[int], spans: list[tuple[int, int, int]],
                  reaching: list[int]) -> torch.Tensor:
        """One forward over each span's committed tokens; the logits at the last token of
        the spans `reaching` their row's committed length (the drafting rows)."""
        if not spans:
            return torch.empty(0)
        table_rows = [rows[i] for i, _, _ in spans]
        starts = [s for _, s, _ in spans]
        counts = [c for _, _, c in spans]
        positions, flat = span_indices(table_rows, starts, counts, self.context_len)
        flat_d = to_device(flat, self.device)
        ends = torch.tensor(counts).cumsum(0) - 1
        last = to_device(ends[reaching] if reaching else ends[:1], self.device)
        batch = Batch("prefill", len(spans), table_rows=table_rows, cached_lens=starts,
                      seq_lens=[s + c for s, c in zip(starts, counts)], extend_lens=counts)
        return self._forward(batch, self.token_pool.view(-1)[flat_d], to_device(positions,
                                                                                self.device),
                             flat_d, last)

    def _chain(self, rows: list[int], committed: list[int], most: list[int], greedy: list[bool],
               args: SamplingArgs, drafting: list[int],
               first_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafting rows' tokens [D, K] (K: the most any drafts), each draft forward fed
        the previous draft at its position; and the sampled rows' draft distributions."""
        if not drafting:
            return torch.empty(0, 0, dtype=torch.int64), None
        width = max(most[i] for i in drafting)
        ids = torch.zeros(len(drafting), width, dtype=torch.int64, device=self.device)
        probs = (torch.zeros(len(rows), width, first_logits.shape[-1], device=self.device)
                 if not all(greedy[i] for i in drafting) else None)
        logits = first_logits
        active = list(range(len(drafting)))
        for step in range(width):
            if step > 0:
                active = [j for j in active if most[drafting[j]] > step]
                table_rows = [rows[drafting[j]] for j in active]
                positions = torch.tensor([committed[drafting[j]] + step - 1 for j in active])
                flat = torch.tensor(table_rows) * self.context_len + positions
                batch = Batch("decode", len(active), table_rows=table_rows,
                              cached_lens=positions.tolist(),
                              seq_lens=(positions + 1).tolist(), extend_lens=[1] * len(active))
                logits = self._forward(batch, ids[self._ints(active), step - 1],
                                       to_device(positions, self.device),
                                       to_device(flat, self.device), None)
            ids_now = argmax(logits)
            draw = [n for n, j in enumerate(active) if not greedy[drafting[j]]]
            if draw:
                at = self._ints(draw)
                batch_rows = self._ints([drafting[active[n]] for n in draw])
                q = self.sampler.target_probs(logits[at].float()[:, None], args, batch_rows)[:, 0]
                ids_now[at] = torch.multinomial(q, 1, generator=self.sampler.generator)[:, 0]
                assert probs is not None
                probs[batch_rows, step] = q
            ids[self._ints(active), step] = ids_now
        return ids, probs

    def _ints(self, values: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.int64), self.device)

    def _forward(self, batch: Batch, input_ids: torch.Tensor, positions: torch.Tensor,
                 flat: torch.Tensor, logit_rows: torch.Tensor | None) -> torch.Tensor:
        batch.input_positions = positions
        batch.out_loc = self.page_table.view(-1)[flat].to(torch.int64)
        self.backend.prepare_metadata(batch)
        return self.model(input_ids, positions, batch, self.backend, logit_rows)
