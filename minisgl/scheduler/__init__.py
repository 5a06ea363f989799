"""Continuous batching: the overlap loop and one small manager per concern."""

from minisgl.scheduler.intake import QueueFull, RequestSpec, expand_samples
from minisgl.scheduler.scheduler import ReqOutput, Scheduler

__all__ = ["QueueFull", "ReqOutput", "RequestSpec", "Scheduler", "expand_samples"]
