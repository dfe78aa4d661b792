"""The Hopper layout of FP4 experts (kernels/experts_ogs_triton.py) on CPU: the in-place rearrangement and its
inverse bit for bit, equal to triton_kernels' own `convert_layout`, the reference backend reading either layout to
the same bits, and `Experts.relayout`'s rules (what stays in rows, no second copy). Needs triton_kernels (an
optional dependency, README); the kernel itself runs on the GPU only (tests/test_gpu_experts_ogs.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("triton_kernels")

from deepinfer.kernels import experts_ogs as ogs                  # noqa: E402
from deepinfer.kernels.experts import ExpertWeights, grouped_experts, weight_layout   # noqa: E402
from deepinfer.kernels.table import use                                  # noqa: E402
from tests.test_kernels_experts import random_weights, routed_rows      # noqa: E402

DIM, INTER = 256, 384           # multiples of 128 (the scale swizzle) and 64 (the value swizzle)


@pytest.mark.parametrize("n_experts", [1, 5, 37])        # 37: more than one RELAYOUT_EXPERTS chunk, a ragged last
def test_relayout_round_trip_in_place(n_experts):
    gen = torch.Generator().manual_seed(n_experts)
    w = torch.randint(0, 256, (n_experts, INTER, DIM // 2), generator=gen, dtype=torch.uint8)
    s = torch.randint(100, 140, (n_experts, INTER, DIM // 32), generator=gen, dtype=torch.uint8)
    w0, s0, ptrs = w.clone(), s.clone(), (w.data_ptr(), s.data_ptr())
    ogs.to_hopper(w, s)
    assert (w.data_ptr(), s.data_ptr()) == ptrs and w.shape == w0.shape and s.shape == s0.shape
    assert not torch.equal(w, w0)                         # rearranged, not left alone
    ogs.to_rows(w, s)
    assert torch.equal(w, w0) and torch.equal(s, s0)


def test_hopper_bytes_are_triton_kernels_layout():
    """Our chunked in-place rearrangement holds exactly what triton_kernels' convert_layout builds for the whole
    stack (its public API, one call): the kernel then reads what it expects."""
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(0, 256, (19, DIM, INTER // 2), generator=gen, dtype=torch.uint8)
    s = torch.randint(100, 140, (19, DIM, INTER // 32), generator=gen, dtype=torch.uint8)
    value = convert_layout(wrap_torch_tensor(w.transpose(1, 2), dtype=FP4), HopperMXValueLayout, mx_axis=1)
    scale = convert_layout(wrap_torch_tensor(s.transpose(1, 2)), HopperMXScaleLayout, mx_axis=1,
                           num_warps=ogs.SCALE_WARPS)
    ogs.to_hopper(w, s)
    wv, sv = ogs.swizzled_views(w, s)
    assert torch.equal(wv, value.storage.data) and torch.equal(sv, scale.storage.data)


def test_joined_halves_hold_each_halfs_layout():
    """[W1; W3] laid out as one [E, 2I, K/2] weight holds, in its halves, the layouts of W1 and W3 alone (the
    swizzles keep column blocks outermost), so one GEMM reads both and each half reads as itself."""
    gen = torch.Generator().manual_seed(5)
    w = torch.randint(0, 256, (3, 2 * INTER, DIM // 2), generator=gen, dtype=torch.uint8)
    s = torch.randint(100, 140, (3, 2 * INTER, DIM // 32), generator=gen, dtype=torch.uint8)
    joint_w, joint_s = w.clone(), s.clone()
    ogs.to_hopper(joint_w, joint_s)
    for half in (slice(0, INTER), slice(INTER, 2 * INTER)):
        ogs.to_hopper(w[:, half], s[:, half])
    assert torch.equal(w, joint_w) and torch.equal(s, joint_s)
    assert ogs.halves(w[:, :INTER], w[:, INTER:]) and not ogs.halves(w[:, INTER:], w[:, :INTER])
    assert torch.equal(ogs.whole(w[:, :INTER]), w)


def test_reference_reads_either_layout_to_the_same_bits():
    gen = torch.Generator().manual_seed(2)
    ew = random_weights(7, DIM, INTER, torch.bfloat16, "fp4", gen)
    hw = ogs.hopper_copy(ew)
    for index in (3, slice(1, 5), torch.tensor([6, 0, 6, 2])):
        for name in ("w1", "w2", "w3"):
            assert torch.equal(hw.get(name, index), ew.get(name, index))
    x, ids, offs, r = routed_rows(40, 7, DIM, torch.bfloat16, gen)
    for backend in ("reference", "invariant", "triton", "triton_invariant"):   # CPU: the Triton sets fall back
        with use(backend):
            assert torch.equal(grouped_experts(x, ids, offs, r, hw), grouped_experts(x, ids, offs, r, ew))


def test_layout_rules():
    gen = torch.Generator().manual_seed(3)
    ew = random_weights(3, DIM, INTER, torch.bfloat16, "fp4", gen)
    assert ogs.fits(ew)
    assert not ogs.fits(dataclasses.replace(ew, act_fp8=True))                      # W4A8: our kernel
    assert not ogs.fits(random_weights(3, 192, INTER, torch.bfloat16, "fp4", gen))  # 192 columns: not 128-aligned
    assert not ogs.fits(random_weights(3, DIM, INTER, torch.bfloat16, "bf16", gen))
    assert weight_layout("triton", "cpu") == "rows" and weight_layout("reference", "cpu") == "rows"
    assert not ogs.runs_on("cpu")
    with pytest.raises(ValueError, match="hopper_mx"):
        ExpertWeights(ew.w1.float(), ew.w2.float(), ew.w3.float(), torch.bfloat16, 10.0, layout=ogs.HOPPER)


def test_experts_relayout():
    """Experts.relayout rearranges the model's own buffers (no copy kept), goes back to rows when W4A8 is turned on,
    and leaves weights the layout cannot take (unaligned widths) in rows."""
    from deepinfer.models.common.moe import Experts
    gen = torch.Generator().manual_seed(4)
    ex = Experts(4, DIM, INTER, 10.0, torch.bfloat16, storage="fp4")
    for t in ex.stack().values():
        t.copy_(torch.randint(118, 122, t.shape, generator=gen, dtype=torch.uint8))
    before = {n: t.clone() for n, t in ex.stack().items()}
    ptrs = {n: ex.stack()[n].data_ptr() for n in ("w2_fp4", "w2_scale")}
    x, ids, offs, r = routed_rows(30, 4, DIM, torch.bfloat16, gen)
    want = grouped_experts(x, ids, offs, r, ex.stacked())
    ex.relayout(ogs.HOPPER)
    assert ex.layout == ogs.HOPPER and {n: ex.stack()[n].data_ptr() for n in ptrs} == ptrs   # w2 in place
    assert ogs.halves(ex.w1_fp4, ex.w3_fp4) and ogs.halves(ex.w1_scale, ex.w3_scale)      # w1 | w3: one buffer
    assert torch.equal(grouped_experts(x, ids, offs, r, ex.stacked()), want)
    ex.act_fp8 = True
    ex.relayout(ogs.HOPPER)                  # W4A8 runs our kernel, which reads rows
    assert ex.layout == ogs.ROWS and all(torch.equal(t, before[n]) for n, t in ex.stack().items())
    odd = Experts(2, 192, INTER, 10.0, torch.bfloat16, storage="fp4")
    odd.relayout(ogs.HOPPER)
    assert odd.layout == ogs.ROWS
