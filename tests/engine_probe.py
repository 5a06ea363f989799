"""Driving an engine by hand in tests: one prefill's logits, through the real launch path
(every tensor-parallel rank runs it)."""

from __future__ import annotations

import torch

from minisgl.core import Batch
from minisgl.engine import Engine, ForwardInput, StepMessage


def prefill_logits(engine: Engine, ids: list[int], row: int = 0) -> torch.Tensor:
    """Logits [len(ids), vocab] (float32) of one prefill of `ids` in slot `row`, KV at
    locations 0..len(ids)-1. Only on an engine that serves nothing else (it overwrites that
    slot and those KV locations)."""
    n, ctx, device = len(ids), engine.context_len, engine.device
    positions = torch.arange(n)
    load = row * ctx + positions
    token_ids = torch.tensor(ids, dtype=torch.int32)
    engine.token_pool[row, :n] = token_ids.to(device)
    engine.page_table.view(-1)[load.to(device)] = positions.to(device, torch.int32)
    batch = Batch("prefill", 1, table_rows=[row], cached_lens=[0], seq_lens=[n],
                  extend_lens=[n], input_positions=positions.to(device),
                  out_loc=positions.to(device))
    engine.plan_batch(batch)
    write = torch.tensor([engine.dummy_row * ctx])
    message = StepMessage("prefill", 1, [row], [0], [n], [n], positions, positions, load, write,
                          None, logits_only=True, token_writes=[(row, 0, token_ids)],
                          location_writes=[(load, positions)])
    fwd = ForwardInput(batch=batch, load_indices=load.to(device), write_indices=write.to(device),
                       logit_rows=None, sample_args=None, message=message, logits_only=True)
    return engine.launch(fwd).result().logits
