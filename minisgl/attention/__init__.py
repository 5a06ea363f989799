"""Attention backends: they own the metadata of a batch and compute paged attention."""

from minisgl.attention.base import (
    AttentionBackend,
    create_attention_backend,
    default_attention_backend,
)

__all__ = ["AttentionBackend", "create_attention_backend", "default_attention_backend"]
