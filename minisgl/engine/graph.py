"""CUDA graphs for decode and verify steps: one graph per padded batch size, replayed instead of
the eager model.

A decode step of a small model is a few hundred tiny kernels; launching them one by one costs
more host time than the GPU spends on them. Each size in `graph_batch_sizes` is captured once,
largest first, into one shared memory pool; a decode batch of size n runs the graph of the
smallest captured size >= n, the extra rows being padding rows:

- a dummy row reads page_table[dummy_row] (every entry is the dummy location) with seq_len 1,
  and writes its K/V to the dummy location, so it never touches a real request's KV;
- its logits are computed and ignored: callers sample `logits[:batch.size]` only.

What the graphs read from outside is fixed memory: the static input_ids / positions / out_loc
buffers here, the KV pool, and the attention backend's per-size metadata buffers, which
`prepare_replay` refills (on the engine stream) before each replay. With --enable-lora, the
adapter slot buffers (filled in place as a step loads adapters) and a static per-row slot
tensor here, refilled from the step's LoRA layout (-1: no adapter, padding rows too): every
decode step replays, adapters or not. Prefill batches, batches larger than the largest size,
and models whose backend cannot be captured run eagerly.

Speculation (engine.speculation) adds graphs of verify steps: every row forwards `verify_width`
tokens (`Batch.row_tokens`: its last token, its drafts, then fillers), so a size is a row count
as for decode; a padding row forwards `verify_width` tokens of the dummy row.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

from minisgl.core import Batch
from minisgl.layers.lora import LoraContext, LoraStep

logger = logging.getLogger(__name__)

GRAPH_PROTOCOL = ("init_graphs", "prepare_capture", "prepare_replay")


def graph_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (and max_bs itself)."""
    if max_bs < 1:
        return []
    sizes = {b for b in (1, 2, 4, 8) if b <= max_bs} | set(range(16, max_bs + 1, 8))
    sizes.add(max_bs)
    return sorted(sizes)


def supports_graphs(backend: Any) -> bool:
    """The torch backend shapes its decode by the longest sequence: it cannot be captured."""
    return all(callable(getattr(backend, name, None)) for name in GRAPH_PROTOCOL)


def _pad_to(x: torch.Tensor, size: int, value: int) -> torch.Tensor:
    return x if x.numel() >= size else F.pad(x, (0, size - x.numel()), value=value)


class GraphRunner:
    """`model(input_ids, positions, batch, backend, logit_rows) -> logits` captured at decode
    sizes up to `max_bs` (and verify sizes, see the module doc). Create, then `capture()`
    (before serving: capture is global to the device), then per step `pad_batch` (scheduler,
    before prepare_metadata) and `replay`."""

    def __init__(self, model: Callable[..., torch.Tensor], backend: Any, *, max_bs: int,
                 dummy_row: int, dummy_loc: int, device: torch.device,
                 lora: LoraContext | None = None, verify: tuple[int, int] | None = None
                 ) -> None:
        """`verify`: (tokens a verify step's row forwards, most tokens in a verify step)."""
        if not supports_graphs(backend):
            raise ValueError(f"{type(backend).__name__} cannot run in CUDA graphs")
        self.model, self.backend, self.device = model, backend, torch.device(device)
        # tokens a row forwards -> the batch sizes captured for it (1: decode)
        self.sizes = {1: graph_batch_sizes(max_bs)}
        width, most = verify or (0, 0)
        if width > 1 and min(max_bs, most // width) > 0:
            self.sizes[width] = graph_batch_sizes(min(max_bs, most // width))
        self.batch_sizes = self.sizes[1]
        self.max_bs = self.batch_sizes[-1] if self.batch_sizes else 0
        self.verify_width = width if width in self.sizes else 0
        # NOTE: padding rows use the dummy row and the dummy page, never a request's.
        self.dummy_row, self.dummy_loc = dummy_row, dummy_loc
        n = max([1] + [sizes[-1] * w for w, sizes in self.sizes.items() if sizes])  # tokens
        self.input_ids = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.out_loc = torch.full((n,), dummy_loc, dtype=torch.int64, device=self.device)
        # --enable-lora: each row's adapter slot, what the captured LoRA kernels read
        self.lora = lora
        self.lora_slots = (None if lora is None else
                           torch.full((n,), -1, dtype=torch.int32, device=self.device))
        self.logits: torch.Tensor | None = None  # [tokens, vocab], written by every graph
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (rows, width) -> graph
        self.pool: Any = None
        self.capture_seconds = 0.0

    # ---- capture -----------------------------------------------------------------------------

    def _dummy_batch(self, bs: int, width: int = 1) -> Batch:
        n = bs * width
        self.out_loc[:n].fill_(self.dummy_loc)
        self.positions[:n].zero_()
        if self.lora is not None:
            self.lora_slots[:n].fill_(-1)
            self.lora.step = LoraStep(0, token_slots=self.lora_slots[:n])
        return Batch("decode" if width == 1 else "prefill", 0,
                     table_rows=[self.dummy_row] * bs, cached_lens=[0] * bs,
                     seq_lens=[width] * bs, extend_lens=[width] * bs,
                     input_positions=self.positions[:n], out_loc=self.out_loc[:n],
                     row_tokens=0 if width == 1 else width)

    def _run(self, batch: Batch, tokens: int) -> torch.Tensor:
        return self.model(self.input_ids[:tokens], self.positions[:tokens], batch,
                          self.backend, None)

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.batch_sizes:
            return
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # An eager step first: compiles/loads kernels, tells the backend its head count,
            # and gives the logits' vocabulary and dtype.
            warm = self._dummy_batch(self.max_bs)
            self.backend.prepare_metadata(warm)
            vocab_row = self._run(warm, self.max_bs)[:1]
            self.logits = vocab_row.new_empty((self.input_ids.numel(), vocab_row.shape[1]))
        # NOTE: after the eager step (the backend knows its heads), before any graph
        self.backend.init_graphs(self.max_bs, *self.verify_shape)
        self.pool = torch.cuda.graph_pool_handle()
        # NOTE: the most tokens first, so smaller graphs reuse its pool
        shapes = sorted(((bs, width) for width, sizes in self.sizes.items() for bs in sizes),
                        key=lambda shape: (shape[0] * shape[1], shape[1]), reverse=True)
        for bs, width in shapes:
            tokens = bs * width
            with torch.cuda.stream(stream):
                batch = self._dummy_batch(bs, width)
                self.backend.prepare_capture(batch, bs)
                for _ in range(2):
                    self._run(batch, tokens)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                self.logits[:tokens].copy_(self._run(batch, tokens))
            self.graphs[(bs, width)] = graph
        torch.cuda.synchronize(self.device)
        if self.lora is not None:
            self.lora.step = None
        self.capture_seconds = time.perf_counter() - started
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        width, rows = self.verify_shape
        verify = f", verify sizes up to {rows} rows of {width} tokens" if width else ""
        logger.info("CUDA graphs: %d sizes (decode up to %d%s) captured in %.1f s (%.0f MiB)",
                    len(self.graphs), self.max_bs, verify, self.capture_seconds,
                    used / 2**20)

    @property
    def verify_shape(self) -> tuple[int, int]:
        """(tokens a row, most rows) of the verify graphs; (0, 0) without any."""
        if not self.verify_width:
            return 0, 0
        return self.verify_width, self.sizes[self.verify_width][-1]

    # ---- per step ----------------------------------------------------------------------------

    def graph_size(self, batch: Batch) -> int | None:
        """The captured size this batch runs at, or None (eager)."""
        sizes = self.sizes.get(batch.graph_width) if self.graphs else None
        if not sizes or batch.size > sizes[-1]:
            return None
        return next(b for b in sizes if b >= batch.size)

    def pad_batch(self, batch: Batch) -> int:
        """Pad a decode or verify batch to its graph size with padding rows: table_rows
        (dummy_row), seq_lens and extend_lens (its width), cached_lens (0), input_positions (0)
        and out_loc (the dummy location). Returns the padding rows. Pads *to* the size, so it
        is a no-op on fields already padded (a tensor-parallel worker rebuilds its batch from
        rank 0's padded lists but unpadded positions). Call before `prepare_metadata`."""
        bs = self.graph_size(batch)
        if bs is None or (batch.lora_slots is not None and self.lora is None):
            return 0
        width = batch.graph_width
        for name, value in (("table_rows", self.dummy_row), ("seq_lens", width),
                            ("cached_lens", 0), ("extend_lens", width)):
            values = getattr(batch, name)
            setattr(batch, name, list(values) + [value] * (bs - len(values)))
        batch.input_positions = _pad_to(batch.input_positions, bs * width, 0)
        batch.out_loc = _pad_to(batch.out_loc, bs * width, self.dummy_loc)
        if batch.rope_positions is not None:  # a multimodal request's decode positions
            batch.rope_positions = _pad_to(batch.rope_positions, bs * width, 0)
        return bs - batch.size

    def can_run(self, batch: Batch) -> bool:
        bs, width = batch.padded_size, batch.graph_width
        return ((batch.lora_slots is None or self.lora is not None)
                and (bs, width) in self.graphs
                and self.graph_size(batch) == bs
                and batch.out_loc.numel() == bs * width
                and batch.input_positions.numel() == bs * width)

    def replay(self, batch: Batch, input_ids: torch.Tensor, positions: torch.Tensor
               ) -> torch.Tensor:
        """Logits [batch.size * width, vocab] of a padded decode or verify batch (`can_run`),
        on the current stream. `input_ids` may hold the real rows only: padding rows keep
        stale, valid ids."""
        bs, width = batch.padded_size, batch.graph_width
        tokens = bs * width
        assert self.logits is not None
        self.input_ids[: input_ids.numel()].copy_(input_ids, non_blocking=True)
        self.positions[:tokens].copy_(positions, non_blocking=True)
        self.out_loc[:tokens].copy_(batch.out_loc, non_blocking=True)
        if self.lora is not None:  # the step's per-token slots (engine.lora), already here
            step = self.lora.step
            filled = 0 if step is None else step.token_slots.numel()
            if filled:
                self.lora_slots[:filled].copy_(step.token_slots, non_blocking=True)
            if filled < tokens:  # padding rows (all rows without adapters): none
                self.lora_slots[filled:tokens].fill_(-1)
        self.backend.prepare_replay(batch, bs)
        self.graphs[(bs, width)].replay()
        # NOTE: a view of the shared buffer: the next replay overwrites it, so it must be used
        # (sampled) on this stream before then, which Engine.forward does.
        return self.logits[: batch.size * width]

    def release(self) -> None:
        """Free the graphs' memory (engine shutdown)."""
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
