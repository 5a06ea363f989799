"""Fused CUDA kernels for the per-layer elementwise work (RMSNorm with the residual add,
silu(gate) * up, in-place RoPE), taken from FlashInfer when it is installed.

Why: at batch 1 a decode step of an 8B model is ~30 dependent small kernels per layer when
these run as torch ops (RoPE alone is ~15); each costs a few microseconds even inside a CUDA
graph. Without FlashInfer, or for float32 activations, callers fall back to torch ops.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=1)
def _flashinfer() -> Any | None:
    if os.environ.get("MINISGL_DISABLE_CUDA_KERNELS"):
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
