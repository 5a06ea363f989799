"""Attention backends: they own the metadata of a batch and compute paged attention. The
torch backend runs everywhere; FlashInfer's (CUDA, half precision) is imported only when
chosen."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

from minisgl.attention.base import AttentionBackend
from minisgl.kernels.cuda import FLASHINFER_HEAD_DIMS, HALF_DTYPES
from minisgl.kvcache import KVPool

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "create_attention_backend", "default_attention_backend"]


def default_attention_backend(device: torch.device, dtype: torch.dtype,
                              head_dim: int = 128, sinks: bool = False) -> str:
    """FlashInfer on CUDA for half-precision models of the head sizes it takes, when it is
    installed, and without attention sinks; torch otherwise."""
    if device.type != "cuda":
        return "torch"
    if sinks:
        logger.warning("attention: torch backend, without CUDA graphs (this model's attention "
                       "sinks are not in minisgl's FlashInfer path)")
        return "torch"
    if head_dim not in FLASHINFER_HEAD_DIMS:
        logger.warning("attention: torch backend, without CUDA graphs (FlashInfer's kernels take "
                       "head sizes %s, this model's is %d)", FLASHINFER_HEAD_DIMS, head_dim)
        return "torch"
    if dtype not in HALF_DTYPES:
        logger.info("attention: torch backend (FlashInfer runs in float16/bfloat16 only)")
        return "torch"
    if importlib.util.find_spec("flashinfer") is None:
        logger.warning("attention: FlashInfer is not installed (pip install minisgl[gpu]); "
                       "using the slower torch backend without CUDA graphs")
        return "torch"
    return "flashinfer"


def create_attention_backend(name: str, kv_pool: KVPool, page_table: torch.Tensor,
                             scale: float, windows: tuple[int, ...] = (), softcap: float = 0.0,
                             **options: Any) -> AttentionBackend:
    if name == "torch":
        from minisgl.attention.torch_backend import TorchBackend
        return TorchBackend(kv_pool, page_table, scale, windows, softcap)
    if name == "flashinfer":
        from minisgl.attention.flashinfer_backend import FlashInferBackend
        return FlashInferBackend(kv_pool, page_table, scale, windows, softcap, **options)
    raise ValueError(f"unknown attention backend {name!r} (choose torch or flashinfer)")
