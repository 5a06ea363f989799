"""Fused CUDA kernels for the per-layer elementwise work (RMSNorm with the residual add,
silu(gate) * up, in-place RoPE), taken from FlashInfer when it is installed.

Why: at small batches a decode step is dozens of dependent small kernels per layer when these
run as torch ops, and each costs microseconds even inside a CUDA graph (BENCHMARKS.md).
Without FlashInfer, or for float32 activations, callers fall back to torch ops.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from minisgl.env import cuda_kernels_disabled

HALF_DTYPES = (torch.float16, torch.bfloat16)
# FlashInfer 0.6.1's attention: other head sizes fail inside its kernels (the split-KV merge)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


@functools.lru_cache(maxsize=1)
def _flashinfer() -> Any | None:
    if cuda_kernels_disabled():
        return None
    try:
        import flashinfer
    except ImportError:
        return None
    return flashinfer


def cuda_kernels(x: torch.Tensor) -> Any | None:
    """FlashInfer's module when `x` is a half-precision CUDA tensor it can take, else None."""
    if x.device.type != "cuda" or x.dtype not in HALF_DTYPES:
        return None
    return _flashinfer()
