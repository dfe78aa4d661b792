"""Runs scheduled steps on the model."""

from .runner import ModelRunner

__all__ = ["ModelRunner"]
