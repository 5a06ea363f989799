"""Compiled kernels for the hot spots torch's composite ops handle poorly (CPU for now)."""

from minisgl.kernels.cpu import cpu_kernels

__all__ = ["cpu_kernels"]
