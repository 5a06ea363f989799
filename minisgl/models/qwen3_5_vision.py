"""Qwen3-VL's and Qwen3.5's vision encoder, and Qwen3.5's checkpoints with images
(`Qwen3_5ForConditionalGeneration`, the MoE one too): an image's patches (the image processor's,
as Qwen2.5-VL's: merged 2 x 2 units contiguous) to one embedding per unit, in the decoder's
width.

- Patches embed by one biased linear map (the checkpoint's Conv3d), plus a learned position
  table of side x side cells resampled to the image's grid (bilinear, corners aligned).
- Pre-norm blocks (LayerNorm) of bidirectional attention over each frame, with the 2D RoPE of
  Qwen2.5-VL's encoder, and a tanh-GELU MLP; no windows.
- The merger: a LayerNorm, then an MLP (GELU) over each unit's four patches. Qwen3-VL's
  "deepstack" takes the blocks' outputs at `deepstack_visual_indexes` through mergers of their
  own (normed after the four patches are joined) for its decoder's first layers (models.qwen3_vl).

The decoder (models.qwen3_next) places the embeddings as Qwen2.5-VL does, with the multimodal
RoPE's sections interleaved (a pair turns by t, h, w in turn)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.layers.base import Layer
from minisgl.layers.linear import DenseLinear
from minisgl.layers.rotary import rotate_rows
from minisgl.models.arch import ModelArch
from minisgl.models.qwen2_5_vision import Grid, VisionShape, attend_runs, positions
from minisgl.models.qwen2_5_vl import QwenVision
from minisgl.models.qwen3_next import Qwen3NextForCausalLM
from minisgl.models.siglip import LayerNorm

DEFAULT_SECTIONS = [11, 11, 10]  # transformers' default for a config that leaves it out


@dataclass(frozen=True)
class Qwen3_5VisionShape:
    hidden_size: int
    depth: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    in_channels: int
    merge: int
    position_cells: int  # num_position_embeddings: a square table
    rope_theta: float
    deep_blocks: tuple[int, ...] = ()  # deepstack_visual_indexes (Qwen3-VL)

    @classmethod
    def from_config(cls, vision: dict[str, Any]) -> Qwen3_5VisionShape:
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act {act!r} is not computed by minisgl's "
                             "Qwen3.5 encoder (gelu_pytorch_tanh is)")
        rope = vision.get("rope_parameters") or {}
        return cls(vision["hidden_size"], vision["depth"], vision["num_heads"],
                   vision["intermediate_size"], vision["out_hidden_size"],
                   vision.get("patch_size", 16), vision.get("temporal_patch_size", 2),
                   vision.get("in_channels", 3), vision.get("spatial_merge_size", 2),
                   vision.get("num_position_embeddings", 2304),
                   float(rope.get("rope_theta", 10000.0)),
                   tuple(vision.get("deepstack_visual_indexes") or ()))

    head_dim = VisionShape.head_dim  # the same derived sizes as Qwen2.5-VL's
    patch_values = VisionShape.patch_values


class Block(Layer):
    def __init__(self, shape: Qwen3_5VisionShape) -> None:
        super().__init__()
        self.shape = shape
        self.norm1 = LayerNorm(shape.hidden_size, 1e-6)
        self.norm2 = LayerNorm(shape.hidden_size, 1e-6)
        self.attn = nn.Module()
        self.attn.qkv = DenseLinear(shape.hidden_size, 3 * shape.hidden_size)
        self.attn.proj = DenseLinear(shape.hidden_size, shape.hidden_size)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = DenseLinear(shape.hidden_size, shape.intermediate_size)
        self.mlp.linear_fc2 = DenseLinear(shape.intermediate_size, shape.hidden_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                runs: list[int]) -> torch.Tensor:
        s = self.shape
        q, k, v = self.attn.qkv(self.norm1(x)).view(x.shape[0], 3, s.num_heads,
                                                    s.head_dim).unbind(1)
        q, k = rotate_rows(q, k, cos, sin)
        x = x + self.attn.proj(attend_runs(q, k, v, runs).reshape(x.shape[0], -1))
        hidden = F.gelu(self.mlp.linear_fc1(self.norm2(x)), approximate="tanh")
        return x + self.mlp.linear_fc2(hidden)


class Merger(Layer):
    """A unit's four patches to one embedding: a LayerNorm (over each patch, or, `after_join`,
    over the four joined), then an MLP with GELU."""

    def __init__(self, shape: Qwen3_5VisionShape, after_join: bool) -> None:
        super().__init__()
        self.unit, self.after_join = shape.hidden_size * shape.merge ** 2, after_join
        self.norm = LayerNorm(self.unit if after_join else shape.hidden_size, 1e-6)
        self.linear_fc1 = DenseLinear(self.unit, self.unit)
        self.linear_fc2 = DenseLinear(self.unit, shape.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = self.norm(x.view(-1, self.unit)) if self.after_join else self.norm(x).view(
            -1, self.unit)
        return self.linear_fc2(F.gelu(self.linear_fc1(joined)))


class Qwen3_5VisionEncoder(Layer):
    def __init__(self, shape: Qwen3_5VisionShape) -> None:
        super().__init__()
        self.shape = shape
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = nn.Parameter(torch.empty(
            shape.hidden_size, shape.in_channels, shape.temporal_patch_size, shape.patch_size,
            shape.patch_size), requires_grad=False)
        self.patch_embed.proj.bias = nn.Parameter(torch.zeros(shape.hidden_size),
                                                  requires_grad=False)
        self.pos_embed = nn.Module()
        self.pos_embed.weight = nn.Parameter(torch.empty(shape.position_cells, shape.hidden_size),
                                             requires_grad=False)
        self.blocks = nn.ModuleList([Block(shape) for _ in range(shape.depth)])
        self.merger = Merger(shape, after_join=False)
        self.deepstack_merger_list = nn.ModuleList([Merger(shape, after_join=True)
                                                    for _ in shape.deep_blocks])
        half = shape.head_dim // 2
        self.inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, half, 2).float() / half)

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """pixels: [patches, values], the images' patches one after another (units
        contiguous); grids: each image's (t, h, w). Returns [units, out_hidden_size], and with
        deepstack blocks each one's [units, out_hidden_size] beside it."""
        s = self.shape
        weight = self.patch_embed.proj.weight
        x = F.linear(pixels.to(weight.dtype), weight.view(weight.shape[0], -1),
                     self.patch_embed.proj.bias)
        rows_cols = positions(grids, s.merge)
        x = x + self.position_embeddings(rows_cols, grids).to(x.dtype)
        angles = (rows_cols[:, :, None].float() * self.inv_freq).flatten(1)
        cos, sin = angles.cos().to(x.device), angles.sin().to(x.device)
        runs = [h * w for t, h, w in grids for _ in range(t)]  # each frame attends within
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, runs)
            if i in s.deep_blocks:
                deep.append(self.deepstack_merger_list[s.deep_blocks.index(i)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)

    def position_embeddings(self, rows_cols: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        """Each patch's position embedding: the table's side x side cells resampled to its
        image's h x w grid, bilinearly with the corners aligned."""
        side = int(self.shape.position_cells ** 0.5)
        heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grids])
        widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grids])

        def taps(index: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            source = index.float() * (side - 1) / (size - 1).clamp(min=1)
            low = source.floor()
            cells = (low.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
            return cells, (1 - (source[:, None] - low[:, None] - torch.arange(2)).abs()).clamp(
                min=0)

        (h_cells, h_weights), (w_cells, w_weights) = (taps(rows_cols[:, 0], heights),
                                                      taps(rows_cols[:, 1], widths))
        cells = (h_cells[:, :, None] * side + w_cells[:, None, :]).flatten(1)
        weights = (h_weights[:, :, None] * w_weights[:, None, :]).flatten(1)
        table = self.pos_embed.weight
        return (table[cells.to(table.device)] * weights.to(table)[:, :, None]).sum(1)


class Qwen3_5ForCausalLM(QwenVision, Qwen3NextForCausalLM):
    """Qwen3.5 (its dense and MoE checkpoints), with its vision tower when it has one."""

    def __init__(self, arch: ModelArch) -> None:
        super().__init__(arch)
        vision = arch.config.get("vision_config")
        self.visual = (Qwen3_5VisionEncoder(Qwen3_5VisionShape.from_config(vision))
                       if vision is not None else None)

    def rope(self, arch: ModelArch) -> dict[str, Any]:
        """Its multimodal RoPE interleaves its sections whatever the config says."""
        return {**arch.rope, "mrope_section": arch.rope.get("mrope_section", DEFAULT_SECTIONS),
                "mrope_interleaved": True}

    def load_weight(self, name: str, source: Any) -> bool:
        return self.load_vision(name, source) or super().load_weight(name, source)
