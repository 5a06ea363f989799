"""FlashInfer paged attention (CUDA): prefill of ragged new tokens over the paged KV cache
(cached prefix included) and decode, eager or inside CUDA graphs.

KV layout. The pool keeps each layer's K (and V) head-major, [kv_heads, locations, head_dim],
page p owning locations [p * page_size, (p + 1) * page_size). That is *not* the memory of a
contiguous HND cache ([pages, kv_heads, page_size, head_dim]), but it is the same tensor seen
through other strides: view it as [kv_heads, pages, page_size, head_dim] and permute to
[pages, kv_heads, page_size, head_dim]; the strides become (page_size * head_dim,
locations * head_dim, head_dim, 1). FlashInfer's paged kernels address K/V through
`paged_kv_t`, whose stride_page / stride_h / stride_n come from the cache tensor's strides
(K and V must have identical strides, which they do), so the pool needs no copy and no change.
We pin the "fa2" kernels, which all use `paged_kv_t`; the Hopper "fa3" prefill is not used.

When plan() runs. A wrapper's plan() writes device buffers (indptr, indices, last_page_len, the
int workspace copied from a pinned host buffer) on the *current* stream and never waits. In the
overlap loop batch N+1 is scheduled while batch N still runs on the engine stream, so planning
in `prepare_metadata` (scheduler side) would overwrite buffers batch N is reading. Hence:
`prepare_metadata` builds only small host arrays; `plan` runs on the engine stream when the
forward starts (lazily at the first attention call, or from GraphRunner before a replay), so it
is stream-ordered after batch N. Page ids are gathered from the device page table there too
(`page_indices`): only O(batch) integers cross PCIe per step, and nothing synchronises.

Sliding windows and soft-capping. A plan fixes its window (`window_left`, the keys before the
query's own) and soft-cap, so each distinct window of the model's layers (Gemma: a sliding one
and 0 for the global layers) gets its own wrappers, each with its own int workspace: every
variant is planned before the first layer runs, and a plan writes its schedule there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from minisgl.attention.base import AttentionBackend
from minisgl.core import Batch
from minisgl.kernels.cuda import FLASHINFER_HEAD_DIMS, HALF_DTYPES
from minisgl.kvcache import KVPool

FLOAT_WORKSPACE_BYTES = 128 * 1024 * 1024  # split-kv partial results (FlashInfer's advice)
INT_WORKSPACE_BYTES = 8 * 1024 * 1024  # plan info; shared by every wrapper (plans are ordered)
OPTIONS = ("num_qo_heads", "use_tensor_cores", "workspace_bytes")


@dataclass
class PagedMetadata:
    """One batch as FlashInfer wants it. Host tensors (pinned on CUDA); built by
    `prepare_metadata`, turned into device state by `FlashInferBackend.plan`."""

    is_decode: bool
    batch_size: int  # rows, padding rows included
    num_pages: int  # kv_indptr[-1]: page ids over the whole batch
    kv_indptr: torch.Tensor  # [B + 1] int32: request b owns page ids [kv_indptr[b], kv_indptr[b+1])
    last_page_len: torch.Tensor  # [B] int32, in [1, page_size]
    qo_indptr: torch.Tensor | None  # [B + 1] int32 over the new tokens; None for decode
    gather: torch.Tensor  # [2, B] int64: (flat page_table offset of page 0 minus kv_indptr[b] *
    #                       page_size, page count) -> see page_indices
    wrappers: dict[int, Any] | None = None  # window -> its planned wrapper, set by plan()
    indices: torch.Tensor | None = None  # device page ids, kept alive while the batch runs


def build_paged_metadata(table_rows: list[int], seq_lens: list[int], extend_lens: list[int],
                         page_size: int, context_len: int, is_decode: bool,
                         pin: bool = False) -> PagedMetadata:
    """Host-side FlashInfer arrays for requests in page_table rows `table_rows`, each attending
    over positions [0, seq_len) of which the last extend_len are new. Pure torch on the CPU."""
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    pages = (seq + page_size - 1) // page_size
    kv_indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    torch.cumsum(pages, 0, out=kv_indptr[1:])
    last = seq - (pages - 1) * page_size
    rows = torch.tensor(table_rows, dtype=torch.int64)
    # NOTE: page k of request b sits at page_table[row_b, k * page_size] (positions keep their
    # offset within a page), i.e. flat offset row_b * context_len + k * page_size.
    gather = torch.stack((rows * context_len - kv_indptr[:-1] * page_size, pages))
    qo_indptr = None
    if not is_decode:
        qo_indptr = torch.zeros(len(extend_lens) + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor(extend_lens, dtype=torch.int64), 0, out=qo_indptr[1:])
        qo_indptr = qo_indptr.to(torch.int32)
    meta = PagedMetadata(is_decode=is_decode, batch_size=len(seq_lens),
                         num_pages=int(kv_indptr[-1]), kv_indptr=kv_indptr.to(torch.int32),
                         last_page_len=last.to(torch.int32), qo_indptr=qo_indptr, gather=gather)
    if pin:
        meta.kv_indptr = meta.kv_indptr.pin_memory()
        meta.last_page_len = meta.last_page_len.pin_memory()
        meta.gather = meta.gather.pin_memory()
        if meta.qo_indptr is not None:
            meta.qo_indptr = meta.qo_indptr.pin_memory()
    return meta


def page_indices(page_table: torch.Tensor, gather: torch.Tensor, num_pages: int,
                 page_size: int) -> torch.Tensor:
    """Page ids [num_pages] int32 of a batch, request after request, read from `page_table`
    (per-token locations) on its device. `gather` is PagedMetadata.gather on that device. No
    host sync: the output size is given."""
    base = torch.repeat_interleave(gather[0], gather[1], output_size=num_pages)
    flat = base + torch.arange(num_pages, device=page_table.device) * page_size
    locations = page_table.view(-1).index_select(0, flat)
    if page_size == 1:
        return locations
    return torch.div(locations, page_size, rounding_mode="floor")


def prefill_graph_workspace(rows: int, width: int, qo_heads: int, kv_heads: int,
                            head_dim: int, sms: int) -> int:
    """Float workspace bytes FlashInfer's prefill plan may take in CUDA-graph mode for `rows`
    rows of `width` tokens (an upper bound): it always splits the KV there, and keeps partial
    outputs and sums for a padded count of query tiles (up to 128 rows of packed heads each):
    the larger of two blocks per SM over the KV heads and the rows' own tiles (its
    scheduler.cuh), plus slack for its alignment."""
    tile = 128
    tiled_rows = max(2 * sms // kv_heads * tile,
                     rows * width * (qo_heads // kv_heads) + rows * tile)
    return qo_heads * tiled_rows * (head_dim + 1) * 4 + (16 << 20)


def paged_view(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """[kv_heads, locations, head_dim] -> strided HND view [pages, kv_heads, page_size, head_dim]
    of the same memory: view[p, h, e] is cache[h, p * page_size + e]."""
    heads, locations, head_dim = cache.shape
    return cache.view(heads, locations // page_size, page_size, head_dim).permute(1, 0, 2, 3)


class FlashInferBackend(AttentionBackend):
    """Options: `num_qo_heads` (query heads on this rank; else taken from the first forward),
    `use_tensor_cores` (decode; default: GQA group >= 4), `workspace_bytes` (float workspace)."""

    def __init__(self, kv_pool: KVPool, page_table: torch.Tensor, scale: float,
                 windows: tuple[int, ...] = (), softcap: float = 0.0, **options: Any) -> None:
        super().__init__(kv_pool, page_table, scale, windows, softcap)
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown flashinfer backend option(s): {', '.join(unknown)}")
        try:
            import flashinfer
        except ImportError as exc:
            raise ImportError(
                "--attention-backend flashinfer needs the FlashInfer package: "
                "pip install minisgl[gpu] (or use --attention-backend torch)") from exc
        self._flashinfer = flashinfer
        buffer = kv_pool.buffer  # [2, layers, kv_heads, locations, head_dim]
        if buffer.device.type != "cuda":
            raise ValueError("the flashinfer backend needs the KV pool on a CUDA device")
        if kv_pool.dtype not in HALF_DTYPES:
            raise ValueError(f"flashinfer attention runs in float16/bfloat16, not "
                             f"{kv_pool.dtype}; use --dtype bfloat16 or --attention-backend torch")
        if buffer.dtype not in (*HALF_DTYPES, torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError(f"flashinfer reads KV pages in 16 or 8 bits float, not {buffer.dtype}")
        self.device, self.dtype, self.kv_dtype = buffer.device, kv_pool.dtype, buffer.dtype
        self.page_size = kv_pool.page_size
        self.num_layers, self.num_kv_heads, self.head_dim = (
            buffer.shape[1], buffer.shape[2], buffer.shape[4])
        if self.head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(f"flashinfer attention takes head sizes {FLASHINFER_HEAD_DIMS}, "
                             f"this model's is {self.head_dim}; use --attention-backend torch")
        self.context_len = page_table.shape[1]
        self.num_qo_heads: int | None = options.get("num_qo_heads")
        self._tensor_cores: bool | None = options.get("use_tensor_cores")
        self.float_workspace = torch.zeros(options.get("workspace_bytes", FLOAT_WORKSPACE_BYTES),
                                           dtype=torch.uint8, device=self.device)
        # the distinct windows of the layers (0: none), each planned into its own wrappers
        self.variants = sorted(set(self.windows) | ({0} if len(self.windows) < self.num_layers
                                                    else set()))
        self.int_workspaces = {w: torch.zeros(INT_WORKSPACE_BYTES, dtype=torch.uint8,
                                              device=self.device) for w in self.variants}
        self.paged = [tuple(paged_view(c, self.page_size) for c in kv_pool.layer(i))
                      for i in range(self.num_layers)]
        self.prefill_wrappers = {w: self._wrapper(flashinfer.BatchPrefillWithPagedKVCacheWrapper,
                                                  w) for w in self.variants}
        self.decode_wrappers: dict[int, Any] = {}  # made at the first decode: num_qo_heads
        # (rows, tokens a row, window) -> wrapper: decode (1 token) or a verify step's
        self.graph_wrappers: dict[tuple[int, int, int], Any] = {}
        self._plan_done: dict[int, torch.cuda.Event] = {}  # id(wrapper) -> its last plan
        self._graph_buffers: tuple[torch.Tensor, ...] | None = None

    # ---- wrappers ----------------------------------------------------------------------------

    def _wrapper(self, cls: Any, window: int, **kwargs: Any) -> Any:
        try:  # NOTE: fa2 kernels address K/V through paged_kv_t strides (see module doc)
            wrapper = cls(self.float_workspace, "HND", backend="fa2", **kwargs)
        except TypeError:  # a FlashInfer without the `backend` argument: fa2 is all it has
            wrapper = cls(self.float_workspace, "HND", **kwargs)
        # NOTE: one int workspace per window: every plan and run is ordered on the engine
        # stream, and the variants of one batch are planned before its first layer runs
        wrapper.reset_workspace_buffer(self.float_workspace, self.int_workspaces[window])
        return wrapper

    def _grow_float_workspace(self, nbytes: int) -> None:
        """At least `nbytes` of float workspace for every wrapper made so far and later."""
        if nbytes <= self.float_workspace.numel():
            return
        torch.cuda.synchronize(self.device)  # NOTE: no kernel may still use the old one
        self.float_workspace = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        for wrappers in (self.prefill_wrappers, self.decode_wrappers):
            for window, wrapper in wrappers.items():
                wrapper.reset_workspace_buffer(self.float_workspace, self.int_workspaces[window])

    @property
    def use_tensor_cores(self) -> bool:
        if self._tensor_cores is None:
            assert self.num_qo_heads is not None
            self._tensor_cores = self.num_qo_heads // self.num_kv_heads >= 4
        return self._tensor_cores

    def _decode_wrapper(self, window: int) -> Any:
        if window not in self.decode_wrappers:
            self.decode_wrappers[window] = self._wrapper(
                self._flashinfer.BatchDecodeWithPagedKVCacheWrapper, window,
                use_tensor_cores=self.use_tensor_cores)
        return self.decode_wrappers[window]

    # ---- metadata and plan -------------------------------------------------------------------

    def prepare_metadata(self, batch: Batch) -> None:
        batch.attn_metadata = build_paged_metadata(
            batch.table_rows, batch.seq_lens, batch.extend_lens, self.page_size,
            self.context_len, batch.is_decode, pin=True)

    def plan(self, batch: Batch, graph_bs: int | None = None) -> None:
        """Plan `batch` on the current stream (the engine stream): with the eager prefill or
        decode wrapper, or with the CUDA-graph wrapper captured for `graph_bs` rows of its
        width (decode: 1 token a row; a verify step: `row_tokens`)."""
        meta: PagedMetadata = batch.attn_metadata
        if self.num_qo_heads is None:
            raise RuntimeError("flashinfer: num_qo_heads is unknown before the first forward")
        width = batch.graph_width
        if graph_bs is not None and (meta.batch_size != graph_bs or not width):
            raise ValueError(f"a {meta.batch_size}-row {batch.phase} batch cannot replay the "
                             f"graph captured for {graph_bs} rows")
        gather = meta.gather.to(self.device, non_blocking=True)
        indices = page_indices(self.page_table, gather, meta.num_pages, self.page_size)
        meta.wrappers, meta.indices = {}, indices
        for window in self.variants:
            if graph_bs is not None:
                wrapper = self.graph_wrappers[(graph_bs, width, window)]
            elif meta.is_decode:
                wrapper = self._decode_wrapper(window)
            else:
                wrapper = self.prefill_wrappers[window]
            self._plan(wrapper, meta, indices, window)
            meta.wrappers[window] = wrapper

    def _plan(self, wrapper: Any, meta: PagedMetadata, indices: torch.Tensor,
              window: int) -> None:
        # NOTE: plan() refills this wrapper's pinned host buffer before its async copy; the
        # previous copy from it was queued a step ago and has all but surely finished.
        done = self._plan_done.get(id(wrapper))
        if done is not None and not done.query():
            done.synchronize()
        common = dict(sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.kv_dtype,
                      non_blocking=True)
        if window or self.softcap:  # NOTE: only where the model has them (older FlashInfers)
            common.update(window_left=window - 1 if window else -1,
                          logits_soft_cap=self.softcap or None)
        if meta.is_decode:
            wrapper.plan(meta.kv_indptr, indices, meta.last_page_len, self.num_qo_heads,
                         self.num_kv_heads, self.head_dim, self.page_size,
                         pos_encoding_mode="NONE", **common)
        else:
            wrapper.plan(meta.qo_indptr, meta.kv_indptr, indices, meta.last_page_len,
                         self.num_qo_heads, self.num_kv_heads, self.head_dim, self.page_size,
                         causal=True, **common)
        if done is None:
            done = self._plan_done[id(wrapper)] = torch.cuda.Event()
        done.record()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch, sinks: torch.Tensor | None = None) -> torch.Tensor:
        # NOTE: a model with sinks gets the torch backend (model_loading.attention_for)
        assert sinks is None, "attention sinks are not in the FlashInfer path"
        self.kv_pool.store(layer_id, batch.out_loc, k, v)
        meta: PagedMetadata = batch.attn_metadata
        if meta.wrappers is None:  # eager: plan once per batch, at its first attention layer
            if self.num_qo_heads is None:
                self.num_qo_heads = q.shape[1]
            self.plan(batch)
        out = meta.wrappers[self.window(layer_id)].run(q, self.paged[layer_id])
        out = out.view(q.shape[0], -1)
        if batch.image_blocks is not None:
            return self.attend_image_blocks(q, out, layer_id, batch)
        return out

    # ---- CUDA graphs (used by minisgl.engine.graph.GraphRunner) ------------------------------

    def init_graphs(self, max_bs: int, verify_width: int = 0, verify_rows: int = 0) -> None:
        """Static indptr / indices / last_page_len (and, for verify steps, qo_indptr) buffers,
        shared by every captured size (one graph replays at a time, each after its own plan);
        a float workspace large enough for the verify graphs (before any graph holds it)."""
        if verify_width > 1 and verify_rows > 0:
            assert self.num_qo_heads is not None
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self._grow_float_workspace(prefill_graph_workspace(
                verify_rows, verify_width, self.num_qo_heads, self.num_kv_heads, self.head_dim,
                sms))
        max_pages = max_bs * (-(-self.context_len // self.page_size))
        self._graph_buffers = (
            torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            torch.zeros(max(max_pages, 1), dtype=torch.int32, device=self.device),
            torch.ones(max_bs, dtype=torch.int32, device=self.device),
            torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device))

    def prepare_capture(self, batch: Batch, bs: int) -> None:
        """Make the graph wrapper for `bs` rows of the batch's width (decode, or a verify
        step's prefill-style rows) and plan the (dummy) capture batch with it."""
        if self._graph_buffers is None:
            raise RuntimeError("call init_graphs before capturing")
        indptr, indices, last, qo_indptr = self._graph_buffers
        width = batch.graph_width
        for window in self.variants:  # NOTE: the same batch: they fill the buffers alike
            if (bs, width, window) in self.graph_wrappers:
                continue
            if width == 1:
                wrapper = self._wrapper(
                    self._flashinfer.BatchDecodeWithPagedKVCacheWrapper, window,
                    use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                    paged_kv_indptr_buffer=indptr[: bs + 1], paged_kv_indices_buffer=indices,
                    paged_kv_last_page_len_buffer=last[:bs])
            else:
                wrapper = self._wrapper(
                    self._flashinfer.BatchPrefillWithPagedKVCacheWrapper, window,
                    use_cuda_graph=True, qo_indptr_buf=qo_indptr[: bs + 1],
                    paged_kv_indptr_buf=indptr[: bs + 1], paged_kv_indices_buf=indices,
                    paged_kv_last_page_len_buf=last[:bs])
            self.graph_wrappers[(bs, width, window)] = wrapper
        self.prepare_metadata(batch)
        self.plan(batch, graph_bs=bs)

    def prepare_replay(self, batch: Batch, bs: int) -> None:
        """Before replaying the graph for `bs` rows: plan `batch` (already padded to `bs` and
        given its metadata by `prepare_metadata`) into that graph's wrapper."""
        self.plan(batch, graph_bs=bs)
