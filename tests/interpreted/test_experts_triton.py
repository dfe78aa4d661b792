"""kernels/experts_triton.py in Triton's interpreter: every weight format (dense, fp4, fp8), both numerics (A16,
A8) and every tile configuration against the reference backend's same recipe (kernels/experts.py) on fresh
random inputs, including an expert with 0 or 1 rows, all rows on one expert and K not a multiple of the K step.
The interpreter has no bf16, so the compute dtype here is fp32 (fp16 for one case); the GPU tests
(tests/test_kernels_experts_triton.py) run bf16 at released shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.kernels import experts as kx
from deepinfer.kernels import experts_triton as kt
from deepinfer.kernels.experts import ExpertWeights, grouped_experts
from deepinfer.kernels.table import use
from tests.test_kernels_experts import expected, random_weights, rel_err, routed_rows

# max |triton - reference| / max |reference|, same recipe: fp32 summation order only (A8: plus e4m3 ties of h)
BOUND = {False: 2e-5, True: 2e-5}
CONFIGS = {"decode": kt.DECODE, "prefill": kt.PREFILL, "invariant": kt.INVARIANT, "invariant_fp4": kt.INVARIANT_FP4}


def fp8_weights(n_experts, dim, inter, dtype, gen, limit=10.0) -> ExpertWeights:
    """e4m3 values of N(0, 1), fp32 block scales in [0.01, 0.05] per 128x128."""
    shapes = {"w1": (inter, dim), "w2": (dim, inter), "w3": (inter, dim)}
    ws, ss = [], []
    for r, c in shapes.values():
        ws.append(torch.randn(n_experts, r, c, generator=gen).clamp(-448, 448).to(torch.float8_e4m3fn))
        ss.append(0.01 + 0.04 * torch.rand(n_experts, -(-r // 128), -(-c // 128), generator=gen))
    return ExpertWeights(*ws, dtype=dtype, limit=limit, scales=tuple(ss))


def weights(storage, n_experts, dim, inter, dtype, gen, act_fp8=False, limit=10.0) -> ExpertWeights:
    ew = (fp8_weights(n_experts, dim, inter, dtype, gen, limit) if storage == "fp8"
          else random_weights(n_experts, dim, inter, dtype, storage, gen, limit=limit))
    return dataclasses.replace(ew, act_fp8=act_fp8)


CASES = [  # storage, act_fp8, D, I
    ("dense", False, 256, 128), ("dense", False, 160, 96),        # K tails: 160 = 128 + 32, 96 < 128
    ("fp4", False, 256, 128), ("fp4", False, 160, 96),
    ("fp4", True, 256, 128), ("fp4", True, 384, 256),
    ("fp8", False, 256, 128), ("fp8", False, 200, 72),            # ragged 128x128 scale blocks
    ("fp8", True, 256, 128),
]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("storage,act_fp8,dim,inter", CASES)
def test_kernel_equals_reference(storage, act_fp8, dim, inter, config):
    gen = torch.Generator().manual_seed(dim + inter + len(config) + 7 * act_fp8)
    ew = weights(storage, 6, dim, inter, torch.float32, gen, act_fp8, limit=1.0 if config == "decode" else 10.0)
    # experts 0..5 with 1 or 0 rows on some: 9 rows over experts [0, 2, 2, 3, 3, 3, 5, 5, 5]
    x, ids, offsets, r = routed_rows(9, 6, dim, torch.float32, gen, experts=[0, 2, 3, 5])
    got = kt.run(x, offsets, r, ew, CONFIGS[config])
    want = kx._reference(x, ids, offsets, r, ew)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert rel_err(got, want.double()) <= BOUND[act_fp8]
    if not act_fp8:   # A16 is the plain math: also against the float64 row-by-row oracle
        assert rel_err(got, expected(x, ids, r, ew)) <= 2e-5


@pytest.mark.parametrize("storage", ["fp4", "fp8"])
def test_all_rows_on_one_expert_and_tiles_past_the_end(storage):
    gen = torch.Generator().manual_seed(11)
    ew = weights(storage, 5, 128, 128, torch.float32, gen, act_fp8=True)
    x, ids, offsets, r = routed_rows(70, 5, 128, torch.float32, gen, experts=[4])    # 70 rows: 2 tiles of 64
    got = kt.run(x, offsets, r, ew, kt.PREFILL)
    assert rel_err(got, kx._reference(x, ids, offsets, r, ew).double()) <= BOUND[True]


def test_fp16_compute_dtype():
    gen = torch.Generator().manual_seed(5)
    ew = weights("fp4", 4, 128, 128, torch.float16, gen)
    x, ids, offsets, r = routed_rows(12, 4, 128, torch.float16, gen)
    got = kt.run(x, offsets, r, ew, kt.DECODE)
    assert rel_err(got, expected(x, ids, r, ew)) <= 5e-3     # h rounded to fp16 between the GEMMs


def test_backend_sets_route_to_the_kernels(monkeypatch):
    """`triton` and `triton_invariant` run the kernels (with their own tiles) on what they support and the reference
    elsewhere."""
    gen = torch.Generator().manual_seed(2)
    ew = weights("fp4", 4, 128, 128, torch.float32, gen, act_fp8=True)
    x, ids, offsets, r = routed_rows(10, 4, 128, torch.float32, gen)
    want = kx._reference(x, ids, offsets, r, ew).double()
    seen = []
    real_run = kt.run
    monkeypatch.setattr(kt, "run", lambda *a: seen.append(a[-1]) or real_run(*a))
    for backend, tiles in (("triton", kt.DECODE), ("triton_invariant", kt.INVARIANT_FP4)):
        with use(backend):
            assert rel_err(grouped_experts(x, ids, offsets, r, ew), want) <= BOUND[True]
            assert seen[-1] == tiles                  # the kernels ran, with the set's configuration
            zero = grouped_experts(x[:0], ids[:0], torch.zeros_like(offsets), r[:0], ew)
            assert zero.shape == (0, 128)
    f64 = random_weights(4, 64, 32, torch.float64, "dense", gen)
    assert not kt.supported(x.double(), f64)           # float64 models stay on the reference


def test_fold_is_exact_within_fourteen_binades_and_measured_beyond():
    """W4A8 folds the per-32 e8m0 scales into e4m3 weights: exact while a 128-block's scales span <= 2^14.
    Beyond that the low 32-block's small values fall below e4m3's subnormal step and round."""
    gen = torch.Generator().manual_seed(9)
    ew = weights("fp4", 2, 128, 128, torch.float32, gen, act_fp8=True)
    for span, bound in ((14, BOUND[True]), (20, 2e-2)):
        s1 = torch.full_like(ew.scales[0], 127)
        s1[:, :, 0] = 127 - span                   # the first 32-block of every row 2^-span below the rest
        ew2 = dataclasses.replace(ew, scales=(s1, ew.scales[1], ew.scales[2]))
        x, ids, offsets, r = routed_rows(4, 2, 128, torch.float32, gen)
        err = rel_err(kt.run(x, offsets, r, ew2, kt.DECODE), kx._reference(x, ids, offsets, r, ew2).double())
        assert err <= bound, (span, err)


@pytest.mark.parametrize("experts,rows,bm", [(384, 6, 16), (384, 1536, 16), (12, 40, 64), (256, 300, 64), (5, 0, 16),
                                             (1, 33, 16), (384, 49152, 64)])
def test_tile_table_kernel_equals_the_torch_table(experts, rows, bm):
    """One launch builds the torch formulation's table bit for bit: experts with no rows, one expert holding every
    row, unused tiles past the last expert's (their row count 0, row and expert clamped as the torch table does),
    V4.1's 384 experts at decode and prefill sizes."""
    g = torch.Generator().manual_seed(experts + rows + bm)
    if rows and experts > 1:
        counts = torch.bincount(torch.randint(0, experts, (rows,), generator=g), minlength=experts)
        counts[torch.randperm(experts, generator=g)[: experts // 3]] = 0       # a third of the experts get none
        counts[0] += rows - int(counts.sum())
    else:
        counts = torch.full((experts,), rows // max(experts, 1), dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    n = int(offsets[-1])
    want, got = kt._tile_table(offsets, bm, n), kt.tile_table(offsets, bm, n)
    assert all(a.dtype == torch.int32 and torch.equal(a, b) for a, b in zip(got, want))
    used = int(((counts + bm - 1) // bm).sum())                       # the tiles the experts' rows fill
    assert int(got[2].sum()) == n and bool((got[2][:used] > 0).all()) and bool((got[2][used:] == 0).all())


@pytest.mark.parametrize("m,n,limit,dtype", [(1, 2048, 10.0, torch.float32), (5, 1500, 0.0, torch.float16),
                                             (33, 64, 7.0, torch.float32)])
def test_swiglu_kernel_equals_the_reference(m, n, limit, dtype):
    """The dense MLP's activation in one launch: fp32 out, within an ulp or two of torch's silu (exp differs), the
    clamps exactly (values past +-limit in the case), widths not a multiple of the block, fp16 inputs upcast."""
    g = torch.Generator().manual_seed(m * n)
    gate, up = (torch.randn(m, n, generator=g) * 8).to(dtype), (torch.randn(m, n, generator=g) * 8).to(dtype)
    want, got = kx._swiglu(gate, up, limit), kt.swiglu_triton(gate, up, limit)
    assert got.dtype == want.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    if limit:
        assert bool((gate.float() > limit).any()) and bool((up.float().abs() > limit).any())
    with use("triton") as table:                           # the op's entry reaches the kernel
        assert table.backends["swiglu"] == "triton"
        torch.testing.assert_close(kx.swiglu(gate, up, limit), want, rtol=1e-6, atol=1e-6)
