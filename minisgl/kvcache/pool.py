"""The paged KV pool: one K and one V tensor per layer, indexed by token location.

Locations are grouped in pages of `page_size`; page p owns [p * page_size, (p + 1) * page_size).
Layout: [K/V, layer, kv_head, location, head_dim] ("head-major"): gathering one request's
positions yields a contiguous [kv_heads, len, head_dim] block per head, which both the batched
decode matmuls and SDPA consume without a transpose copy.
The last page is the dummy page: padded requests write there and masked reads point there,
so it is never handed out and always holds finite values.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_pages = num_pages  # usable pages, the dummy page excluded
        self.page_size = page_size
        self.dummy_page = num_pages
        self.dummy_loc = num_pages * page_size
        shape = (2, num_layers, num_kv_heads, (num_pages + 1) * page_size, head_dim)
        # NOTE: torch.empty leaves untouched memory unmapped on CPU; only the dummy page needs
        # defined values (it is read under a mask, and NaN * 0 would leak through softmax).
        self.buffer = torch.empty(shape, dtype=dtype, device=device)
        self.buffer[:, :, :, self.dummy_loc:].zero_()

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each [kv_heads, locations, head_dim]."""
        return self.buffer[0, layer_id], self.buffer[1, layer_id]

    def store(self, layer_id: int, locations: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write new tokens' k / v ([tokens, kv_heads, head_dim]) at `locations`; returns the
        layer's K and V."""
        k_cache, v_cache = self.layer(layer_id)
        k_cache.index_copy_(1, locations, k.transpose(0, 1))
        v_cache.index_copy_(1, locations, v.transpose(0, 1))
        return k_cache, v_cache

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize
