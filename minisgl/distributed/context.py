"""The one piece of process-global state: this process's tensor-parallel rank and group.

Layers read it when they are built (to size their shards) and when they run (to all-reduce).
It is set once per process before the model is built, and stays fixed afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_tp_info = TPInfo()


def set_tp_info(info: TPInfo) -> None:
    global _tp_info
    _tp_info = info


def get_tp_info() -> TPInfo:
    return _tp_info


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp_info.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension."""
    if _tp_info.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp_info.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
