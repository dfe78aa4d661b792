"""Speculative decoding: the commit rule of verify rows (drafters come later)."""

from .verify import committed_tokens

__all__ = ["committed_tokens"]
