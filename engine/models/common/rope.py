"""RoPE frequencies: plain for sliding-only layers, YaRN-interpolated (no mscale) for compressed layers."""

from __future__ import annotations

import math

import torch

from deepinfer.kernels.rope import rope_angles

from ...config.deepseek_v4 import YarnScaling


def rope_inv_freq(rope_dim: int, base: float, yarn: YarnScaling | None) -> torch.Tensor:
    """[rope_dim/2] fp32 inverse frequencies θ_i = base^(-2i/rope_dim), YaRN-blended when `yarn` is set."""
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn is None:
        return freqs

    def correction_dim(num_rotations: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: keep the original frequency (high-frequency pairs), 0: divide by factor
    return freqs / yarn.factor * (1 - keep) + freqs * keep


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rope_dim: int, base: float, yarn: YarnScaling | None):
        super().__init__()
        self.rope_dim, self.base, self.yarn = rope_dim, base, yarn
        self.register_buffer("inv_freq", rope_inv_freq(rope_dim, base, yarn), persistent=False)

    def reset_buffers(self) -> None:
        """Recompute after the module was materialized from the meta device."""
        self.inv_freq = rope_inv_freq(self.rope_dim, self.base, self.yarn).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [N] int -> (cos, sin), each [N, rope_dim/2] fp32."""
        return rope_angles(positions, self.inv_freq)
