"""Compressor pooling: a per-channel softmax over a window's slots weights the slots' values."""

from __future__ import annotations

import torch

from .registry import call
from .tiles import row_tiles


def softmax_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """kv, score [n, s, d] (s slots per window, >= fp32; a -inf score is a slot that does not count)
    -> [n, d]: sum_s kv * softmax_s(score)."""
    return call("softmax_pool")(kv, score)


def _softmax_pool(kv, score):
    return (kv * score.softmax(dim=1)).sum(dim=1)


def _softmax_pool_tiles(kv, score):
    return row_tiles(_softmax_pool, kv, score)
