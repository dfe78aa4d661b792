"""Dense linear ops: `linear` (x W^T) and `grouped_linear` (one weight per group of channels)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import call, implements
from .tiles import row_tiles


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T -> [..., N]."""
    return call("linear")(x, w)


def grouped_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, G, I], w [G, R, I] -> [N, G, R]: group g of every row times its own w[g]^T."""
    return call("grouped_linear")(x, w)


@implements("linear", "reference")
def _linear(x, w):
    return F.linear(x, w)


@implements("linear", "invariant")
def _linear_tiles(x, w):
    flat = x.reshape(-1, x.shape[-1])
    return row_tiles(lambda t: F.linear(t, w), flat).view(*x.shape[:-1], w.shape[0])


@implements("grouped_linear", "reference")
def _grouped(x, w):
    return torch.einsum("ngi,gri->ngr", x, w)


@implements("grouped_linear", "invariant")
def _grouped_tiles(x, w):
    return row_tiles(lambda t: torch.einsum("ngi,gri->ngr", t, w), x)
