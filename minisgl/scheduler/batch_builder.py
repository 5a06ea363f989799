"""Turning scheduled requests into a forward: positions, KV locations, the token-pool indices
the forward gathers its input ids from and writes its sampled ids to, sampling arguments, and
(tensor parallelism) the step message for the other ranks.

NOTE: building a batch commits it: each request's kv_len (and, on its last prompt chunk, its
device_len) advance as if the forward had run, so the next batch can be built before this one
finished. Host work here is a handful of vectorised tensor ops, no per-token Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core import Batch, Phase, Req, span_indices
from minisgl.engine import (Engine, ForwardInput, GrammarMask, InputLogprobRows, StepMessage,
                            VerifyRows)
from minisgl.engine.images import ImageSlice, image_rows
from minisgl.engine.stream import Completion
from minisgl.scheduler.lora import AdapterTable
from minisgl.scheduler.memory import TableManager
from minisgl.scheduler.prefill import PrefillChunk


@dataclass
class ScheduledBatch:
    """A forward as the scheduler sees it: which request each row is, and whether the row's
    sampled token counts (False for a prompt chunk that is not the prompt's last)."""

    reqs: list[Req]
    last_chunk: list[bool]
    fwd: ForwardInput
    completion: Completion | None = None  # set when launched
    reserved: list[int] | None = None  # a verify step: KV slots reserved per row

    @property
    def embed_rows(self) -> list[int]:
        """Rows whose embedding the forward returns (ForwardOutput.embeddings, in order)."""
        return embedding_rows(self.reqs, self.last_chunk)

    def fill_masks(self) -> None:
        """Each grammar row's allowed next tokens, from its matcher (which must have accepted
        every token sampled before this batch); then sampling may go on. Idempotent."""
        grammar = self.fwd.grammar
        if grammar is None or grammar.filled:
            return
        for j, i in enumerate(grammar.row_ids):
            req = self.reqs[i]
            if not req.is_finished:  # NOTE: a finished row's token is dropped anyway
                req.matcher.fill_next_token_bitmask(grammar.bitmask, j)
        grammar.release()


def decodes_in_runs(req: Req) -> bool:
    """Whether a run of decode steps (engine.decode_steps) samples `req` as lone steps would:
    nothing of its sampling changes with its length (penalties, min_new_tokens' bans still on)
    or waits for the host (a grammar), and its positions are plain (no images)."""
    params = req.params
    return (req.matcher is None and req.images is None and not params.needs_penalties
            and req.kv_len + 1 - req.prompt_len >= params.min_new_tokens)


def logprob_nums(reqs: list[Req]) -> list[int] | None:
    """Per row the logprobs it asked for (-1: none); None when no row asked (the sampler then
    computes none)."""
    if not any(r.logprobs is not None for r in reqs):
        return None
    return [-1 if r.logprobs is None else r.logprobs.num for r in reqs]


def image_slices(reqs: list[Req], starts: list[int], counts: list[int]) -> list[ImageSlice]:
    """The image placeholders of the rows' spans, each at its token row of the batch."""
    slices, row = [], 0
    for req, start, count in zip(reqs, starts, counts):
        if req.images is not None:
            slices += [ImageSlice(image, first, n, row + at)
                       for image, first, n, at in req.images.overlapping(start, start + count)]
        row += count
    return slices


def image_blocks(reqs: list[Req], starts: list[int], counts: list[int]
                 ) -> list[tuple[int, int, int, int]] | None:
    """Batch.image_blocks: the images whose tokens see each other both ways (PromptImages.whole,
    never cut by a chunk) among the rows' spans; None if none."""
    blocks, row = [], 0
    for req, start, count in zip(reqs, starts, counts):
        if req.images is not None and req.images.whole:
            for image, first, n, at in req.images.overlapping(start, start + count):
                assert first + n == image.tokens, "a chunk cut an image"
                blocks.append((row + at, req.table_idx, start + at, start + at + n))
        row += count
    return blocks or None


def image_inputs(reqs: list[Req], starts: list[int], counts: list[int], positions: torch.Tensor,
                 phase: Phase) -> tuple[torch.Tensor | None, list[ImageSlice]]:
    """A step with multimodal requests: the RoPE positions, where some row's differ from its
    tokens' indices ([tokens] in a decode step, else [3, tokens]: PromptImages), and the image
    placeholders its prompt tokens read."""
    slices = image_slices(reqs, starts, counts)
    turned = [r.images is not None and (r.images.rope is not None or r.images.rope_delta != 0)
              for r in reqs]
    if not any(turned):
        return None, slices
    if phase == "decode":
        return positions + torch.tensor([r.images.rope_delta if t else 0
                                         for r, t in zip(reqs, turned)]), slices
    return torch.cat([req.images.rope_positions(start, count) if t
                      else torch.arange(start, start + count).expand(3, count)
                      for req, start, count, t in zip(reqs, starts, counts, turned)], dim=1), slices


def embedding_rows(reqs: list[Req], last_chunk: list[bool]) -> list[int]:
    """Rows that end an embedding request's prompt: their last token's hidden state is its
    embedding (earlier chunks only fill the KV cache)."""
    return [i for i, (req, last) in enumerate(zip(reqs, last_chunk)) if last and req.embed]


class BatchBuilder:
    def __init__(self, engine: Engine, table: TableManager, page_size: int,
                 adapters: AdapterTable) -> None:
        self.engine, self.table, self.page_size = engine, table, page_size
        self.adapters = adapters
        self.multi_rank = engine.tp.size > 1
        self.long_rope = engine.arch.long_rope

    def prefill(self, chunks: list[PrefillChunk]) -> ScheduledBatch:
        return self._build("prefill", [c.req for c in chunks], [c.start for c in chunks],
                           [c.count for c in chunks], [c.is_last for c in chunks],
                           torch.cat([c.locations for c in chunks]))

    def decode(self, reqs: list[Req], locations: torch.Tensor, steps: int = 1
               ) -> ScheduledBatch:
        """One decode step; `steps` > 1: a run of that many (engine.decode_steps), `locations`
        each row's `steps` KV slots in turn. The run is committed whole, as one step is."""
        if steps == 1:
            return self._build("decode", reqs, [r.kv_len for r in reqs], [1] * len(reqs),
                               [True] * len(reqs), locations)
        per_step = locations.view(len(reqs), steps)
        starts = [r.kv_len for r in reqs]
        scheduled = self._build("decode", reqs, starts, [1] * len(reqs), [True] * len(reqs),
                                per_step[:, 0].contiguous())
        rows = [r.table_idx for r in reqs]
        _, later = span_indices(rows, [s + 1 for s in starts], [steps - 1] * len(reqs),
                                self.table.context_len)
        self.table.write_locations(later, per_step[:, 1:].reshape(-1))
        tails = per_step[:, -1].tolist()
        for req, tail in zip(reqs, tails):
            req.kv_len += steps - 1
            req.device_len += steps - 1
            req.tail_loc = tail
        fwd = scheduled.fwd
        fwd.steps, fwd.step_locations = steps, per_step
        fwd.stop_ids = [r.stop_ids for r in reqs]
        return scheduled

    def verify(self, reqs: list[Req], counts: list[int], locations: torch.Tensor
               ) -> ScheduledBatch:
        """A decode step of speculating requests (rows of others decode one token): `counts`
        KV slots reserved per row at [kv_len, kv_len + count) (`locations`). The engine lays it
        out when it runs (engine.speculation); only the reservation happens here."""
        ctx = self.table.context_len
        rows = [r.table_idx for r in reqs]
        counts_t = torch.tensor(counts)
        _, reserved = span_indices(rows, [r.kv_len for r in reqs], counts, ctx)
        self.table.write_locations(reserved, locations)
        ends = [r.kv_len + 1 for r in reqs]  # exact for rows that do not speculate
        sample_args = self.engine.sampler.sampling_args(
            reqs, prompt_lens=[r.prompt_len for r in reqs],
            output_counts=[e - r.prompt_len for r, e in zip(reqs, ends)], table_rows=rows,
            seq_lens=ends, logprob_nums=logprob_nums(reqs))
        tails = locations[counts_t.cumsum(0) - 1].tolist()
        for req, count, tail in zip(reqs, counts, tails):
            req.kv_len += count
            req.device_len += count
            req.tail_loc = tail
        lora_slots, loads = self._adapters_of(reqs)
        batch = Batch("decode", len(reqs), table_rows=rows, cached_lens=[], seq_lens=[],
                      extend_lens=[], lora_slots=lora_slots)
        message = None
        if self.multi_rank:  # the engine fills in the layout (StepMessage.resolve)
            tokens, location_writes = self.table.take_log()
            empty = torch.zeros(0, dtype=torch.int64)
            message = StepMessage("decode", len(reqs), rows, [], [], [], empty, empty, empty,
                                  empty, None, token_writes=tokens,
                                  location_writes=location_writes,
                                  lora_slots=batch.lora_slots, lora_loads=loads)
        verify = VerifyRows(uids=[r.uid for r in reqs],
                            max_drafts=[c - 1 if r.spec is not None else 0
                                        for r, c in zip(reqs, counts)],
                            max_lens=[r.max_device_len for r in reqs],
                            greedy=[r.params.is_greedy for r in reqs],
                            matchers=[r.matcher if r.spec is not None else None for r in reqs])
        last = [True] * len(reqs)
        fwd = ForwardInput(batch=batch, load_indices=torch.zeros(0, dtype=torch.int64),
                           write_indices=torch.zeros(0, dtype=torch.int64), logit_rows=None,
                           sample_args=sample_args, message=message,
                           grammar=self._grammar_rows(reqs, last), verify=verify,
                           lora_loads=loads)
        return ScheduledBatch(reqs, last, fwd, reserved=counts)

    def mixed(self, chunks: list[PrefillChunk], decodes: list[Req], locations: torch.Tensor
              ) -> ScheduledBatch:
        """The prefill chunks, then one decode row per running request (`locations`: theirs)."""
        return self._build("mixed", [c.req for c in chunks] + decodes,
                           [c.start for c in chunks] + [r.kv_len for r in decodes],
                           [c.count for c in chunks] + [1] * len(decodes),
                           [c.is_last for c in chunks] + [True] * len(decodes),
                           torch.cat([c.locations for c in chunks] + [locations]),
                           decode_rows=len(decodes))

    def _build(self, phase: Phase, reqs: list[Req], starts: list[int], counts: list[int],
               last_chunk: list[bool], locations: torch.Tensor, decode_rows: int = 0
               ) -> ScheduledBatch:
        ctx = self.table.context_len
        device = self.engine.device
        rows = [r.table_idx for r in reqs]
        ends = [s + c for s, c in zip(starts, counts)]
        if phase == "decode":  # NOTE: built from ints: each tensor op here costs the loop
            positions = torch.tensor(starts)
            load = torch.tensor([r * ctx + s for r, s in zip(rows, starts)])
        else:
            positions, load = span_indices(rows, starts, counts, ctx)
        self.table.write_locations(load, locations)
        dummy_write = self.table.dummy_row * ctx
        write = torch.tensor([r * ctx + e if last and not req.prefill_only else dummy_write
                              for req, r, e, last in zip(reqs, rows, ends, last_chunk)])
        lora_slots, loads = self._adapters_of(reqs)
        rope = None  # NOTE: a decode token's row is its position
        if self.long_rope is not None and phase != "decode":
            rope = self.long_rope.table_rows(positions, starts, counts,
                                             [r.prompt_len for r in reqs])
        images, image_token_rows, blocks = None, None, None
        if any(r.images is not None for r in reqs):
            rope, images = image_inputs(reqs, starts, counts, positions, phase)
            image_token_rows = image_rows(images) if images else None
            blocks = image_blocks(reqs, starts, counts)
        batch = Batch(phase, len(reqs), table_rows=rows, cached_lens=starts, seq_lens=ends,
                      extend_lens=counts, input_positions=positions.to(device, non_blocking=True),
                      out_loc=locations.to(device, non_blocking=True), decode_rows=decode_rows,
                      lora_slots=lora_slots,
                      rope_positions=None if rope is None else rope.to(device, non_blocking=True),
                      image_blocks=blocks)
        self.engine.plan_batch(batch)
        sample_args = self.engine.sampler.sampling_args(
            reqs, prompt_lens=[len(r.prompt_ids) for r in reqs],
            output_counts=[e - len(r.prompt_ids) for r, e in zip(reqs, ends)],
            table_rows=rows, seq_lens=ends, logprob_nums=logprob_nums(reqs))
        rows_host, scored = None, None  # prefill: each last token, then any scored rows
        embed_rows = embedding_rows(reqs, last_chunk) if phase != "decode" else []
        # each request's last token row (a decode step: every row is one)
        last_rows = None if phase == "decode" else torch.tensor(counts).cumsum(0) - 1
        if last_rows is not None:
            rows_host = last_rows
            prefills = len(reqs) - decode_rows
            scored_rows = self._scored_rows(reqs[:prefills], starts, counts)
            if scored_rows is not None:
                extra, scored = scored_rows
                rows_host = torch.cat([rows_host, extra])
        tails = None
        if self.page_size > 1:
            tails = (locations if last_rows is None else locations[last_rows]).tolist()
        for i, req in enumerate(reqs):
            req.kv_len = ends[i]
            if tails is not None:
                req.tail_loc = tails[i]
            if last_chunk[i] and not req.prefill_only:
                req.device_len = ends[i] + 1
        message = None
        if self.multi_rank:  # the table writes since the last step travel with it
            tokens, location_writes = self.table.take_log()
            message = StepMessage(phase, batch.size, batch.table_rows, batch.cached_lens,
                                  batch.seq_lens, batch.extend_lens, positions, locations, load,
                                  write, rows_host, decode_rows=decode_rows,
                                  token_writes=tokens,
                                  location_writes=location_writes,
                                  lora_slots=batch.lora_slots, lora_loads=loads,
                                  rope_positions=rope, image_rows=image_token_rows,
                                  image_blocks=blocks)
        fwd = ForwardInput(batch=batch, load_indices=load.to(device, non_blocking=True),
                           write_indices=write.to(device, non_blocking=True),
                           logit_rows=None if rows_host is None else rows_host.to(
                               device, non_blocking=True),
                           sample_args=sample_args, message=message, input_logprobs=scored,
                           grammar=self._grammar_rows(reqs, last_chunk), lora_loads=loads,
                           embed_rows=torch.tensor(embed_rows, dtype=torch.int64).to(
                               device, non_blocking=True) if embed_rows else None,
                           image_rows=image_token_rows, images=images or None)
        return ScheduledBatch(reqs, last_chunk, fwd)

    def _adapters_of(self, reqs: list[Req]
                     ) -> tuple[list[int] | None, list[tuple[int, int, str]]]:
        """Each row's LoRA adapter slot and the adapter loads due; (None, []) while no admitted
        request uses an adapter."""
        if not self.adapters.active and not self.adapters.pending:
            return None, []
        return self.adapters.row_slots(reqs), self.adapters.take_loads()

    def _grammar_rows(self, reqs: list[Req], last_chunk: list[bool]) -> GrammarMask | None:
        """The rows whose token must follow a grammar (mask not filled yet); None if none."""
        rows = [i for i, (req, last) in enumerate(zip(reqs, last_chunk))
                if req.matcher is not None and last and not req.prefill_only]
        if not rows:
            return None
        words = -(-self.engine.arch.vocab_size // 32)
        return GrammarMask(rows, torch.tensor(rows).to(self.engine.device, non_blocking=True),
                           torch.full((len(rows), words), -1, dtype=torch.int32))

    def _scored_rows(self, reqs: list[Req], starts: list[int], counts: list[int]
                     ) -> tuple[torch.Tensor, InputLogprobRows] | None:
        """Token rows of this prefill whose logits score a prompt token (input logprobs), and
        what the engine needs to score them; None if there are none."""
        rows: list[int] = []
        targets: list[int] = []
        spans: list[tuple[int, int]] = []
        offset = 0
        for i, (req, start, count) in enumerate(zip(reqs, starts, counts)):
            wanted = req.input_logprob_positions
            first, end = max(start, wanted.start), min(start + count, wanted.stop)
            if first < end:
                rows += range(offset + first - start, offset + end - start)
                targets += req.host_ids[first + 1:end + 1]
                spans.append((i, end - first))
            offset += count
        if not spans:
            return None
        targets_t = torch.tensor(targets, dtype=torch.int64).to(self.engine.device,
                                                               non_blocking=True)
        top_k = min(max(reqs[i].logprobs.num for i, _ in spans), self.engine.arch.vocab_size)
        return torch.tensor(rows), InputLogprobRows(targets_t, top_k, spans)
