"""Torch paged attention: SDPA per request for prefill; for decode a compiled CPU kernel that
reads K/V in place, or (without a compiler, or on CUDA) grouped matmuls over gathered K/V.

On CPU, SDPA with a single query token is ~3x slower than two batched matmuls; the gather in
front of those matmuls moves as many bytes as the weights at batch 64, which the kernel avoids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend
from minisgl.kernels import cpu_kernels
from minisgl.core import Batch

if TYPE_CHECKING:
    from minisgl.kvcache import KVPool


@dataclass
class DecodeMetadata:
    rows: torch.Tensor  # [batch] page-table rows
    seq_lens: torch.Tensor  # [batch] int64
    max_len: int
    locations: torch.Tensor | None = None  # [batch, max_len] int64, padding at the dummy page
    padding: torch.Tensor | None = None  # [1, batch, 1, max_len] True past seq_len

    def materialize(self, page_table: torch.Tensor, dummy_loc: int) -> None:
        """Gather the location rows: done by the first layer, on the engine thread (the
        gather can be large enough to be parallel, and only that thread may run parallel work:
        see engine.stream.CpuStream)."""
        padding = torch.arange(self.max_len, device=page_table.device)[None, :] >= \
            self.seq_lens[:, None]
        self.locations = page_table[self.rows, : self.max_len].masked_fill(padding, dummy_loc).long()
        self.padding = padding[None, :, None, :]


@dataclass
class PrefillSegment:
    start: int  # first row of this request in the flat token batch
    end: int
    cached_len: int
    locations: torch.Tensor | None  # [seq_len] when a cached prefix must be read back


class TorchBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, page_table: torch.Tensor, scale: float) -> None:
        super().__init__(kv_pool, page_table, scale)
        self.kernels = cpu_kernels() if page_table.device.type == "cpu" else None

    def prepare_metadata(self, batch: Batch) -> None:
        if batch.is_decode:
            batch.attn_metadata = self._decode_metadata(batch)
            return
        segments, start = [], 0
        for row, cached, seq_len in zip(batch.table_rows, batch.cached_lens, batch.seq_lens):
            end = start + seq_len - cached
            locations = self.page_table[row, :seq_len].clone() if cached > 0 else None
            segments.append(PrefillSegment(start, end, cached, locations))
            start = end
        batch.attn_metadata = segments

    def _decode_metadata(self, batch: Batch) -> DecodeMetadata:
        device = self.page_table.device
        return DecodeMetadata(torch.tensor(batch.table_rows, device=device),
                              torch.tensor(batch.seq_lens, device=device), max(batch.seq_lens))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        k_cache, v_cache = self.kv_pool.layer(layer_id)
        k_cache.index_copy_(1, batch.out_loc, k.transpose(0, 1))
        v_cache.index_copy_(1, batch.out_loc, v.transpose(0, 1))
        if batch.is_decode:
            return self._decode(q, k_cache, v_cache, batch.attn_metadata)
        return self._prefill(q, k, v, k_cache, v_cache, batch.attn_metadata)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: DecodeMetadata) -> torch.Tensor:
        if meta.locations is None:
            meta.materialize(self.page_table, self.kv_pool.dummy_loc)
        if self.kernels is not None:
            out = self.kernels.decode_attention(q.contiguous(), k_cache, v_cache, meta.locations,
                                                meta.seq_lens, self.scale)
            return out.view(q.shape[0], -1)
        bs, max_len = meta.locations.shape
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv = k_cache.shape[0]
        group = num_heads // num_kv
        flat = meta.locations.view(-1)
        # [kv, bs * max_len, d] -> [kv * bs, max_len, d]: contiguous, no transpose copies
        keys = k_cache.index_select(1, flat).view(num_kv * bs, max_len, head_dim)
        values = v_cache.index_select(1, flat).view(num_kv * bs, max_len, head_dim)
        q = (q * self.scale).view(bs, num_kv, group, head_dim).transpose(0, 1)
        scores = torch.bmm(q.reshape(num_kv * bs, group, head_dim), keys.transpose(1, 2))
        scores = scores.view(num_kv, bs, group, max_len).masked_fill_(meta.padding, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.bmm(probs.view(num_kv * bs, group, max_len), values)
        return out.view(num_kv, bs, group, head_dim).transpose(0, 1).reshape(bs, -1)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, segments: list[PrefillSegment]) -> torch.Tensor:
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        for seg in segments:
            if seg.end == seg.start:
                continue
            qs = q[seg.start:seg.end].transpose(0, 1)
            if seg.locations is None:
                ks = k[seg.start:seg.end].transpose(0, 1)
                vs = v[seg.start:seg.end].transpose(0, 1)
                mask, causal = None, True
            else:
                ks = k_cache.index_select(1, seg.locations)
                vs = v_cache.index_select(1, seg.locations)
                new = seg.end - seg.start
                query_pos = torch.arange(new, device=q.device)[:, None] + seg.cached_len
                mask = torch.arange(ks.shape[1], device=q.device)[None, :] <= query_pos
                causal = False
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal,
                                               scale=self.scale, enable_gqa=True)
            out[seg.start:seg.end] = o.transpose(0, 1).reshape(seg.end - seg.start, -1)
        return out
