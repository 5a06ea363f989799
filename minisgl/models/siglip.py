"""A SigLIP vision tower (SmolVLM's and Idefics3's): a square image's patches, each a linear
map of its pixels (the checkpoint's Conv2d, whose kernel is its stride) plus a learned position
embedding, through pre-norm transformer layers (LayerNorm, bidirectional attention with biased
projections, a tanh-GELU MLP) and a final LayerNorm.

An image smaller than the tower's `image_size` takes the position embeddings of the cells its
patches fall in when both grids cover [0, 1) (NaViT's scheme, as transformers buckets them);
at the tower's own size that is each patch's own.

Parameter names follow the checkpoint's `vision_model.*` tensors, so they load by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.layers.base import Layer
from minisgl.layers.linear import DenseLinear


@dataclass(frozen=True)
class SiglipShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    in_channels: int
    eps: float

    @classmethod
    def from_config(cls, vision: dict[str, Any]) -> SiglipShape:
        act = vision.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"vision_config.hidden_act {act!r} is not computed by minisgl's "
                             "SigLIP tower (gelu_pytorch_tanh is)")
        return cls(vision["hidden_size"], vision["intermediate_size"],
                   vision["num_hidden_layers"], vision["num_attention_heads"],
                   vision["image_size"], vision["patch_size"], vision.get("num_channels", 3),
                   vision.get("layer_norm_eps", 1e-6))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def side(self) -> int:
        """Patches per side at the tower's own image size."""
        return self.image_size // self.patch_size


class LayerNorm(Layer):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class SiglipAttention(Layer):
    def __init__(self, shape: SiglipShape) -> None:
        super().__init__()
        self.shape = shape
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            DenseLinear(shape.hidden_size, shape.hidden_size) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [images, patches, hidden]; each image attends within itself."""
        s = self.shape
        images, patches, _ = x.shape
        q, k, v = (proj(x).view(images, patches, s.num_heads, s.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.out_proj(out.transpose(1, 2).reshape(images, patches, -1))


class SiglipMLP(Layer):
    def __init__(self, shape: SiglipShape) -> None:
        super().__init__()
        self.fc1 = DenseLinear(shape.hidden_size, shape.intermediate_size)
        self.fc2 = DenseLinear(shape.intermediate_size, shape.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipLayer(Layer):
    def __init__(self, shape: SiglipShape) -> None:
        super().__init__()
        self.layer_norm1 = LayerNorm(shape.hidden_size, shape.eps)
        self.self_attn = SiglipAttention(shape)
        self.layer_norm2 = LayerNorm(shape.hidden_size, shape.eps)
        self.mlp = SiglipMLP(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEmbeddings(Layer):
    def __init__(self, shape: SiglipShape) -> None:
        super().__init__()
        self.shape = shape
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = nn.Parameter(torch.empty(
            shape.hidden_size, shape.in_channels, shape.patch_size, shape.patch_size),
            requires_grad=False)
        self.patch_embedding.bias = nn.Parameter(torch.zeros(shape.hidden_size),
                                                 requires_grad=False)
        self.position_embedding = nn.Module()
        self.position_embedding.weight = nn.Parameter(
            torch.empty(shape.side ** 2, shape.hidden_size), requires_grad=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels: [images, channels, height, width], every image of one size."""
        s = self.shape
        images, channels, height, width = pixels.shape
        rows, cols = height // s.patch_size, width // s.patch_size
        patches = (pixels.reshape(images, channels, rows, s.patch_size, cols, s.patch_size)
                   .permute(0, 2, 4, 1, 3, 5).reshape(images, rows * cols, -1))
        weight = self.patch_embedding.weight
        x = F.linear(patches.to(weight.dtype), weight.view(weight.shape[0], -1),
                     self.patch_embedding.bias)
        return x + self.position_embedding.weight[position_ids(rows, cols, s.side)]


def position_ids(rows: int, cols: int, side: int) -> torch.Tensor:
    """Each patch's row of the position table (row-major patches of a rows x cols image): the
    cell of the side x side grid its fractional coordinates fall in."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)

    def cells(count: int) -> torch.Tensor:
        coords = (torch.arange(count, dtype=torch.float32) * (1.0 / count)).clamp(max=1 - 1e-6)
        return torch.bucketize(coords, boundaries, right=True)

    return (cells(rows)[:, None] * side + cells(cols)[None, :]).flatten()


class SiglipVisionTower(Layer):
    def __init__(self, shape: SiglipShape) -> None:
        super().__init__()
        self.shape = shape
        self.embeddings = SiglipEmbeddings(shape)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([SiglipLayer(shape)
                                             for _ in range(shape.num_layers)])
        self.post_layernorm = LayerNorm(shape.hidden_size, shape.eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[images, patches, hidden] of [images, channels, height, width] pixels."""
        x = self.embeddings(pixels)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
