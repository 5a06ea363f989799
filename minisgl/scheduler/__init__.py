"""Continuous batching: the overlap loop and one small manager per concern."""

from minisgl.scheduler.scheduler import QueueFull, ReqOutput, Scheduler

__all__ = ["QueueFull", "ReqOutput", "Scheduler"]
