"""Manifold-constrained hyper-connection math: hc_mult residual streams mixed by Sinkhorn-projected weights.

Every op here is row-local (one token's streams); the invariant backend runs each on fixed row tiles (which
also fixes the vector tails of the narrow [N, hc] sigmoids on CPU)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .precision import upcast
from .registry import call
from .tiles import WIDE_TILE, row_tiles


def hc_mixes(streams, fn, base, scale, hc_eps: float, norm_eps: float, sinkhorn_iters: int):
    """streams [N, hc, D] -> (pre [N, hc], post [N, hc], comb [N, hc, hc]), all >= fp32."""
    return call("hc_mixes")(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[N, hc, D] weighted by pre [N, hc] -> [N, D] (sum in >= fp32)."""
    return call("hc_collapse")(streams, pre)


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out_k = post_k * f(x) + sum_j comb[j, k] * h_j  (comb is applied transposed): -> [N, hc, D]."""
    return call("hc_post")(out, streams, post, comb)


def hc_head(streams, fn, base, scale, hc_eps: float, norm_eps: float) -> torch.Tensor:
    """Collapse the streams to one: [N, hc, D] -> [N, D]."""
    return call("hc_head")(streams, fn, base, scale, hc_eps, norm_eps)


# ---- reference ----
def _projections(streams: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """streams [N, hc, D] -> fn applied to the RMS-normalized flattened streams, [N, rows] fp32."""
    flat = upcast(streams.flatten(1))
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)
    return F.linear(flat, fn.to(flat.dtype))


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


def _hc_mixes(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters):
    return _mix_weights(_projections(streams, fn, norm_eps), base, scale, streams.shape[1], hc_eps, sinkhorn_iters)


def _hc_collapse(streams, pre):
    return (pre.unsqueeze(-1) * upcast(streams)).sum(dim=1).to(streams.dtype)


def _hc_post(out, streams, post, comb):
    mixed = comb.to(upcast(streams).dtype).transpose(1, 2) @ upcast(streams)
    return (post.unsqueeze(-1) * upcast(out).unsqueeze(1) + mixed).to(streams.dtype)


def _hc_head(streams, fn, base, scale, hc_eps, norm_eps):
    pre = torch.sigmoid(_projections(streams, fn, norm_eps) * upcast(scale) + upcast(base)) + hc_eps
    return _hc_collapse(streams, pre)


# ---- invariant: fixed row tiles ----
def _hc_mixes_tiles(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters):
    m = row_tiles(lambda s: _projections(s, fn, norm_eps), streams)
    hc = streams.shape[1]    # the Sinkhorn loop is elementwise work only: wide tiles, fewer calls
    return row_tiles(lambda m: _mix_weights(m, base, scale, hc, hc_eps, sinkhorn_iters), m, tile=WIDE_TILE)


def _hc_collapse_tiles(streams, pre):
    return row_tiles(_hc_collapse, streams, pre)


def _hc_post_tiles(out, streams, post, comb):
    return row_tiles(_hc_post, out, streams, post, comb)


def _hc_head_tiles(streams, fn, base, scale, hc_eps, norm_eps):
    return row_tiles(lambda s: _hc_head(s, fn, base, scale, hc_eps, norm_eps), streams)
