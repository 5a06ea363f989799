"""Compiled kernels for the hot spots torch's composite ops handle poorly: built from our C++
sources on CPU, taken from FlashInfer on CUDA."""

from minisgl.kernels.cpu import cpu_kernels
from minisgl.kernels.cuda import cuda_kernels

__all__ = ["cpu_kernels", "cuda_kernels"]
