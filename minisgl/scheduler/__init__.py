"""Continuous batching: the overlap loop and one small manager per concern."""

from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.events import Queued, ReqEvent
from minisgl.scheduler.intake import RequestSpec, expand_samples
from minisgl.scheduler.scheduler import Scheduler

__all__ = ["Queued", "ReqEvent", "RequestSpec", "Scheduler", "SchedulerConfig",
           "expand_samples"]
