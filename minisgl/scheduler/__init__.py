"""Continuous batching: the overlap loop, admission, the memory a request holds, batches and
their results."""

from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.intake import RequestSpec, expand_samples
from minisgl.scheduler.results import Queued, ReqEvent
from minisgl.scheduler.scheduler import Scheduler

__all__ = ["Queued", "ReqEvent", "RequestSpec", "Scheduler", "SchedulerConfig",
           "expand_samples"]
