"""The attention projections V4 and V4.1 share: low-rank query, one K=V latent, per-head sinks, grouped low-rank
output with inverse RoPE."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.rope import apply_rope

from .layers import Linear, RMSNorm, fp32_param


class LatentAttention(nn.Module):
    """The projections V4 and V4.1 share: low-rank q (wq_a, q_norm, wq_b), one K=V latent (wkv, kv_norm),
    per-head sinks, and the grouped low-rank output (wo_a per group of heads, then wo_b)."""

    def __init__(self, cfg, window: int, dtype: torch.dtype, qat_fake_quant: bool):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
        self.window, self.eps, self.o_groups = window, cfg.rms_norm_eps, cfg.o_groups
        self.qat_fake_quant = qat_fake_quant
        d = cfg.hidden_size
        self.wq_a = Linear(d, cfg.q_lora_rank, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, dtype)
        self.wkv = Linear(d, self.head_dim, dtype)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = Linear(self.n_heads * self.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, d, dtype)
        self.attn_sink = fp32_param(self.n_heads)

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """o [N, H, d] -> [N, D]. K=V carried each key's rotation into the values: rotate back at the query
        position, then grouped wo_a (one [R, H*d/G] block per group of heads) and wo_b."""
        o = apply_rope(o, cos, sin, inverse=True)
        grouped = o.view(o.shape[0], self.o_groups, -1)                           # [N, G, H*d/G]
        return self.wo_b(self.wo_a.grouped(grouped).flatten(1))                   # wo_a: [G*R, H*d/G]
