"""RMSNorm (fp32 math, cast back once)."""

import torch

from .precision import upcast
from .registry import call
from .tiles import row_tiles


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x: [..., n]; weight: [n] or None (unweighted). Reduction over the whole row, in fp32."""
    return call("rms_norm")(x, weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = upcast(x)
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * upcast(weight)
    return out.to(x.dtype)


def _rms_norm_tiles(x, weight, eps):
    if x.dim() < 2:
        return _rms_norm(x, weight, eps)
    return row_tiles(lambda t: _rms_norm(t, weight, eps), x)
