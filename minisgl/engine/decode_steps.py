"""Continuous decode steps: one launched forward that runs several decode steps of the same
rows back to back on the engine thread (`--num-continuous-decode-steps`, as SGLang's flag).

Why: at one stream on a CPU, every token costs the event loop a scheduling pass, a launch, a
wake-up, the results' bookkeeping, the detokenizer and an SSE write, on the same two cores
the forward runs on, and the engine thread waits for the GIL behind that work. A run of N
steps pays those once for N tokens (BENCHMARKS.md, "Continuous decode steps").

Each step is the decode step the scheduler would have launched next: the same rows, each one
position further, reading the token the step before wrote into the token pool, with KV
locations the scheduler reserved for all N when it built the run (`ForwardInput.step_locations`).
Sampling arguments that change from one step to the next (penalties over the history,
min_new_tokens' bans) keep a request out of runs, so every step's output equals a lone step's.
The run ends early once every row has sampled one of its stop ids.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from minisgl.core import Batch
from minisgl.engine.forward import ForwardInput, ForwardOutput


def nth_step(fwd: ForwardInput, n: int, plan: Callable[[Batch], None]) -> ForwardInput:
    """Step `n` (0 is `fwd` itself) of a run: every row `n` positions further."""
    if n == 0:
        return fwd
    first, locations = fwd.batch, fwd.step_locations
    assert locations is not None
    batch = Batch("decode", first.size, table_rows=first.table_rows,
                  cached_lens=[c + n for c in first.cached_lens],
                  seq_lens=[s + n for s in first.seq_lens], extend_lens=first.extend_lens,
                  input_positions=first.input_positions + n,
                  out_loc=locations[:, n].contiguous(), lora_slots=first.lora_slots)
    plan(batch)
    return dataclasses.replace(fwd, batch=batch, load_indices=fwd.load_indices + n,
                               write_indices=fwd.write_indices + n, steps=1, lora_loads=[],
                               kv_moves=None)


def run_steps(fwd: ForwardInput, forward: Callable[[ForwardInput], ForwardOutput],
              plan: Callable[[Batch], None]) -> ForwardOutput:
    """The run's outputs in a verify step's form: token_ids [B, n], counts [B] (n each),
    logprobs [B, n] and top_logprobs [B, n, K] when asked, n the steps that ran."""
    assert fwd.stop_ids is not None
    outputs: list[ForwardOutput] = []
    stopped = [False] * fwd.batch.size
    for n in range(fwd.steps):
        out = forward(nth_step(fwd, n, plan))
        outputs.append(out)
        assert out.token_ids is not None
        stopped = [done or token in stops for done, token, stops
                   in zip(stopped, out.token_ids.tolist(), fwd.stop_ids)]
        if all(stopped):
            break

    def stacked(part: Callable[[ForwardOutput], torch.Tensor | None]) -> torch.Tensor | None:
        """A field of every step's output, [B, n, ...] (None where the steps gave none)."""
        parts = [part(o) for o in outputs]
        return None if parts[0] is None else torch.stack(parts, dim=1)  # type: ignore[misc]

    tops = None
    if outputs[0].top_logprobs is not None:
        tops = (stacked(lambda o: o.top_logprobs[0]), stacked(lambda o: o.top_logprobs[1]))
    return ForwardOutput(token_ids=stacked(lambda o: o.token_ids),
                         logprobs=stacked(lambda o: o.logprobs), top_logprobs=tops,  # type: ignore
                         counts=torch.full((fwd.batch.size,), len(outputs), dtype=torch.int64))
