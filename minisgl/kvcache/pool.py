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

Pages may be stored in 8 bits (`--kv-cache-dtype`): int8 with a float32 scale per token and
head (symmetric, the row's largest magnitude maps to 127), written when the K/V are stored, or
float8 (e4m3 / e5m2) values as they are, saturated at the format's largest finite value.
Readers take the stored rows as they are (the CPU kernels) or `gather` them back in the
compute dtype.
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
        """Of the pool stored in `dtype` (int8: its scales included)."""
        scales = sum(heads for heads, _ in self.shapes) * 4 if dtype == torch.int8 else 0
        return self.halves * (sum(heads * dim for heads, dim in self.shapes) * dtype.itemsize
                              + scales)


INT8_MAX = 127.0
FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., dim] in `dtype` (int8: with each row's scale, [...] float32; float8: saturated)."""
    if dtype == torch.int8:
        scale = x.float().abs().amax(dim=-1) / INT8_MAX
        codes = torch.round(x.float() / scale.clamp(min=torch.finfo(torch.float32).tiny)[..., None])
        return codes.to(torch.int8), scale
    if dtype in FLOAT8_DTYPES:
        largest = torch.finfo(dtype).max
        return x.float().clamp(-largest, largest).to(dtype), None
    return x.to(dtype), None


class KVPool:
    def __init__(self, layout: KVLayout, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device, cache_dtype: torch.dtype | None = None) -> None:
        self.layout = layout
        self.dtype = dtype  # what readers compute in
        self.cache_dtype = cache_dtype or dtype  # what the pages hold
        self.num_pages = num_pages  # usable pages, the dummy page excluded
        self.page_size = page_size
        self.dummy_page = num_pages
        self.dummy_loc = num_pages * page_size
        locations = (num_pages + 1) * page_size
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.scales: dict[tuple[int, int], torch.Tensor] = {}  # int8: [halves, count, heads, loc]
        for heads, dim in dict.fromkeys(layout.shapes):  # each shape once, in layer order
            count = layout.shapes.count((heads, dim))
            # NOTE: torch.empty leaves untouched memory unmapped on CPU; only the dummy page
            # needs defined values (it is read under a mask, and NaN * 0 would leak through
            # softmax).
            buffer = torch.empty((layout.halves, count, heads, locations, dim),
                                 dtype=self.cache_dtype, device=device)
            buffer[:, :, :, self.dummy_loc:].zero_()
            self.buffers[heads, dim] = buffer
            if self.quantized:
                self.scales[heads, dim] = torch.zeros((layout.halves, count, heads, locations),
                                                      dtype=torch.float32, device=device)
        # per layer, its K / V views and (int8 pages) its scales' (latent: V's are K's)
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._scales: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        for i, shape in enumerate(layout.shapes):
            buffer, index = self.buffers[shape], layout.shapes[:i].count(shape)
            v_half = 0 if layout.latent else 1
            v = buffer[0, index, ..., :layout.latent] if layout.latent else buffer[1, index]
            self._layers.append((buffer[0, index], v))
            scales = self.scales.get(shape)
            self._scales.append((None, None) if scales is None else
                                (scales[0, index], scales[v_half, index]))

    @property
    def quantized(self) -> bool:
        """int8 pages: each row's value is its code times its scale."""
        return self.cache_dtype == torch.int8

    @property
    def buffer(self) -> torch.Tensor:
        """The one buffer of a pool whose layers share a shape."""
        if len(self.buffers) != 1:
            raise ValueError("this KV pool's layers differ in KV heads or head size")
        return next(iter(self.buffers.values()))

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each [kv_heads, locations, head_dim] (latent: V a view of
        K's first dims)."""
        return self._layers[layer_id]

    def layer_scales(self, layer_id: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """int8 pages: K's and V's scales of one layer, each [kv_heads, locations] (latent: V's
        are K's); else (None, None)."""
        return self._scales[layer_id]

    def store(self, layer_id: int, locations: torch.Tensor, k: torch.Tensor, v: torch.Tensor
              ) -> None:
        """Write new tokens' k / v ([tokens, kv_heads, head_dim]) at `locations`."""
        (k_cache, v_cache), (k_scales, v_scales) = self.layer(layer_id), self.layer_scales(layer_id)
        halves = [(k, k_cache, k_scales)]
        if not self.layout.latent:
            halves.append((v, v_cache, v_scales))
        for x, cache, scales in halves:
            codes, scale = quantize_rows(x.transpose(0, 1), self.cache_dtype)
            _as_bytes(cache).index_copy_(1, locations, _as_bytes(codes))
            if scales is not None:
                scales.index_copy_(1, locations, scale)

    def gather(self, layer_id: int, locations: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at `locations` (1-D), each [kv_heads, len(locations), dim], in the compute
        dtype."""
        gathered = []
        for cache, scales in zip(self.layer(layer_id), self.layer_scales(layer_id)):
            rows = _as_bytes(cache).index_select(1, locations).view(cache.dtype)
            if scales is not None:
                rows = rows.float() * scales.index_select(1, locations)[..., None]
            gathered.append(rows.to(self.dtype))
        return gathered[0], gathered[1]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page as `read_pages` hands it out: every layer's rows and scales."""
        return sum(part[..., :self.page_size, :].numel() for part in self._byte_parts())

    def read_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """A copy of `pages` (1-D page ids on the pool's device) as [pages, page_bytes] uint8."""
        locations = self._page_locations(pages)
        count = len(pages)
        rows = []
        for part in self._byte_parts():
            picked = part.index_select(3, locations)  # [halves, layers, heads, locations, bytes]
            picked = picked.unflatten(3, (count, self.page_size)).movedim(3, 0)
            rows.append(picked.reshape(count, -1))
        return torch.cat(rows, dim=1)

    def write_pages(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        """Write `read_pages`' [pages, page_bytes] uint8 back into `pages` (same device)."""
        locations = self._page_locations(pages)
        count, at = len(pages), 0
        for part in self._byte_parts():
            halves, layers, heads, _, width = part.shape
            size = halves * layers * heads * self.page_size * width
            rows = data[:, at:at + size].reshape(count, halves, layers, heads, self.page_size,
                                                 width)
            part.index_copy_(3, locations, rows.movedim(0, 3).flatten(3, 4))
            at += size

    def _page_locations(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, device=pages.device)
        return (pages[:, None] * self.page_size + offsets).flatten()

    def _byte_parts(self) -> list[torch.Tensor]:
        """Every buffer and scale tensor as uint8 [halves, layers, heads, locations, bytes]."""
        parts = [buffer.view(torch.uint8) for buffer in self.buffers.values()]
        parts += [scales[..., None].view(torch.uint8) for scales in self.scales.values()]
        return parts

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size()
                   for b in (*self.buffers.values(), *self.scales.values()))


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """float8 as its bytes: CPU index ops take no float8 tensors."""
    return x.view(torch.uint8) if x.dtype in FLOAT8_DTYPES else x
