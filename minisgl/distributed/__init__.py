"""Tensor-parallel context: which rank this process is, and the collectives layers call."""

from minisgl.distributed.context import (
    TPInfo,
    all_gather_last_dim,
    all_reduce,
    get_tp_info,
    set_tp_info,
)

__all__ = ["TPInfo", "all_gather_last_dim", "all_reduce", "get_tp_info", "set_tp_info"]
