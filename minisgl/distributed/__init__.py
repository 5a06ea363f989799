"""Tensor parallelism.

context: which rank this thread/process is, and the collectives layers call.
worker: spawning, feeding, watching and stopping ranks 1..N-1 (and the worker process itself).
shm_queue: the shared-memory ring that carries each step's inputs from rank 0 to a worker.
"""

from minisgl.distributed.context import (
    TPInfo,
    all_gather_last_dim,
    all_reduce,
    get_tp_info,
    set_tp_info,
)

__all__ = ["TPInfo", "all_gather_last_dim", "all_reduce", "get_tp_info", "set_tp_info"]
