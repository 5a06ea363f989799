"""The one piece of process-global state: this process's tensor-parallel rank and group.

Layers read it when they are built (to size their shards) and when they run (to all-reduce).
A worker process sets it once (`set_tp_info`) before its model is built. Rank 0 lives in the
server process, where several engines may coexist (two `LLM`s, a tp-1 and a tp-3 one), so
there the binding is per thread: an engine builds its model inside `tp_context(...)` and its
engine thread is bound once with `bind_thread(...)`. A thread without a binding sees the
process default (TPInfo(0, 1) unless `set_tp_info` changed it).

The group is a torch `ProcessGroup` object used directly (`group.allreduce([x]).wait()`), not
torch.distributed's default group: that one is process-wide and would allow one TP instance
per process.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPInfo:
    rank: int = 0
    size: int = 1

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


_default: tuple[TPInfo, Any] = (TPInfo(), None)
_local = threading.local()


def set_tp_info(info: TPInfo, group: Any = None) -> None:
    """Set the process default (a TP worker process calls this once, before building)."""
    global _default
    _default = (info, group)


def bind_thread(info: TPInfo, group: Any) -> None:
    """Bind the calling thread (an engine thread) to one TP instance for good."""
    _local.state = (info, group)


@contextlib.contextmanager
def tp_context(info: TPInfo, group: Any) -> Iterator[None]:
    """Bind the calling thread to one TP instance for the duration of a block."""
    saved = getattr(_local, "state", None)
    _local.state = (info, group)
    try:
        yield
    finally:
        if saved is None:
            del _local.state
        else:
            _local.state = saved


def _state() -> tuple[TPInfo, Any]:
    return getattr(_local, "state", _default)


def get_tp_info() -> TPInfo:
    return _state()[0]


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    info, group = _state()
    if info.size > 1:
        group.allreduce([x]).wait()
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension."""
    info, group = _state()
    if info.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(info.size)]
    group.allgather([parts], [x]).wait()
    return torch.cat(parts, dim=-1)


def broadcast(x: torch.Tensor, src: int = 0) -> torch.Tensor:
    """In place: every rank ends with rank `src`'s values."""
    info, group = _state()
    if info.size > 1:
        group.broadcast(x, src).wait()
    return x


def all_reduce_min(value: int, device: torch.device) -> int:
    """The smallest `value` over the ranks (used once at start-up, e.g. KV pool size)."""
    info, group = _state()
    if info.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MIN
    group.allreduce([t], opts).wait()
    return int(t.item())


def create_group(store: Any, rank: int, size: int, device: torch.device,
                 timeout_s: float) -> Any:
    """A process group over `store`: gloo for CPU tensors, NCCL for CUDA tensors. Blocks
    until every rank has called it. `timeout_s` bounds every collective."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore("minisgl-tp", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)
