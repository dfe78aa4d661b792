"""Manifold-constrained hyper-connections: hc_mult residual streams mixed by Sinkhorn-projected weights.
The math is the kernels' mHC ops (kernels/mhc.py); this module holds a block's parameters for them."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.mhc import hc_collapse, hc_head, hc_mixes, hc_post

from .layers import fp32_param

__all__ = ["HyperConnectionSites", "hc_collapse", "hc_head", "hc_mixes", "hc_post"]


class HyperConnectionSites(nn.Module):
    """A block's two mHC sites: hc_{attn,ffn}_{fn [(2+hc)*hc, hc*D], base [(2+hc)*hc], scale [3]} in fp32."""

    def init_sites(self, cfg) -> None:
        d, hc = cfg.hidden_size, cfg.hc_mult
        rows = (2 + hc) * hc
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", fp32_param(rows, hc * d))
            setattr(self, f"hc_{site}_base", fp32_param(rows))
            setattr(self, f"hc_{site}_scale", fp32_param(3))

    def mixes(self, h: torch.Tensor, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(pre, post, comb) of `site` for streams h [N, hc, D]."""
        c = self.cfg
        return hc_mixes(h, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                        getattr(self, f"hc_{site}_scale"), c.hc_eps, c.rms_norm_eps, c.hc_sinkhorn_iters)
