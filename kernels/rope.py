"""Interleaved partial RoPE on the trailing channels: pairs (2i, 2i+1) rotate as one complex number, and the cos /
sin tables of a step's positions. Elementwise per row, so the reference serves the invariant set too, and one
Triton kernel each (kernels/rope_triton.py) both Triton sets."""

import torch

from .precision import upcast
from .registry import call


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """x: [N, ..., d] with the rotary slice last; cos/sin: [N, rd/2] (fp32). inverse=True applies the conjugate."""
    return call("rope")(x, cos, sin, inverse)


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [N] int, inv_freq [rd/2] fp32 -> (cos, sin) [N, rd/2] fp32 of the angles position * inv_freq
    (the tables apply_rope takes; the Triton sets compute both in one launch where torch takes three)."""
    return call("rope_angles")(positions, inv_freq)


def _rope_angles(positions, inv_freq):
    freqs = positions.float().unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()


def _rope(x, cos, sin, inverse):
    half = cos.shape[-1]
    rd = 2 * half
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(shape), sin.view(shape)
    if inverse:
        sin = -sin
    rope = upcast(x[..., -rd:])
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)
