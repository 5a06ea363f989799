"""Helpers to copy a (possibly lazily read) checkpoint tensor's shard into a parameter.

`source` is a torch.Tensor, a safetensors slice or blocks (layers.quant, layers.gguf_weight): all
support `src[a:b]` and `src[:, a:b]`, so a rank reads only the rows or columns it owns.
"""

import dataclasses
from typing import Any

import torch

from minisgl.distributed import get_tp_info
from minisgl.layers.gguf_weight import GgufBlocks
from minisgl.layers.gpu_blocks import Fp8Blocks
from minisgl.layers.quant import WeightBlocks


def _read(part: Any) -> Any:
    if isinstance(part, (WeightBlocks, GgufBlocks, Fp8Blocks)):
        return _owned(part)
    return torch.as_tensor(part)


def _owned(blocks: Any) -> Any:
    """A shard of blocks in tensors of its own: a view would keep the whole weight's codes
    alive while loading goes on (every rank would hold all of them)."""
    changes = {f.name: value.clone() for f in dataclasses.fields(blocks)
               if isinstance(value := getattr(blocks, f.name), torch.Tensor)
               and value.untyped_storage().nbytes() > value.numel() * value.element_size()}
    return dataclasses.replace(blocks, **changes) if changes else blocks


def read_rows(source: Any, start: int, length: int) -> Any:
    return _read(source[start:start + length])


def read_cols(source: Any, start: int, length: int) -> Any:
    return _read(source[:, start:start + length])


def read_part_rows(source: Any, parts: list[int], rank: int, size: int) -> torch.Tensor:
    """This rank's rows of a tensor stacked from row blocks of `parts` rows, each block split
    evenly over `size` ranks: its share of every block, in order."""
    rows, offset = [], 0
    for part in parts:
        share = part // size
        rows.append(torch.as_tensor(read_rows(source, offset + rank * share, share)))
        offset += part
    return torch.cat(rows)


def read_all(source: Any) -> torch.Tensor:
    return torch.as_tensor(source[:])


def copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    dst.copy_(src)


def load_head_rows(param: Any, source: Any, name: str) -> None:
    """A per-head vector's rows of this rank's heads (all of them without parallelism)."""
    tp = get_tp_info()
    copy_into(param.data, read_part_rows(source, [len(param) * tp.size], tp.rank, tp.size), name)
