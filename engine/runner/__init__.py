"""Runs scheduled steps on the model."""

from .runner import ModelRunner, StepOutput

__all__ = ["ModelRunner", "StepOutput"]
