"""Helpers to copy a (possibly lazily read) checkpoint tensor's shard into a parameter.

`source` is a torch.Tensor, a safetensors slice or blocks (layers.quant, layers.gguf_weight): all
support `src[a:b]` and `src[:, a:b]`, so a rank reads only the rows or columns it owns.
"""

from typing import Any

import torch

from minisgl.layers.gguf_weight import GgufBlocks
from minisgl.layers.gpu_blocks import Fp8Blocks
from minisgl.layers.quant import WeightBlocks


def _read(part: Any) -> Any:
    return part if isinstance(part, (WeightBlocks, GgufBlocks, Fp8Blocks)) else \
        torch.as_tensor(part)


def read_rows(source: Any, start: int, length: int) -> Any:
    return _read(source[start:start + length])


def read_cols(source: Any, start: int, length: int) -> Any:
    return _read(source[:, start:start + length])


def read_all(source: Any) -> torch.Tensor:
    return torch.as_tensor(source[:])


def copy_into(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    dst.copy_(src)
