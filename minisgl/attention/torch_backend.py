"""Torch paged attention. On CPU with the compiled kernels, every batch is one kernel call that
reads K/V in place: each token attends to the first position + 1 locations of its request's
page-table row (a decode token is the case of one token per request), which beats SDPA's
fused CPU kernel on prefill too (BENCHMARKS.md). Otherwise (no compiler, or CUDA without
FlashInfer): SDPA per request for prefill, grouped matmuls over gathered K/V for decode, and a
mixed batch runs both: its prefill tokens, then its decode tokens.

On CPU, SDPA with a single query token is slower than two batched matmuls, and the gather in
front of those matmuls moves about as many bytes as the weights at large batches, which the
kernel avoids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend
from minisgl.core import Batch
from minisgl.kernels import cpu_kernels
from minisgl.kvcache import KVPool


@dataclass
class DecodeMetadata:
    rows: torch.Tensor  # [batch] page-table rows
    seq_lens: torch.Tensor  # [batch] int64
    max_len: int
    locations: torch.Tensor | None = None  # [batch, max_len] int64, padding at the dummy page
    padding: torch.Tensor | None = None  # [1, batch, 1, max_len] True past seq_len
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its padding

    def materialize(self, page_table: torch.Tensor, dummy_loc: int) -> None:
        """Gather the location rows: done by the first layer, on the engine thread (the
        gather can be large enough to be parallel, and only that thread may run parallel work:
        see engine.stream.CpuStream)."""
        padding = torch.arange(self.max_len, device=page_table.device)[None, :] >= \
            self.seq_lens[:, None]
        self.locations = page_table[self.rows, : self.max_len].masked_fill(padding, dummy_loc).long()
        self.padding = padding[None, :, None, :]

    def padding_for(self, window: int) -> torch.Tensor:
        """The padding, plus (with a window) the keys before each row's window."""
        if not window or self.max_len <= window:
            return self.padding
        if window not in self.windowed:
            positions = torch.arange(self.max_len, device=self.seq_lens.device)
            early = positions[None, :] < (self.seq_lens - window)[:, None]
            self.windowed[window] = self.padding | early[None, :, None, :]
        return self.windowed[window]


@dataclass
class KernelMetadata:
    """Any batch for the CPU kernel: each token attends to the first position + 1 locations of
    its request's page-table row (a decode batch: one token per row)."""

    rows: list[int]  # per request, its page-table row
    extend_lens: list[int]  # per request, its new tokens
    positions: torch.Tensor  # [tokens]
    max_len: int
    locations: torch.Tensor | None = None  # [requests, max_len] int64, read up to each length
    token_rows: torch.Tensor | None = None  # [tokens] int64, an index into rows
    token_lens: torch.Tensor | None = None  # [tokens] int64: position + 1
    windowed: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=dict)  # window -> view()'s answer

    def materialize(self, page_table: torch.Tensor) -> None:
        """On the engine thread, by the first layer (see DecodeMetadata.materialize)."""
        if len(self.rows) == 1:  # one request (a stream's decode steps): a slice, no gather
            row = self.rows[0]
            self.locations = page_table[row:row + 1, : self.max_len].long()
            self.token_rows = torch.zeros(len(self.positions), dtype=torch.int64)
        else:
            self.locations = page_table[self.rows, : self.max_len].long()
            self.token_rows = torch.repeat_interleave(torch.arange(len(self.rows)),
                                                      torch.tensor(self.extend_lens))
        self.token_lens = self.positions.long() + 1

    def view(self, window: int, page_table: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(locations, lengths, rows) for the kernel: each token reads the first `length`
        locations of its row. With a window the kernel still reads from each row's start, so
        every token gets a row of its own that starts at its window's first key."""
        if self.locations is None:
            self.materialize(page_table)
        if not window or self.max_len <= window:
            return self.locations, self.token_lens, self.token_rows
        if window not in self.windowed:
            starts = (self.token_lens - window).clamp(min=0)
            keys = (starts[:, None] + torch.arange(window)).clamp(max=page_table.shape[1] - 1)
            rows = torch.tensor(self.rows)[self.token_rows]
            self.windowed[window] = (page_table[rows[:, None], keys].long(),
                                     self.token_lens.clamp(max=window),
                                     torch.arange(len(rows)))
        return self.windowed[window]


@dataclass
class PrefillSegment:
    """`count` requests of `length` new tokens each, adjacent in the flat token batch from
    row `start`. A request with a cached prefix is alone in its segment and carries its
    locations ([seq_len]) to read the prefix back; requests without one are batched."""

    start: int
    count: int
    length: int
    cached_len: int = 0
    locations: torch.Tensor | None = None
    # (window, scores computed in full) -> _mask()
    masks: dict[tuple[int, bool], torch.Tensor | None] = field(default_factory=dict)

    @property
    def end(self) -> int:
        return self.start + self.count * self.length


@dataclass
class MixedMetadata:
    """A mixed batch: prefill segments over the first `prefill_tokens` tokens, then one
    decode token per running request."""

    prefill: list[PrefillSegment]
    decode: DecodeMetadata
    prefill_tokens: int


class TorchBackend(AttentionBackend):
    def __init__(self, kv_pool: KVPool, page_table: torch.Tensor, scale: float,
                 windows: tuple[int, ...] = (), softcap: float = 0.0) -> None:
        super().__init__(kv_pool, page_table, scale, windows, softcap)
        on_cpu = page_table.device.type == "cpu"
        self.kernels = cpu_kernels() if on_cpu else None
        self._flash = (getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
                       if on_cpu else None)

    def prepare_metadata(self, batch: Batch) -> None:
        if self.kernels is not None:
            batch.attn_metadata = KernelMetadata(batch.table_rows, batch.extend_lens,
                                                 batch.input_positions, max(batch.seq_lens))
            return
        if batch.is_decode:
            batch.attn_metadata = self._decode_metadata(batch.table_rows, batch.seq_lens)
            return
        n = batch.size - batch.decode_rows  # prefill rows
        segments = self._prefill_segments(batch.table_rows[:n], batch.cached_lens[:n],
                                          batch.seq_lens[:n])
        if batch.decode_rows == 0:
            batch.attn_metadata = segments
            return
        decode = self._decode_metadata(batch.table_rows[n:], batch.seq_lens[n:])
        batch.attn_metadata = MixedMetadata(segments, decode, sum(batch.extend_lens[:n]))

    def _prefill_segments(self, table_rows: list[int], cached_lens: list[int],
                          seq_lens: list[int]) -> list[PrefillSegment]:
        segments: list[PrefillSegment] = []
        start = 0
        for row, cached, seq_len in zip(table_rows, cached_lens, seq_lens):
            length = seq_len - cached
            if cached > 0:
                segments.append(PrefillSegment(start, 1, length, cached,
                                               self.page_table[row, :seq_len].clone()))
            elif segments and segments[-1].locations is None and segments[-1].length == length:
                segments[-1].count += 1
            else:
                segments.append(PrefillSegment(start, 1, length))
            start += length
        return segments

    def _decode_metadata(self, table_rows: list[int], seq_lens: list[int]) -> DecodeMetadata:
        device = self.page_table.device
        return DecodeMetadata(torch.tensor(table_rows, device=device),
                              torch.tensor(seq_lens, device=device), max(seq_lens))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        out = self._forward(q, k, v, layer_id, batch, sinks)
        if batch.image_blocks is not None:
            return self.attend_image_blocks(q, out, layer_id, batch)
        return out

    def _forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                 batch: Batch, sinks: torch.Tensor | None) -> torch.Tensor:
        meta, window = batch.attn_metadata, self.window(layer_id)
        if isinstance(meta, KernelMetadata):
            k_cache, v_cache = self.kv_pool.layer(layer_id)
            k_scales, v_scales = self.kv_pool.layer_scales(layer_id)
            if self.kv_pool.layout.latent:  # the values are in the keys' rows
                self.kernels.store_kv_(k_cache, k_cache, batch.out_loc, k, k, k_scales, k_scales)
            else:
                self.kernels.store_kv_(k_cache, v_cache, batch.out_loc, k, v, k_scales, v_scales)
            locations, lens, rows = meta.view(window, self.page_table)
            out = self.kernels.decode_attention(q.contiguous(), k_cache, v_cache, locations,
                                                lens, self.scale, rows, self.softcap, sinks,
                                                k_scales, v_scales)
            return out.view(q.shape[0], -1)
        self.kv_pool.store(layer_id, batch.out_loc, k, v)
        if batch.is_decode:
            return self._decode(q, layer_id, meta, window, sinks)
        if not isinstance(meta, MixedMetadata):
            return self._prefill(q, k, v, layer_id, meta, window, sinks)
        split = meta.prefill_tokens
        return torch.cat((self._prefill(q[:split], k[:split], v[:split], layer_id, meta.prefill,
                                        window, sinks),
                          self._decode(q[split:], layer_id, meta.decode, window, sinks)))

    def attend_rows(self, q: torch.Tensor, layer_id: int, batch: Batch, rows: torch.Tensor
                    ) -> torch.Tensor:
        """The queries of the batch's token `rows` alone over layer `layer_id`'s K/V as already
        stored (a KV-sharing layer's), through the CPU kernel (KernelMetadata batches)."""
        meta = batch.attn_metadata
        assert isinstance(meta, KernelMetadata) and self.kernels is not None
        locations, lens, token_rows = meta.view(self.window(layer_id), self.page_table)
        out = self.kernels.decode_attention(q.contiguous(), *self.kv_pool.layer(layer_id),
                                            locations, lens.index_select(0, rows), self.scale,
                                            token_rows.index_select(0, rows), self.softcap, None,
                                            *self.kv_pool.layer_scales(layer_id))
        return out.view(q.shape[0], -1)

    def _decode(self, q: torch.Tensor, layer_id: int, meta: DecodeMetadata, window: int,
                sinks: torch.Tensor | None) -> torch.Tensor:
        if meta.locations is None:
            meta.materialize(self.page_table, self.kv_pool.dummy_loc)
        bs, max_len = meta.locations.shape
        # [kv, bs * max_len, d] -> [kv * bs, max_len, d]: contiguous, no transpose copies
        keys, values = self.kv_pool.gather(layer_id, meta.locations.view(-1))
        num_heads, head_dim, value_dim = q.shape[1], q.shape[2], values.shape[2]
        num_kv = keys.shape[0]
        group = num_heads // num_kv
        keys = keys.view(num_kv * bs, max_len, head_dim)
        values = values.view(num_kv * bs, max_len, value_dim)
        q = (q * self.scale).view(bs, num_kv, group, head_dim).transpose(0, 1)
        scores = self._capped(torch.bmm(q.reshape(num_kv * bs, group, head_dim),
                                        keys.transpose(1, 2)))
        scores = scores.view(num_kv, bs, group, max_len).masked_fill_(meta.padding_for(window),
                                                                float("-inf"))
        per_head = None if sinks is None else sinks.view(num_kv, 1, group, 1)
        probs = softmax_with_sinks(scores, per_head).to(q.dtype)
        out = torch.bmm(probs.view(num_kv * bs, group, max_len), values)
        return out.view(num_kv, bs, group, value_dim).transpose(0, 1).reshape(bs, -1)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                 segments: list[PrefillSegment], window: int, sinks: torch.Tensor | None
                 ) -> torch.Tensor:
        heads, dim, value_dim = q.shape[1], q.shape[2], v.shape[2]
        out = torch.empty(q.shape[0], heads * value_dim, dtype=q.dtype, device=q.device)
        scored = bool(self.softcap) or sinks is not None  # the scores in full, not SDPA
        for seg in segments:
            if seg.length == 0:
                continue
            n, new = seg.count, seg.length
            qs = q[seg.start:seg.end].view(n, new, heads, dim).transpose(1, 2)
            if seg.locations is None:  # [n, kv_heads, new, dim]
                ks = k[seg.start:seg.end].view(n, new, -1, dim).transpose(1, 2)
                vs = v[seg.start:seg.end].view(n, new, -1, value_dim).transpose(1, 2)
            else:
                ks, vs = (x[None] for x in self.kv_pool.gather(layer_id, seg.locations))
            if (window, scored) not in seg.masks:
                seg.masks[window, scored] = self._mask(new, seg.cached_len, window, q.dtype,
                                                       q.device, scored)
            mask = seg.masks[window, scored]
            o = self._attend(qs, ks, vs, mask, sinks)  # [n, heads, new, dim]
            out[seg.start:seg.end] = o.transpose(1, 2).reshape(n * new, heads * value_dim)
        return out

    def _mask(self, new: int, cached_len: int, window: int, dtype: torch.dtype,
              device: torch.device, scored: bool) -> torch.Tensor | None:
        """Which keys `new` queries after `cached_len` cached tokens see: None where plain
        causality says it (no prefix, no window reaching back); else True = attend, or (the
        fused CPU kernel wants it) 0 / -inf, shaped [1, 1, new, cached_len + new]. Scores
        computed in full (`scored`: soft-capped, or with sinks) always get the boolean mask."""
        if cached_len == 0 and (not window or new <= window) and not scored:
            return None
        query_pos = torch.arange(new, device=device)[:, None] + cached_len
        key_pos = torch.arange(cached_len + new, device=device)[None, :]
        allowed = key_pos <= query_pos
        if window:
            allowed &= key_pos > query_pos - window
        if self._flash is None or scored:
            return allowed
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(
            ~allowed, float("-inf"))[None, None]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of q [n, heads, new, dim] over k/v [n, kv_heads, len, dim]; `mask`
        (_mask) replaces causality when a cached prefix precedes the queries or a window
        limits them."""
        if self.softcap or sinks is not None:
            return self._attend_scores(q, k, v, mask, sinks)
        if self._flash is None or v.shape[-1] != q.shape[-1]:  # the fused kernel: one size
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                  scale=self.scale, enable_gqa=True)
        # NOTE: SDPA's dispatcher sends GQA / bf16 on CPU to its unfused math path; its fused
        # CPU kernel wants equal head counts and an additive mask.
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self._flash(q, k, v, 0.0, mask is None, attn_mask=mask, scale=self.scale)[0]

    def _capped(self, scores: torch.Tensor) -> torch.Tensor:
        if not self.softcap:
            return scores
        return torch.tanh(scores / self.softcap) * self.softcap

    def _attend_scores(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       allowed: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        """_attend with soft-capped scores or sinks, which SDPA does not compute: the scores
        in full ([n, heads, new, len]; `allowed` is the boolean mask, [new, len])."""
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = self._capped(torch.matmul(q * self.scale, k.transpose(-1, -2)))
        scores = scores.masked_fill(~allowed, float("-inf"))
        per_head = None if sinks is None else sinks.view(1, -1, 1, 1)
        probs = softmax_with_sinks(scores, per_head).to(q.dtype)
        return torch.matmul(probs, v)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dimension in float32, with `sinks` (broadcast to scores' shape
    but the last dimension, which is 1) as one more logit each that takes its share of the
    probability and is then dropped."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    column = sinks.float().expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores.float(), column), dim=-1), dim=-1)[..., :-1]
