"""Requests and continuous batching."""

from .request import Request, Status
from .scheduler import Scheduled, Scheduler

__all__ = ["Request", "Scheduled", "Scheduler", "Status"]
