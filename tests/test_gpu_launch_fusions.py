"""On CUDA, the one-launch ops that replaced torch sequences in the decode step (kernels/gather_triton.py,
kernels/softmax_pool_triton.py, experts_triton.swiglu_triton / tile_table, routing_triton's one-block permute)
against their references on fresh random inputs at released sizes, and all of them captured in one CUDA graph and
replayed on new values written into its inputs."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("triton")

from deepinfer.kernels import experts as kx                              # noqa: E402
from deepinfer.kernels import experts_triton as kt                       # noqa: E402
from deepinfer.kernels import gather_triton as kg                        # noqa: E402
from deepinfer.kernels import routing, routing_triton                    # noqa: E402
from deepinfer.kernels import softmax_pool_triton as ks                  # noqa: E402
from deepinfer.kernels.attention import SplitStore                       # noqa: E402
from deepinfer.kernels.gather import _gather_rows                        # noqa: E402
from deepinfer.kernels.softmax_pool import _softmax_pool                 # noqa: E402

DEV = "cuda"


def _inputs(seed: int, rows: int = 64, experts: int = 384, k: int = 6) -> dict:
    g = torch.Generator(device=DEV).manual_seed(seed)
    ring = torch.randn(512 * 8, 512, generator=g, device=DEV)                # 512 seats x 8 pending rows, fp32
    new = torch.randn(rows, 512, generator=g, device=DEV)
    index = torch.randint(-1, ring.shape[0] + rows, (rows, 8), generator=g, device=DEV)
    ids = torch.stack([torch.randperm(experts, generator=g, device=DEV)[:k] for _ in range(rows)])
    counts = torch.bincount(ids.flatten(), minlength=experts)
    return dict(ring=ring, new=new, index=index, ids=ids, weights=torch.rand(rows, k, generator=g, device=DEV),
                offsets=torch.cat([counts.new_zeros(1), counts.cumsum(0)]),
                gate=torch.randn(rows, 2048, generator=g, device=DEV).bfloat16() * 8,
                up=torch.randn(rows, 2048, generator=g, device=DEV).bfloat16() * 8,
                kv=torch.randn(rows, 8, 512, generator=g, device=DEV), score=torch.randn(rows, 8, 512, generator=g,
                                                                                         device=DEV) * 4)


def _fused(t: dict) -> list[torch.Tensor]:
    return [kg.gather_rows_triton(SplitStore(t["ring"], t["new"]), t["index"], torch.finfo(torch.float32).min),
            *kt.tile_table(t["offsets"], 16, t["ids"].numel()),
            kt.swiglu_triton(t["gate"], t["up"], 10.0),
            ks.softmax_pool_triton(t["kv"], t["score"]),
            *routing_triton._permute_triton(t["ids"], t["weights"], 384)]


def _reference(t: dict) -> list[torch.Tensor]:
    return [_gather_rows(SplitStore(t["ring"], t["new"]), t["index"], torch.finfo(torch.float32).min),
            *kt._tile_table(t["offsets"], 16, t["ids"].numel()),
            kx._swiglu(t["gate"], t["up"], 10.0),
            _softmax_pool(t["kv"], t["score"]),
            *routing._permute_reference(t["ids"], t["weights"], 384)]


def _check(got, want):
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, i
        if i in (4, 5):                                                   # swiglu, softmax_pool: the kernels' exp
            torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
        else:                                                             # data movement and integers: the bits
            assert torch.equal(a, b), i


@pytest.mark.parametrize("rows", [1, 64, 128])
def test_fused_ops_equal_their_references(rows):
    t = _inputs(rows, rows)
    _check(_fused(t), _reference(t))


def test_one_cuda_graph_of_the_fused_ops_replays_new_inputs():
    static = _inputs(0)
    _fused(static)                                                        # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _fused(static)
    for seed in (1, 2):
        fresh = _inputs(seed)
        for name, value in fresh.items():
            static[name].copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        _check(outs, _reference(static))
