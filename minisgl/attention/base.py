from __future__ import annotations

from abc import ABC, abstractmethod
import importlib.util
import logging
from typing import TYPE_CHECKING, Any

import torch

from minisgl.core import Batch
from minisgl.kernels.cuda import HALF_DTYPES

if TYPE_CHECKING:
    from minisgl.kvcache import KVPool

logger = logging.getLogger(__name__)


class AttentionBackend(ABC):
    """Reads and writes the paged KV pool. `prepare_metadata` runs on the host when a batch is
    scheduled; `forward` runs inside the model, once per layer."""

    def __init__(self, kv_pool: KVPool, page_table: torch.Tensor, scale: float) -> None:
        self.kv_pool = kv_pool
        self.page_table = page_table  # [rows, context_len]: KV location of each token position
        self.scale = scale

    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Set batch.attn_metadata from batch.table_rows / cached_lens / seq_lens."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                batch: Batch) -> torch.Tensor:
        """q: [tokens, heads, head_dim], k/v: [tokens, kv_heads, head_dim] of the new tokens.
        Stores k/v at batch.out_loc and returns [tokens, heads * head_dim]."""


def default_attention_backend(device: torch.device, dtype: torch.dtype) -> str:
    """FlashInfer on CUDA for half-precision models when it is installed; torch otherwise."""
    if device.type != "cuda":
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
                             scale: float, **options: Any) -> AttentionBackend:
    if name == "torch":
        from minisgl.attention.torch_backend import TorchBackend
        return TorchBackend(kv_pool, page_table, scale)
    if name == "flashinfer":
        from minisgl.attention.flashinfer_backend import FlashInferBackend
        return FlashInferBackend(kv_pool, page_table, scale, **options)
    raise ValueError(f"unknown attention backend {name!r} (choose torch or flashinfer)")
