"""The default chunked-prefill size: how many prompt tokens one prefill step takes when
--chunked-prefill-size is not given."""

from __future__ import annotations

from torch import nn

from minisgl.args import CPU_MIXED_CHUNK, DEFAULT_CHUNK
from minisgl.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                   QKVParallelLinear)
from minisgl.layers.moe import Experts

# NOTE: glibc serves an allocation above 32 MiB (its largest mmap threshold) with a fresh
# mapping, so a prefill step whose activations are wider page-faults them in anew at every
# layer, which costs more per row than a narrower step (BENCHMARKS.md). On CPU the default
# chunk keeps the widest activation (a gate/up output, a linear mixer's input projection, a
# mixture's rows: k per token) under that size.
CPU_ALLOCATION_LIMIT = 32 << 20
CPU_SMALLEST_CHUNK = 1024


def widest_row_width(model: nn.Module, top_k: int) -> int:
    """Per prompt token, the most values one of `model`'s activations holds on this rank: a
    column-parallel linear's output (this rank's features), or a mixture's rows grouped by
    expert (`top_k` per token, each as wide as the hidden state or the experts' gate/up)."""
    widths = [0]
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, MergedColumnParallelLinear,
                               QKVParallelLinear)):
            widths.append(module.out_features)
        elif isinstance(module, Experts):
            widths.append(top_k * max(module.hidden_size, module.gate_up_width))
    return max(widths)


def default_chunk(device_type: str, mixed: bool, widest_row_bytes: int) -> int:
    """`widest_row_bytes`: one token's widest activation on this rank (widest_row_width).

    On CPU with mixed chunks a step costs about as much as its prefill chunk, so the small
    CPU_MIXED_CHUNK bounds the running streams' inter-token stall; unmixed, prefill runs first
    anyway and a small chunk would only add per-step overhead."""
    if device_type != "cpu":
        return DEFAULT_CHUNK
    if mixed:
        return CPU_MIXED_CHUNK
    chunk = DEFAULT_CHUNK
    while chunk > CPU_SMALLEST_CHUNK and chunk * widest_row_bytes > CPU_ALLOCATION_LIMIT:
        chunk //= 2
    return chunk
