"""Manifold-constrained hyper-connections: hc_mult residual streams mixed by Sinkhorn-projected weights.

Every function here is row-local (one token's streams); in batch-invariant mode each runs on fixed row tiles
(kernels.matmul.row_tiles), which also fixes the vector tails of the narrow [N, hc] sigmoids on CPU."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kernels.matmul import WIDE_TILE, is_batch_invariant, linear, row_tiles
from deepinfer.kernels.precision import upcast

from .layers import fp32_param


def _mixes(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [N, hc, D] -> fn applied to the RMS-normalized flattened streams, [N, rows] fp32."""
    flat = upcast(streams.flatten(1))
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return linear(flat, fn.to(flat.dtype))


def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
             norm_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One projection of the streams [N, hc, D] -> (pre [N, hc], post [N, hc], comb [N, hc, hc]), all >= fp32."""
    hc = streams.shape[1]
    if is_batch_invariant():   # the Sinkhorn loop is elementwise work only: wide tiles, fewer calls
        m = row_tiles(lambda s: _mixes(s, fn, norm_eps), streams)
        return row_tiles(lambda m: _mix_weights(m, base, scale, hc, hc_eps, sinkhorn_iters), m, tile=WIDE_TILE)
    return _mix_weights(_mixes(streams, fn, norm_eps), base, scale, hc, hc_eps, sinkhorn_iters)


def _mix_weights(m, base, scale, hc, hc_eps, sinkhorn_iters):
    """[N, (2+hc)*hc] projections -> (pre, post, comb)."""
    pre = torch.sigmoid(m[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = torch.softmax(m[:, 2 * hc:].view(-1, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)   # columns once, then rows+columns
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[N, hc, D] weighted by pre [N, hc] -> [N, D] (sum in >= fp32)."""
    if is_batch_invariant():
        return row_tiles(_hc_collapse, streams, pre)
    return _hc_collapse(streams, pre)


def _hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return (pre.unsqueeze(-1) * upcast(streams)).sum(dim=1).to(streams.dtype)


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out_k = post_k * f(x) + sum_j comb[j, k] * h_j  (comb is applied transposed)."""
    if is_batch_invariant():
        return row_tiles(_hc_post, out, streams, post, comb)
    return _hc_post(out, streams, post, comb)


def _hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    mixed = comb.to(upcast(streams).dtype).transpose(1, 2) @ upcast(streams)
    return (post.unsqueeze(-1) * upcast(out).unsqueeze(1) + mixed).to(streams.dtype)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float) -> torch.Tensor:
    """Collapse the streams to one: [N, hc, D] -> [N, D]."""
    if is_batch_invariant():
        return row_tiles(lambda s: _hc_head(s, fn, base, scale, hc_eps, norm_eps), streams)
    return _hc_head(streams, fn, base, scale, hc_eps, norm_eps)


def _hc_head(streams, fn, base, scale, hc_eps, norm_eps):
    pre = torch.sigmoid(_mixes(streams, fn, norm_eps) * upcast(scale) + upcast(base)) + hc_eps
    return hc_collapse(streams, pre)


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
