"""The attention backend interface."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minisgl.core import Batch
from minisgl.kvcache import KVPool


class AttentionBackend(ABC):
    """Reads and writes the paged KV pool. `prepare_metadata` runs on the host when a batch is
    scheduled; `forward` runs inside the model, once per layer."""

    def __init__(self, kv_pool: KVPool, page_table: torch.Tensor, scale: float,
                 windows: tuple[int, ...] = (), softcap: float = 0.0) -> None:
        self.kv_pool = kv_pool
        self.page_table = page_table  # [rows, context_len]: KV location of each token position
        self.scale = scale
        # per layer, the attention window: a query at position p sees keys (p - window, p];
        # 0 (or no entry) is full causal attention
        self.windows = windows
        # > 0: every score s (scale included) becomes softcap * tanh(s / softcap) (Gemma 2)
        self.softcap = softcap

    def window(self, layer_id: int) -> int:
        return self.windows[layer_id] if layer_id < len(self.windows) else 0

    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Set batch.attn_metadata from batch.table_rows / cached_lens / seq_lens."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [tokens, heads, head_dim], k/v: [tokens, kv_heads, head_dim] of the new tokens.
        Stores k/v at batch.out_loc and returns [tokens, heads * head_dim]. sinks: [heads], a
        logit per query head that joins each softmax's denominator and adds nothing to the
        output (gpt-oss's attention sinks)."""

    def attend_image_blocks(self, q: torch.Tensor, out: torch.Tensor, layer_id: int,
                            batch: Batch) -> torch.Tensor:
        """Gemma 3: an image's tokens see the whole image, not only its tokens before them.
        Each of the batch's `image_blocks` (its tokens' K/V already stored) has its queries'
        rows of `out` computed again over the request's keys up to the image's end (within the
        layer's window, which reaches forward too). Returns `out`."""
        window = self.window(layer_id)
        for first_row, table_row, start, end in batch.image_blocks or ():
            count = end - start
            keys, values = self.kv_pool.gather(layer_id, self.page_table[table_row, :end].long())
            group = q.shape[1] // keys.shape[0]
            queries = q[first_row:first_row + count].transpose(0, 1)  # [heads, count, dim]
            scores = torch.matmul(queries * self.scale,
                                  keys.repeat_interleave(group, 0).transpose(1, 2))
            if self.softcap:
                scores = torch.tanh(scores / self.softcap) * self.softcap
            if window:
                query_pos = torch.arange(start, end, device=q.device)[:, None]
                key_pos = torch.arange(end, device=q.device)[None, :]
                scores = scores.masked_fill(query_pos - key_pos >= window, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            attended = torch.matmul(probs, values.repeat_interleave(group, 0))
            out[first_row:first_row + count] = attended.transpose(0, 1).reshape(count, -1)
        return out
