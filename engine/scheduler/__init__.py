"""Requests, continuous batching and the frozen step plan."""

from .plan import ScheduledRow, StepPlan
from .request import Request, Status
from .scheduler import Scheduler

__all__ = ["Request", "ScheduledRow", "Scheduler", "Status", "StepPlan"]
