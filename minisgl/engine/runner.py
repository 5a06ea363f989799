"""The step: gather the input ids from the token pool, run the model (a captured CUDA graph
for a decode batch that fits one), sample on rank 0, and write the sampled ids back into the
token pool, where the next batch gathers them."""

from __future__ import annotations

import time

import torch

from minisgl.core import Batch
from minisgl.distributed.context import TPInfo, broadcast
from minisgl.engine.forward import (ForwardInput, ForwardOutput, InputLogprobs, VerifyRows,
                                    to_host)
from minisgl.engine.graph import GraphRunner
from minisgl.engine.lora import LoraModules
from minisgl.engine.memory import return_freed_heap
from minisgl.engine.pooling import last_token_embeddings
from minisgl.engine.sampler import Sampler
from minisgl.engine.scoring import score_rows
from minisgl.engine.speculation import Speculator
from minisgl.engine.tp_message import PHASES

# CPU: after a step of this many tokens the heap's free pages go back to the OS (see forward)
RETURN_HEAP_AFTER_TOKENS = 1024


class ModelRunner:
    def __init__(self, model: torch.nn.Module, attn_backend, sampler: Sampler,
                 token_pool: torch.Tensor, graph_runner: GraphRunner | None, tp: TPInfo,
                 speculator: Speculator | None = None, lora: LoraModules | None = None
                 ) -> None:
        self.model, self.attn_backend, self.sampler = model, attn_backend, sampler
        self.token_pool, self.graph_runner, self.tp = token_pool, graph_runner, tp
        self.speculator = speculator  # rank 0 of a speculating engine
        self.lora = lora  # --enable-lora
        self.device = token_pool.device
        self.phase_seconds = {phase: 0.0 for phase in PHASES}
        self.phase_steps = {phase: 0 for phase in PHASES}
        self.forwarded_tokens = {"prefill": 0, "decode": 0}  # mixed steps count in both

    def plan_batch(self, batch: Batch) -> None:
        """Host side, when the batch is scheduled: pad a decode batch to its graph size (dummy
        rows, dummy page), then build the attention metadata."""
        if self.graph_runner is not None:
            self.graph_runner.pad_batch(batch)
        self.attn_backend.prepare_metadata(batch)

    def resolve(self, fwd: ForwardInput) -> None:
        """Lay out a verify step once the steps before it ran (rank 0; see engine.speculation)."""
        assert self.speculator is not None
        self.speculator.resolve(fwd)
        self.plan_batch(fwd.batch)

    def forward(self, fwd: ForwardInput) -> ForwardOutput:
        """Runs on the engine stream (GPU) or the engine thread (CPU), in launch order."""
        started = time.perf_counter()
        if self.lora is not None:
            self.lora.begin_step(fwd.lora_loads, fwd.batch)
        logits, scored, embeddings = self._logits(fwd)
        if self.device.type == "cpu" and len(fwd.load_indices) >= RETURN_HEAP_AFTER_TOKENS:
            # NOTE: glibc keeps a prefill chunk's freed activations resident, on top of a KV
            # pool that fills as the requests decode (BENCHMARKS.md)
            return_freed_heap()
        if fwd.logits_only:
            return ForwardOutput(logits=logits.float())
        if self.tp.rank:  # rank 0 samples; every rank stores its choice
            next_tokens = torch.empty(len(fwd.write_indices), dtype=torch.int32,
                                      device=self.device)
            self.token_pool.view(-1)[fwd.write_indices] = broadcast(next_tokens, 0)
            return ForwardOutput()
        output = self._sample(fwd, logits, scored)
        output.embeddings = embeddings
        if self.speculator is not None and fwd.verify is None:
            self.speculator.record_step(fwd)
        self._count(fwd.batch, started, verify=fwd.verify)
        return output

    def _logits(self, fwd: ForwardInput
                ) -> tuple[torch.Tensor, InputLogprobs | None, torch.Tensor | None]:
        """The batch's next-token logits (replayed from a CUDA graph where one fits), the
        input logprobs of its scored prompt rows and the embeddings of its embedding rows
        (each None without any)."""
        batch = fwd.batch
        input_ids = self.token_pool.view(-1)[fwd.load_indices]
        # NOTE: the model's RoPE reads these rows (attention reads batch.input_positions)
        positions = (batch.input_positions if batch.rope_positions is None
                     else batch.rope_positions)
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch, input_ids, positions), None, None
        if fwd.num_scored_rows or fwd.embed_rows is not None:
            # NOTE: the same collectives as the model's forward on the other ranks: the LM
            # head on the sampling rows, then (every rank) on the scored rows
            hidden = self.model.hidden_states(input_ids, positions, batch, self.attn_backend,
                                              fwd.logit_rows)
            embeddings = (None if fwd.embed_rows is None
                          else last_token_embeddings(hidden, fwd.embed_rows))
            logits = self.model.lm_head(hidden[: batch.size])
            scored = (score_rows(self.model.lm_head, hidden[batch.size:], fwd.input_logprobs)
                      if fwd.num_scored_rows else None)
            return logits, scored, embeddings
        return self.model(input_ids, positions, batch, self.attn_backend,
                          fwd.logit_rows), None, None

    def _sample(self, fwd: ForwardInput, logits: torch.Tensor,
                scored: InputLogprobs | None) -> ForwardOutput:
        """Rank 0: sample (under the grammar's mask), store the ids in the token pool, share
        them with the other ranks, and copy the results to the host."""
        mask = None
        if fwd.grammar is not None:  # NOTE: may wait for the scheduler (see GrammarMask)
            bitmask = fwd.grammar.wait()
            mask = (fwd.grammar.rows, bitmask.to(self.device, non_blocking=True))
        if fwd.verify is not None:
            assert self.speculator is not None
            output, stored = self.speculator.verify(fwd, logits, self.sampler, mask)
            self.token_pool.view(-1)[fwd.write_indices] = stored
            if self.tp.size > 1:
                broadcast(stored, 0)
            return output
        sample = self.sampler.sample(logits[: fwd.batch.size], fwd.sample_args, self.token_pool,
                                     mask)
        self.token_pool.view(-1)[fwd.write_indices] = sample.next_tokens
        if self.tp.size > 1:
            broadcast(sample.next_tokens, 0)
        tops = sample.top_logprobs
        return ForwardOutput(
            token_ids=to_host(sample.next_tokens), logprobs=to_host(sample.logprobs),
            top_logprobs=None if tops is None else (to_host(tops[0]), to_host(tops[1])),
            input_logprobs=scored)

    def _count(self, batch: Batch, started: float, verify: VerifyRows | None) -> None:
        """NOTE: on CPU this is the real compute time; on CUDA only the launch time. A verify
        step counts as decode, with its rows' tokens (not the fillers of a graph's layout)."""
        phase = "decode" if verify is not None else batch.phase
        seconds = time.perf_counter() - started
        self.phase_seconds[phase] += seconds
        self.phase_steps[phase] += 1
        if phase == "decode":
            tokens = sum(verify.counts) if verify is not None else batch.size  # no fillers
            self.forwarded_tokens["decode"] += tokens
            if self.speculator is not None:
                self.speculator.observe_step(tokens, seconds)
            return
        self.forwarded_tokens["decode"] += batch.decode_rows
        self.forwarded_tokens["prefill"] += sum(batch.extend_lens[:batch.size - batch.decode_rows])

    @property
    def busy_seconds(self) -> float:
        return sum(self.phase_seconds.values())
