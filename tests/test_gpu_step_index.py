"""The step-index kernels (kernels/step_index_triton.py, entry_pick included) on CUDA against the torch reference: the same integers on
random step layouts (the interpreter cases' layouts, moved to the GPU), and a CUDA graph of all four ops replayed
on new positions, slots and tables written into its static inputs."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

pytest.importorskip("triton")

from deepinfer.kernels import step_index as ref                       # noqa: E402
from deepinfer.kernels import step_index_triton as kt                 # noqa: E402
from tests.interpreted.test_step_index_triton import _layout, _pools  # noqa: E402

DEV = "cuda"


def _case(seed, segments, subset):
    lay = _layout(seed, segments)
    table, floor = _pools(lay)
    rows = torch.randperm(lay["n"], generator=lay["g"])[: max(1, lay["n"] // 2)] if subset else None
    top = torch.stack([torch.randperm(256, generator=lay["g"])[:6] for _ in range(lay["n"])])    # picks of 4 x 64
    top[torch.rand(top.shape, generator=lay["g"]) < 0.3] = -1
    cpu = dict(pos=lay["pos"], start=lay["start"], first=lay["first"], slot=lay["slot"], seg=lay["seg"],
               end=lay["end"], table=table, floor=floor, rows=rows, top=top)
    return {k: None if v is None else v.to(DEV) for k, v in cpu.items()}


def _all_ops(t, count=128, span=128, ratio=4, per_block=16, ctx_blocks=4):
    """Every op of the set on one case: a flat list of int64 tensors."""
    return [
        ref.ring_index(t["pos"], t["start"], t["first"], t["slot"], None, 7 * span, count, span),
        ref.ring_index(t["pos"], t["start"], t["first"], t["seg"], t["rows"], 9 * span, 5, 8),
        *ref.ring_slots(t["pos"], t["end"], t["slot"], span, -5),
        *ref.entry_slots(t["pos"], t["slot"], t["rows"], t["table"], t["floor"], ratio, per_block, ratio * per_block,
                         -5),
        ref.entry_index(t["pos"], t["slot"], None, t["table"], ctx_blocks, ratio, per_block),
        ref.entry_index(t["pos"], t["slot"], t["rows"], t["table"], 9, 2, 300),
        ref.entry_pick(ref.entry_index(t["pos"], t["slot"], None, t["table"], 4, 2, 64), t["top"]),
    ]


@pytest.mark.parametrize("segments,subset", [(1, False), (4, True), (9, True), (64, False)])
def test_cuda_ops_equal_the_reference(segments, subset):
    from deepinfer.kernels.table import use
    t = _case(segments * 11, segments, subset)
    with use("reference"):
        want = _all_ops(t)
    with use("triton") as table:
        assert table.backends["ring_index"] == table.backends["entry_index"] == "triton"
        got = _all_ops(t)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.is_cuda and g.dtype == torch.long and torch.equal(g, w)


def test_cuda_graph_of_the_ops_replays_new_inputs():
    """Captured once, replayed after new values are copied into the static inputs: the reference's integers on
    the new values (the kernels read only device memory, no host values baked in but the shapes)."""
    from deepinfer.kernels.table import use
    static = _case(5, 6, True)
    with use("triton"):
        _all_ops(static)                                                   # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = _all_ops(static)
    g = torch.Generator(device=DEV).manual_seed(0)
    for shift in (3, 250):                    # the same segments later in their sequences, other slots and tables
        for k in ("pos", "start", "end"):
            static[k].add_(shift)
        static["slot"].copy_((static["slot"] + shift) % 7)
        static["table"].copy_(torch.randint(0, 40, static["table"].shape, generator=g, device=DEV,
                                            dtype=torch.int32))
        static["floor"].copy_(torch.randint(0, 200, static["floor"].shape, generator=g, device=DEV))
        graph.replay()
        torch.cuda.synchronize()
        with use("reference"):
            want = _all_ops(static)
        assert all(torch.equal(o, w) for o, w in zip(outs, want))
