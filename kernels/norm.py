"""RMSNorm: the torch reference (fp32 math, cast back once)."""

import torch
from .precision import upcast


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x: [..., n]; weight: [n] or None (unweighted). Reduction over the whole row, in fp32."""
    xf = upcast(x)
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * upcast(weight)
    return out.to(x.dtype)
