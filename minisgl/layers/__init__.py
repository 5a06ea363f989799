"""Model building blocks, tensor-parallel aware (see minisgl.distributed)."""

from minisgl.layers.activation import GeluTanhAndMul, SiluAndMul
from minisgl.layers.base import Layer
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import NoRotary, RotaryEmbedding

__all__ = [
    "GeluTanhAndMul",
    "ColumnParallelLinear", "Layer", "MergedColumnParallelLinear", "NoRotary", "ParallelLMHead",
    "QKVParallelLinear", "RMSNorm", "ReplicatedLinear", "RotaryEmbedding", "RowParallelLinear", "SiluAndMul",
    "VocabParallelEmbedding",
]
