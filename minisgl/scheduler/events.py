"""What the scheduler tells the outside: plain values, never a live request.

`add_requests` answers each queued request with a `Queued`; every step then sends a list of
`ReqEvent`s to the sink, one per request with news (a token, a finish, or both); a verify
step of speculative decoding may give a request several, one per token, in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl.core import SamplingParams


@dataclass(frozen=True, slots=True)
class Queued:
    """A request the scheduler accepted: its rid (made up when none was given) and its
    sampling parameters with max_new_tokens resolved."""

    rid: str
    params: SamplingParams


@dataclass(frozen=True, slots=True)
class ReqEvent:
    """One step's news for one request."""

    rid: str
    token: int | None  # the new output token, or None (a finish without one)
    finish_reason: dict[str, Any] | None = None  # set once: the request's last event
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    logprob: float | None = None  # of `token`, when logprobs were asked for
    top_logprobs: list[tuple[float, int]] | None = None  # (logprob, token id), best first
    # with the first output, when logprobs were asked for: one per scored prompt position
    input_logprobs: list[float] | None = None
    input_top_logprobs: list[list[tuple[float, int]]] | None = None
    # a speculating request's running totals: (verify steps, drafted, accepted drafts)
    spec: tuple[int, int, int] | None = None
    # an embedding request's answer: [hidden] float32 on the host, L2-normalised
    embedding: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
