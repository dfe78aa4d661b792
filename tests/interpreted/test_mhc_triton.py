"""kernels/mhc_triton.py in Triton's interpreter against the reference `hc_mixes` on fresh random inputs: the
tiny presets' width (hc 4 x 64), a released width (hc 4 x 5120), hc 2 (padding rows in the [hc, hc] view), rows
not a multiple of the row block, 1 and 20 Sinkhorn iterations."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import mhc as km
from deepinfer.kernels import mhc_triton as kmt

BOUND = 1e-6     # max |kernel - reference| / max |reference|, each of pre, post, comb
# The GEMM path: torch's fp32 GEMM sums the hc * D = 5120 products in its own blocking order (MKL's; with torch
# 2.13 on CPU: 1.02e-6 after the Sinkhorn iterations; the session-25 CI's torch stayed under 1e-6), so its bound is
# a few fp32 ulps of a 5120-term sum looser.
GEMM_BOUND = 4e-6


def inputs(n, hc, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(n, hc, d, generator=g)
    fn = torch.randn((2 + hc) * hc, hc * d, generator=g) * (hc * d) ** -0.5
    base = torch.randn((2 + hc) * hc, generator=g) * 0.3
    scale = torch.randn(3, generator=g) * 0.3 + 1.0
    return streams, fn, base, scale


@pytest.mark.parametrize("n,hc,d,iters", [(5, 4, 64, 20), (17, 4, 64, 1), (3, 4, 5120, 20), (6, 2, 48, 20)])
def test_matches_reference(n, hc, d, iters):
    streams, fn, base, scale = inputs(n, hc, d, seed=n + d)
    assert kmt.supported(streams, fn)
    want = km._hc_mixes(streams, fn, base, scale, 1e-6, 1e-6, iters)
    got = kmt.hc_mixes_triton(streams, fn, base, scale, 1e-6, 1e-6, iters)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == torch.float32
        assert float((g - w).abs().max() / w.abs().max()) <= BOUND, float((g - w).abs().max())


def test_hc_not_a_power_of_two_falls_back():
    streams, fn, base, scale = inputs(4, 3, 32, seed=2)
    assert not kmt.supported(streams, fn)
    got = kmt.hc_mixes_triton(streams, fn, base, scale, 1e-6, 1e-6, 20)
    want = km._hc_mixes(streams, fn, base, scale, 1e-6, 1e-6, 20)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_rows_do_not_depend_on_the_batch():
    """Any row alone (first, inside, last of the second row block) and a shuffled batch: the bits of the row in the
    batch. With the order-fixed tl.dot (tests/interpreter_dot.py) a row's place in the tile changes nothing, as
    on the MMA (the GPU test checks the same); numpy's matmul would round a row by its place in the tile."""
    streams, fn, base, scale = inputs(20, 4, 64, seed=1)
    full = kmt.hc_mixes_kernel(streams, fn, base, scale, 1e-6, 1e-6, 20)
    for j in (0, 13, 19):
        part = kmt.hc_mixes_kernel(streams[j:j + 1], fn, base, scale, 1e-6, 1e-6, 20)
        assert all(torch.equal(f[j:j + 1], p) for f, p in zip(full, part)), j
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(0))
    shuffled = kmt.hc_mixes_kernel(streams[perm], fn, base, scale, 1e-6, 1e-6, 20)
    assert all(torch.equal(f[perm], p) for f, p in zip(full, shuffled))


@pytest.mark.parametrize("d", [64, 72])
def test_chunks_split_or_not_same_bits(d, monkeypatch):
    """K = 4 x d in 128-column chunks (2, or 3 with a ragged last one): one program per (row block, chunk) and
    then the mixes, or each row block walking its chunks, give the same bits here (the order-fixed tl.dot adds
    acc after a chunk's products, as the interpreter does; on the H200 they differ in last bits,
    tests/test_kernels_mhc_triton.py), both = the reference."""
    monkeypatch.setattr(kmt, "CHUNK", 128)
    streams, fn, base, scale = inputs(19, 4, d, seed=d)
    split = kmt.hc_mixes_kernel(streams, fn, base, scale, 1e-6, 1e-6, 20, split=True)
    whole = kmt.hc_mixes_kernel(streams, fn, base, scale, 1e-6, 1e-6, 20, split=False)
    assert all(torch.equal(a, b) for a, b in zip(split, whole))
    want = km._hc_mixes(streams, fn, base, scale, 1e-6, 1e-6, 20)
    assert all(float((g - w).abs().max() / w.abs().max()) <= BOUND for g, w in zip(split, want))


@pytest.mark.parametrize("hc,d", [(4, 96), (4, 1280)])
def test_gemm_projection_path_matches_reference(hc, d):
    """Prefill-sized batches (triton, >= GEMM_ROWS): the projection on torch's GEMM, the kernel's epilogue over
    that one part; against the reference and against the chunk path."""
    n = 40
    g = torch.Generator().manual_seed(d)
    streams = torch.randn(n, hc, d, generator=g)
    fn = torch.randn((2 + hc) * hc, hc * d, generator=g) * 0.05
    base, scale = torch.randn((2 + hc) * hc, generator=g), torch.rand(3, generator=g) + 0.5
    got = kmt.hc_mixes_kernel(streams, fn, base, scale, 1e-6, 1e-6, 20, gemm=True)
    want = km._hc_mixes(streams, fn, base, scale, 1e-6, 1e-6, 20)
    chunked = kmt.hc_mixes_kernel(streams, fn, base, scale, 1e-6, 1e-6, 20, split=True)
    for a, w, c in zip(got, want, chunked):
        assert float((a - w).abs().max() / w.abs().max()) <= GEMM_BOUND
        assert float((a - c).abs().max() / c.abs().max()) <= GEMM_BOUND


def test_triton_set_takes_the_gemm_path_from_gemm_rows(monkeypatch):
    calls = []
    real = kmt.gemm_parts
    monkeypatch.setattr(kmt, "gemm_parts", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(kmt, "GEMM_ROWS", 8)
    g = torch.Generator().manual_seed(0)
    fn, base, scale = torch.randn(24, 64, generator=g) * 0.1, torch.randn(24, generator=g), torch.ones(3)
    for n in (7, 8):
        kmt.hc_mixes_triton(torch.randn(n, 4, 16, generator=g), fn, base, scale, 1e-6, 1e-6, 3)
        kmt.hc_mixes_triton_invariant(torch.randn(n, 4, 16, generator=g), fn, base, scale, 1e-6, 1e-6, 3)
    assert calls == [8]
