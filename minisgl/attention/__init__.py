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

__all__ = ["AttentionBackend", "create_attention_backend", "default_attention_backend",
           "torch_only_features"]


def default_attention_backend(device: torch.device, dtype: torch.dtype,
                              torch_only: str | None = None) -> str:
    """FlashInfer on CUDA for half-precision models when it is installed; torch otherwise, and
    for a model that needs what only the torch backend does (`torch_only` names it)."""
    if device.type != "cuda":
        return "torch"
    if torch_only:
        logger.warning("attention: torch backend (this model's %s is verified there; "
                       "--attention-backend flashinfer applies it too, not yet verified on a "
                       "GPU)", torch_only)
        return "torch"
    if dtype not in HALF_DTYPES:
        logger.info("attention: torch backend (FlashInfer runs in float16/bfloat16 only)")
        return "torch"
    if importlib.util.find_spec("flashinfer") is None:
        logger.warning("attention: FlashInfer is not installed (pip install minisgl[gpu]); "
                       "using the slower torch backend without CUDA graphs")
        return "torch"
    return "flashinfer"


def torch_only_features(windows: tuple[int, ...], softcap: float) -> str | None:
    """What of a model's attention the default backend choice keeps on the torch backend (its
    FlashInfer path awaits a GPU check), or None."""
    features = ["sliding window"] * any(windows) + ["logit soft-capping"] * (softcap > 0)
    return " and ".join(features) or None


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
