"""RMSNorm: the torch reference (fp32 math, cast back once)."""

import torch
from .matmul import is_batch_invariant, row_tiles
from .precision import upcast


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x: [..., n]; weight: [n] or None (unweighted). Reduction over the whole row, in fp32.
    Batch-invariant mode: fixed tiles of rows (dim 0), so a GPU reduction cannot pick another split per batch."""
    if is_batch_invariant() and x.dim() > 1:
        return row_tiles(lambda t: _rms_norm(t, weight, eps), x)
    return _rms_norm(x, weight, eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = upcast(x)
    out = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        out = out * upcast(weight)
    return out.to(x.dtype)
