"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_gather_last_dim, all_reduce, get_tp_info
from minisgl.layers.base import Layer
from minisgl.layers.gguf_weight import GgufBlocks, GgufWeight, cat_rows
from minisgl.layers.quant import (LANES, VnniWeight, WeightBlocks, block_weight, int8_weight,
                                  vnni_kernels)
from minisgl.layers.w8a8 import Int8ChannelWeight, fits_int8
from minisgl.layers.shard import copy_into, read_rows

# NOTE: the 8-bit VNNI kernel is used on the LM head while it is about as fast as the bf16
# GEMM there (the crossover, the head streamed from memory: BENCHMARKS.md, "Quantized weights").
# A CPU verify step forwards at most this many tokens (engine.speculation), so its rows' logits
# come from the same kernel as a decode batch's: speculation leaves greedy output unchanged.
INT8_MAX_ROWS = 32


class VocabParallelEmbedding(Layer):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // tp.size)  # padded so every rank has the same rows
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden), requires_grad=False)
        # --quantization gguf: the file's table as blocks (each kernel's layout)
        self.table_blocks: GgufWeight | VnniWeight | None = None

    def expect_gguf_blocks(self) -> None:
        """The table comes as the file's blocks (GgufBlocks for block_matmul, or WeightBlocks
        for the VNNI kernel): the dense one is never filled (a tied LM head, sharing it,
        multiplies with the blocks too)."""
        self.weight.data = torch.empty(0, self.weight.shape[1], dtype=self.weight.dtype)

    def expect_blocks(self, bits: int) -> None:
        self.expect_gguf_blocks()

    def load(self, name: str, source: Any, shard_id: Any = None) -> None:
        rows = min(self.shard, self.vocab_size - self.start)
        if isinstance(source, (GgufBlocks, WeightBlocks)):
            # NOTE: padded with all-zero blocks to whole kernel blocks (and the last rank's
            # padding rows); the LM head drops the padding's logits
            whole = -(-self.shard // LANES) * LANES
            part = _zero_padded(source[self.start:self.start + rows], whole)
            self.table_blocks = (GgufWeight(part) if isinstance(part, GgufBlocks) else
                                 block_weight(part, self.weight.dtype))
            return
        copy_into(self.weight.data[:rows], read_rows(source, self.start, rows), name)
        self.weight.data[rows:].zero_()  # padding rows of the last rank

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table_blocks is None:
            return F.embedding(ids, self.weight)
        rows = self.table_blocks.rows(ids).to(self.weight.dtype)
        return rows.view(*ids.shape, rows.shape[-1])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if get_tp_info().size == 1:
            return self.lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        out = self.lookup(local.masked_fill(outside, 0))
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits; with tied embeddings it shares the embedding table.
    `softcap` > 0 caps the logits to softcap * tanh(logits / softcap) (Gemma 2)."""

    def __init__(self, vocab_size: int, hidden: int, tied_to: VocabParallelEmbedding | None,
                 softcap: float = 0.0) -> None:
        super().__init__(vocab_size, hidden)
        self.softcap = softcap
        # NOTE: not a submodule (its parameters would be listed twice, under two names)
        object.__setattr__(self, "tied_to", tied_to)
        if tied_to is not None:
            self.weight = tied_to.weight
        self.packed: torch.Tensor | None = None
        self.int8: VnniWeight | Int8ChannelWeight | None = None

    @property
    def int8_all_rows(self) -> bool:
        """Every batch reads the int8 copy, not only small ones: w8a8's per-channel one, or the
        8-bit one with one-term activations (faster than the GEMM at any batch), and no
        prepacked copy is made."""
        return isinstance(self.int8, Int8ChannelWeight) or (
            isinstance(self.int8, VnniWeight) and self.int8.terms == 1)

    def add_int8_copy(self, per_channel: bool = False) -> None:
        """An 8-bit copy of this shard, where the VNNI kernel is built. By default
        (--quantization gguf) layers.quant.int8_weight: Q8_0's form, a scale per 32 values,
        half the bytes of bfloat16, for decode batches of at most INT8_MAX_ROWS rows (a GGUF
        table of block types is the head itself instead: blocks_head). `per_channel`
        (--quantization w8a8_int8): a scale per vocabulary row (layers.w8a8), for every
        batch, as the method's linears."""
        if vnni_kernels() is None or self.weight.dtype != torch.bfloat16 or self.blocks_head:
            return
        if per_channel and fits_int8(self.weight):
            self.int8 = Int8ChannelWeight(self.weight.data)
        elif self.weight.shape[0] % 16 == 0 and self.weight.shape[1] % 32 == 0:
            self.int8 = int8_weight(self.weight.data)

    def prepack_for_cpu(self) -> None:
        """See _Linear.prepack_for_cpu; the weight stays (the embedding may share it)."""
        from minisgl.layers.linear import pack_weight
        if not self.int8_all_rows and self.blocks_head is None:
            self.packed = pack_weight(self.weight.data)

    @property
    def blocks_head(self) -> GgufWeight | VnniWeight | None:
        """The GGUF blocks this head multiplies with (its own table's, or the tied one's)."""
        if self.table_blocks is not None or self.tied_to is None:
            return self.table_blocks
        return self.tied_to.table_blocks

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        blocks = self.blocks_head
        if blocks is not None:
            local = blocks.matmul(hidden)[..., :self.shard]
        elif self.int8 is not None and (self.int8_all_rows or hidden.shape[0] <= INT8_MAX_ROWS):
            local = self.int8.matmul(hidden)
        elif self.packed is not None:
            local = torch.ops.mkldnn._linear_pointwise(hidden, self.packed, None, "none", [], "")
        else:
            local = F.linear(hidden, self.weight)
        logits = all_gather_last_dim(local)[..., : self.vocab_size]
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def _zero_padded(blocks: GgufBlocks | WeightBlocks, rows: int) -> GgufBlocks | WeightBlocks:
    """`blocks` with all-zero rows (weights 0) added up to `rows`."""
    pad = rows - blocks.shape[0]
    if pad == 0:
        return blocks
    if isinstance(blocks, WeightBlocks):
        zero = WeightBlocks.empty(pad, blocks.shape[1], blocks.bits)
        return WeightBlocks(*(torch.cat([getattr(blocks, f), getattr(zero, f)])
                              for f in ("codes", "scales", "zeros")), blocks.bits)
    return cat_rows([blocks, GgufBlocks(
        blocks.kind, blocks.codes.new_zeros(pad, *blocks.codes.shape[1:]),
        blocks.scales.new_zeros(pad, *blocks.scales.shape[1:]),
        None if blocks.subs is None else blocks.subs.new_zeros(pad, *blocks.subs.shape[1:]))])
