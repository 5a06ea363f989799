"""Embeddings of a decoder model served with --is-embedding: last-token pooling of the final
hidden state (after the model's final norm), L2-normalised, as SGLang pools such models."""

from __future__ import annotations

import torch

from minisgl.engine.forward import to_host


def last_token_embeddings(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Host copy of the chosen rows of `hidden` [rows of the batch's last tokens, hidden],
    in float32 with unit L2 norm. With tp > 1 the final hidden state is whole on every rank
    (the row-parallel layers all-reduce), so rank 0 alone pools."""
    pooled = hidden.index_select(0, rows).float()
    return to_host(torch.nn.functional.normalize(pooled, p=2.0, dim=-1))
