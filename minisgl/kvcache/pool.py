"""The paged KV pool: one K and one V tensor per layer, indexed by token location.

Locations are grouped in pages of `page_size`; page p owns [p * page_size, (p + 1) * page_size).
Layout: [K/V, layer, kv_head, location, head_dim] ("head-major"): gathering one request's
positions yields a contiguous [kv_heads, len, head_dim] block per head, which both the batched
decode matmuls and SDPA consume without a transpose copy. Layers of one shape share one such
buffer; a model whose layers differ in KV heads or head size (Gemma 4's global layers) gets a
buffer per shape (`KVLayout`), the same locations in each. Latent attention (DeepSeek's MLA)
keeps one compressed row per token and layer, whose first `latent` dims serve as its values:
its buffer holds no V half.
The last page is the dummy page: padded requests write there and masked reads point there,
so it is never handed out and always holds finite values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVLayout:
    """Per KV layer (the layers that keep K and V, in order), its (kv_heads, head_dim) on this
    rank; `latent` > 0: the values are the keys' first `latent` dims, not stored apart."""
    shapes: tuple[tuple[int, int], ...]
    latent: int = 0

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> KVLayout:
        return cls(((num_kv_heads, head_dim),) * num_layers)

    @property
    def num_layers(self) -> int:
        return len(self.shapes)

    @property
    def halves(self) -> int:
        """K and V, or K alone (latent)."""
        return 1 if self.latent else 2

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.halves * sum(heads * dim for heads, dim in self.shapes) * dtype.itemsize


class KVPool:
    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.layout = layout
        self.num_pages = num_pages  # usable pages, the dummy page excluded
        self.page_size = page_size
        self.dummy_page = num_pages
        self.dummy_loc = num_pages * page_size
        locations = (num_pages + 1) * page_size
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}
        for heads, dim in dict.fromkeys(layout.shapes):  # each shape once, in layer order
            count = layout.shapes.count((heads, dim))
            # NOTE: torch.empty leaves untouched memory unmapped on CPU; only the dummy page
            # needs defined values (it is read under a mask, and NaN * 0 would leak through
            # softmax).
            buffer = torch.empty((layout.halves, count, heads, locations, dim), dtype=dtype,
                                 device=device)
            buffer[:, :, :, self.dummy_loc:].zero_()
            self.buffers[heads, dim] = buffer
        # per layer: its buffer and its index there
        self._where = [(self.buffers[shape], layout.shapes[:i].count(shape))
                       for i, shape in enumerate(layout.shapes)]

    @property
    def buffer(self) -> torch.Tensor:
        """The one buffer of a pool whose layers share a shape."""
        if len(self.buffers) != 1:
            raise ValueError("this KV pool's layers differ in KV heads or head size")
        return next(iter(self.buffers.values()))

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each [kv_heads, locations, head_dim] (latent: V a view of
        K's first dims)."""
        buffer, index = self._where[layer_id]
        if self.layout.latent:
            return buffer[0, index], buffer[0, index, ..., :self.layout.latent]
        return buffer[0, index], buffer[1, index]

    def store(self, layer_id: int, locations: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new tokens' k / v ([tokens, kv_heads, head_dim]) at `locations`; returns the
        layer's K and V."""
        k_cache, v_cache = self.layer(layer_id)
        k_cache.index_copy_(1, locations, k.transpose(0, 1))
        if not self.layout.latent:
            v_cache.index_copy_(1, locations, v.transpose(0, 1))
        return k_cache, v_cache

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
