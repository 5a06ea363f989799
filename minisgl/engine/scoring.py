"""Input-token logprobs: the logits of scored prompt rows, a slice at a time."""

from __future__ import annotations

from typing import Callable

import torch

from minisgl.engine.forward import InputLogprobRows, InputLogprobs, to_host

SCORE_SLICE = 1024  # prompt rows whose logits exist at once


def score_rows(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
               rows: InputLogprobRows | None) -> InputLogprobs | None:
    """Every rank runs the LM head (a collective with tp > 1); rank 0 (`rows` given) keeps the
    log-softmax at each target and its top k."""
    values, top_values, top_ids = [], [], []
    for begin in range(0, len(hidden), SCORE_SLICE):
        logits = lm_head(hidden[begin:begin + SCORE_SLICE])
        if rows is None:
            continue
        logp = torch.log_softmax(logits.float(), dim=-1)
        targets = rows.targets[begin:begin + SCORE_SLICE, None]
        values.append(logp.gather(1, targets).squeeze(1))
        if rows.top_k > 0:
            top = logp.topk(rows.top_k, dim=-1)
            top_values.append(top.values)
            top_ids.append(top.indices)
    if rows is None:
        return None
    top = (to_host(torch.cat(top_values)), to_host(torch.cat(top_ids))) if top_ids else None
    return InputLogprobs(values=to_host(torch.cat(values)), top=top)
