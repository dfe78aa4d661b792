"""All-experts routing (the paged decode's MoE: static shapes, no host sync) equals the routed reference MoE,
on both of its paths: every expert on every row, and few rows gathering their own experts."""

import pytest
import torch

from deepinfer.models.moe import GATHER_FRACTION, Experts, all_experts_routing


@pytest.mark.parametrize("storage", ["dense", "fp4"])
@pytest.mark.parametrize("rows", [1, 2, 3, 20])
def test_all_experts_routing_equals_routed(storage, rows):
    gen = torch.Generator().manual_seed(rows)
    n_experts, dim, inter, k = 64, 64, 64, 6
    ex = Experts(n_experts, dim, inter, 10.0, torch.float64, storage)
    for t in ex.parameters():
        t.copy_(torch.randn(t.shape, generator=gen, dtype=t.dtype) * 0.1)
    for name, t in ex.named_buffers():          # FP4 codes anywhere, scales near 1 (e8m0 bias 127)
        t.copy_(torch.randint(0, 256, t.shape, generator=gen) if name.endswith("_fp4")
                else torch.randint(125, 129, t.shape, generator=gen))
    x = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:k] for _ in range(rows)])
    weights = torch.rand(rows, k, generator=gen)
    routed = ex(x, weights, ids)
    with all_experts_routing():
        every = ex(x, weights, ids)
    gathered = rows * k * GATHER_FRACTION <= n_experts
    assert gathered == (rows <= 2)                   # both paths are exercised
    assert (every - routed).abs().max() <= 1e-12 * max(1.0, routed.abs().max().item())
