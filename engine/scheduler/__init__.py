"""Requests and continuous batching."""

from .request import Request, Status
from .scheduler import Scheduler

__all__ = ["Request", "Scheduler", "Status"]
