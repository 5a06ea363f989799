"""Attention backends: they own the metadata of a batch and compute paged attention. The
torch backend runs everywhere; FlashInfer's (CUDA, half precision) is imported only when
chosen."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch

from minisgl.attention.base import AttentionBackend
from minisgl.kernels.cuda import HALF_DTYPES
from minisgl.kvcache import KVPool

logger = logging.getLogger(__name__)

__all__ = ["AttentionBackend", "create_attention_backend", "default_attention_backend"]


def default_attention_backend(device: torch.device, dtype: torch.dtype,
                              windowed: bool = False) -> str:
    """FlashInfer on CUDA for half-precision models when it is installed; torch otherwise."""
    if device.type != "cuda":
        return "torch"
    if windowed:
        logger.warning("attention: torch backend (this model's sliding window runs there; "
                       "FlashInfer's is not wired up yet)")
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
                             scale: float, windows: tuple[int, ...] = (), **options: Any
                             ) -> AttentionBackend:
    if name == "torch":
        from minisgl.attention.torch_backend import TorchBackend
        return TorchBackend(kv_pool, page_table, scale, windows)
    if name == "flashinfer":
        if any(windows):
            raise ValueError("--attention-backend flashinfer does not apply sliding windows yet, "
                             "and this model has one: use --attention-backend torch")
        from minisgl.attention.flashinfer_backend import FlashInferBackend
        return FlashInferBackend(kv_pool, page_table, scale, **options)
    raise ValueError(f"unknown attention backend {name!r} (choose torch or flashinfer)")
