"""Programmatic dependent launch on the GPU (`-m gpu`, sm_90+): a CUDA graph of 180 dependent Triton kernels,
each reading what the one before wrote into memory the graph's pool recycles, gives bit for bit what the same chain
gives launched eagerly without PDL. A kernel that read its input before its predecessor finished would read a
recycled buffer's old rows (kernels/pdl.py)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import pdl as pdl_module

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _chain(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    from deepinfer.kernels.norm_triton import rms_norm_kernel
    from deepinfer.kernels.rope_triton import rope_angles_triton

    for i, w in enumerate(weights):
        x = rms_norm_kernel(x, w, 1e-6)        # [rows, n]: reads every row the previous kernel wrote
        if i % 3 == 0:                         # a narrow kernel between two wide ones (an early reader of x)
            cos, _ = rope_angles_triton(x[:, 0].float().mul(64).round().to(torch.int64).abs(),
                                        torch.linspace(1.0, 1e-3, 32, device=x.device))
            x = x + cos.sum(-1, keepdim=True).to(x.dtype)
    return x


def test_a_graph_of_dependent_kernels_under_pdl_equals_eager_launches(monkeypatch):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90+")
    from deepinfer.kernels.pdl import pdl

    monkeypatch.setattr(pdl_module, "_PDL", True)           # DEEPINFER_PDL=1
    assert pdl("cuda")["PDL"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x0 = torch.randn(4096, 4096, device="cuda", generator=gen).to(torch.bfloat16)      # 32 MB a kernel reads
    weights = [torch.rand(4096, device="cuda", generator=gen).add(0.5).to(torch.bfloat16) for _ in range(120)]

    static = x0.clone()
    _chain(static, weights[:2])                             # compile before capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = _chain(static, weights)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    on = out.clone()

    monkeypatch.setattr(pdl_module, "_PDL", False)
    off = _chain(x0.clone(), weights)
    torch.cuda.synchronize()
    assert torch.equal(on, off)
    assert on.float().abs().max() > 0
