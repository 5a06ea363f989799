"""Qwen2.5-VL's vision encoder: an image's patches (the image processor's flattened
[patches, channels x temporal x patch x patch] pixels, with the image's grid of t x h x w
patches) to one embedding per 2 x 2 patches, in the language model's width.

- Patches embed by one linear map (the checkpoint's Conv3d, whose kernel is its stride).
- Attention is bidirectional within an image, and within windows of `window_size` pixels in
  every block but `fullatt_block_indexes`; RoPE is axial: half of each head's rotated pairs turn
  with the patch's row, half with its column.
- The encoder runs its patches in window order: each merged 2 x 2 unit stays contiguous, each
  window is one run. The merger (an RMSNorm, then an MLP over each unit's four patches) gives
  units back in the image's row-major order.

Parameter names follow the checkpoint's `visual.*` tensors, so they load by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.layers.base import Layer
from minisgl.layers.linear import DenseLinear
from minisgl.layers.rotary import rotate_rows

Grid = tuple[int, int, int]  # an image's (t, h, w) in patches


@dataclass(frozen=True)
class VisionShape:
    hidden_size: int
    depth: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    merge: int  # spatial_merge_size: patches per side of one output embedding
    window_size: int  # in pixels
    full_attention_blocks: frozenset[int]
    rope_theta: float
    eps: float = 1e-6

    @classmethod
    def from_config(cls, vision: dict[str, Any]) -> VisionShape:
        if vision.get("hidden_act", "silu") != "silu":
            raise ValueError(f"vision_config.hidden_act {vision['hidden_act']!r} is not "
                             "computed by minisgl's Qwen2.5-VL encoder (silu is)")
        rope = vision.get("rope_parameters") or {}
        return cls(vision["hidden_size"], vision["depth"], vision["num_heads"],
                   vision["intermediate_size"], vision["out_hidden_size"],
                   vision.get("patch_size", 14), vision.get("temporal_patch_size", 2),
                   vision.get("in_channels", 3), vision.get("spatial_merge_size", 2),
                   vision.get("window_size", 112),
                   frozenset(vision.get("fullatt_block_indexes", ())),
                   float(rope.get("rope_theta", 10000.0)))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_values(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RMSNormWeight(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)


class VisionAttention(Layer):
    def __init__(self, shape: VisionShape) -> None:
        super().__init__()
        self.shape = shape
        self.qkv = DenseLinear(shape.hidden_size, 3 * shape.hidden_size)
        self.proj = DenseLinear(shape.hidden_size, shape.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 runs: list[int]) -> torch.Tensor:
        """Each of `runs` (consecutive patch counts) attends within itself."""
        s = self.shape
        q, k, v = self.qkv(x).view(x.shape[0], 3, s.num_heads, s.head_dim).unbind(1)
        q, k = rotate_rows(q, k, cos, sin)
        return self.proj(attend_runs(q, k, v, runs).reshape(x.shape[0], -1))


def attend_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[int]
                ) -> torch.Tensor:
    """Bidirectional attention of [tokens, heads, dim] within each run of consecutive tokens;
    the runs of one length in one batched call (one call per window is many times slower)."""
    firsts: dict[int, list[int]] = {}
    for first, length in zip(itertools.accumulate([0, *runs[:-1]]), runs):
        firsts.setdefault(length, []).append(first)
    out = torch.empty_like(q)
    heads, dim = q.shape[1], q.shape[2]
    for length, starts in firsts.items():
        rows = (torch.tensor(starts)[:, None] + torch.arange(length)).flatten().to(q.device)
        batched = (t[rows].view(len(starts), length, heads, dim).transpose(1, 2)
                   for t in (q, k, v))
        out[rows] = F.scaled_dot_product_attention(*batched).transpose(1, 2).reshape(
            -1, heads, dim)
    return out


class VisionMLP(Layer):
    def __init__(self, shape: VisionShape) -> None:
        super().__init__()
        self.gate_proj = DenseLinear(shape.hidden_size, shape.intermediate_size)
        self.up_proj = DenseLinear(shape.hidden_size, shape.intermediate_size)
        self.down_proj = DenseLinear(shape.intermediate_size, shape.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(Layer):
    def __init__(self, shape: VisionShape) -> None:
        super().__init__()
        self.eps = shape.eps
        self.norm1, self.norm2 = RMSNormWeight(shape.hidden_size), RMSNormWeight(shape.hidden_size)
        self.attn = VisionAttention(shape)
        self.mlp = VisionMLP(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 runs: list[int]) -> torch.Tensor:
        x = x + self.attn(rms_norm(x, self.norm1.weight, self.eps), cos, sin, runs)
        return x + self.mlp(rms_norm(x, self.norm2.weight, self.eps))


class PatchMerger(Layer):
    def __init__(self, shape: VisionShape) -> None:
        super().__init__()
        self.eps = shape.eps
        self.unit = shape.hidden_size * shape.merge ** 2
        self.ln_q = RMSNormWeight(shape.hidden_size)
        self.mlp = nn.ModuleList([DenseLinear(self.unit, self.unit), nn.Identity(),
                                  DenseLinear(self.unit, shape.out_hidden_size)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        units = rms_norm(x, self.ln_q.weight, self.eps).view(-1, self.unit)
        return self.mlp[2](F.gelu(self.mlp[0](units)))


class PatchEmbed(Layer):
    def __init__(self, shape: VisionShape) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(
            shape.hidden_size, shape.in_channels, shape.temporal_patch_size, shape.patch_size,
            shape.patch_size), requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return pixels.to(weight.dtype) @ weight.view(weight.shape[0], -1).t()


class Qwen2_5VisionEncoder(Layer):
    def __init__(self, shape: VisionShape) -> None:
        super().__init__()
        self.shape = shape
        self.patch_embed = PatchEmbed(shape)
        self.blocks = nn.ModuleList([VisionBlock(shape) for _ in range(shape.depth)])
        self.merger = PatchMerger(shape)
        half = shape.head_dim // 2  # rows and columns share the head's rotated pairs
        self.inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, half, 2).float() / half)

    def output_tokens(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // self.shape.merge ** 2

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """pixels: [patches, channels x temporal x patch x patch], the images' patches one
        image after another; grids: each image's (t, h, w). Returns the images' embeddings,
        [sum of output_tokens, out_hidden_size], each image's in row-major order of its units."""
        s = self.shape
        if pixels.shape != (sum(t * h * w for t, h, w in grids), s.patch_values):
            raise ValueError(f"pixels of shape {tuple(pixels.shape)} do not match the grids "
                             f"{grids} of {s.patch_values} values per patch")
        order, windows = window_order(grids, s)
        unit = s.merge ** 2
        patches = order.repeat_interleave(unit) * unit + torch.arange(unit).repeat(len(order))
        x = self.patch_embed(pixels)[patches]
        angles = (positions(grids, s.merge)[patches, :, None].float() * self.inv_freq).flatten(1)
        cos, sin = angles.cos().to(x.device), angles.sin().to(x.device)
        images = [t * h * w for t, h, w in grids]
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, images if i in s.full_attention_blocks else windows)
        return self.merger(x)[torch.argsort(order)]


def positions(grids: list[Grid], merge: int) -> torch.Tensor:
    """Each patch's (row, column) in its image, [patches, 2], patches in merged-unit order:
    the m x m patches of a unit in a row, units row-major, frames one after another."""
    out = []
    for t, h, w in grids:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        pairs = torch.stack([rows.reshape(blocks).transpose(1, 2).flatten(),
                             cols.reshape(blocks).transpose(1, 2).flatten()], dim=-1)
        out.append(pairs.repeat(t, 1))
    return torch.cat(out)


def window_order(grids: list[Grid], shape: VisionShape) -> tuple[torch.Tensor, list[int]]:
    """The merged units in window order (each window's units row-major, windows row-major, per
    frame, per image) and each window's patch count."""
    side = shape.window_size // shape.merge // shape.patch_size  # a window's side, in units
    order, windows, first = [], [], 0
    for t, h, w in grids:
        rows, cols = h // shape.merge, w // shape.merge
        units = torch.arange(t * rows * cols).view(t, rows, cols)
        for frame in units:
            for top in range(0, rows, side):
                for left in range(0, cols, side):
                    window = frame[top:top + side, left:left + side].flatten()
                    order.append(window + first)
                    windows.append(window.numel() * shape.merge ** 2)
        first += t * rows * cols
    return torch.cat(order), windows
