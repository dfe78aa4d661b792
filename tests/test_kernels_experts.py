"""kernels/experts.py: every backend and every formulation of `grouped_experts` against a plain per-expert torch
reference, on fresh random inputs (dense and FP4 weights, float64 and float32), and the invariant backend's
bitwise row independence. GPU tests check the CUDA paths (gathered, _grouped_mm, expert-aligned tiles) the same
way and that they run without a host sync (CUDA graph capture)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels import experts as kx
from deepinfer.kernels.experts import ExpertWeights, grouped_experts
from deepinfer.kernels.quant import dequantize_fp4, dequantize_fp8_blocks
from deepinfer.kernels.table import use

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# measured bounds (max |got - want| / max |want|); see docs/model.md "MoE"
BOUND = {torch.float64: 1e-13, torch.float32: 2e-6, torch.bfloat16: 2e-2}


def random_weights(n_experts, dim, inter, dtype, storage, gen, device="cpu", limit=10.0) -> ExpertWeights:
    """Dense: N(0, 0.1) in `dtype`. FP4: e2m1 codes anywhere, e8m0 scales 2^-2..2^1 (bytes 125..128)."""
    shapes = {"w1": (inter, dim), "w2": (dim, inter), "w3": (inter, dim)}
    if storage == "fp4":
        packed = [torch.randint(0, 256, (n_experts, r, c // 2), generator=gen, dtype=torch.uint8)
                  for r, c in shapes.values()]
        scales = [torch.randint(125, 129, (n_experts, r, c // 32), generator=gen, dtype=torch.uint8)
                  for r, c in shapes.values()]
        return ExpertWeights(*(p.to(device) for p in packed), dtype=dtype, limit=limit,
                             scales=tuple(s.to(device) for s in scales))
    dense = [(torch.randn((n_experts,) + s, generator=gen, dtype=torch.float64) * 0.1).to(dtype).to(device)
             for s in shapes.values()]
    return ExpertWeights(*dense, dtype=dtype, limit=limit)


def dense_of(ew: ExpertWeights, name: str, e: int) -> torch.Tensor:
    w = getattr(ew, name)[e]
    if ew.scales is None:
        return w
    scale = ew.scales["w1 w2 w3".split().index(name)][e]
    if ew.fmt == "fp8":
        return dequantize_fp8_blocks(w, scale, (128, 128), ew.dtype)
    return dequantize_fp4(w, scale, 32, ew.dtype)


def expected(x, ids, r, ew: ExpertWeights) -> torch.Tensor:
    """The plain reference: row by row, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for j in range(x.shape[0]):
        e = int(ids[j])
        w1, w2, w3 = (dense_of(ew, n, e).double().cpu() for n in ("w1", "w2", "w3"))
        xj = x[j].double().cpu()
        g, u = w1 @ xj, w3 @ xj
        if ew.limit > 0:
            g, u = g.clamp(max=ew.limit), u.clamp(-ew.limit, ew.limit)
        out[j] = w2 @ (F.silu(g) * u * float(r[j]))
    return out


def routed_rows(m, n_experts, dim, dtype, gen, device="cpu", experts=None):
    """m sorted rows: (x [m, D], ids [m] ascending, offsets [E+1], routing weights [m] fp32/fp64)."""
    pool = torch.arange(n_experts) if experts is None else torch.tensor(experts)
    ids = pool[torch.randint(0, len(pool), (m,), generator=gen)].sort().values
    offsets = torch.searchsorted(ids, torch.arange(n_experts + 1))
    x = torch.randn(m, dim, generator=gen, dtype=torch.float64).to(dtype)
    r = torch.rand(m, generator=gen, dtype=torch.float64).to(torch.float64 if dtype == torch.float64 else torch.float32)
    return x.to(device), ids.to(device), offsets.to(device), r.to(device)


def rel_err(got, want) -> float:
    return (got.double().cpu() - want).abs().max().item() / max(want.abs().max().item(), 1e-30)


def _in_steps(fn, x, i, r, w):
    """fn with GATHER_BYTES set so that 3 rows are gathered at a time."""
    before = kx.GATHER_BYTES
    kx.GATHER_BYTES = 3 * w.bytes_per_expert()
    try:
        return fn(x, i, r, w)
    finally:
        kx.GATHER_BYTES = before


FORMULATIONS = {
    "per_expert": lambda x, i, o, r, w: kx._per_expert(x, o, r, w, tile=None),
    "per_expert_tiles": lambda x, i, o, r, w: kx._per_expert(x, o, r, w, tile=16),
    "gathered": lambda x, i, o, r, w: kx._gathered(x, i, r, w),
    "gathered_steps": lambda x, i, o, r, w: _in_steps(kx._gathered, x, i, r, w),
    "tiled16": lambda x, i, o, r, w: kx._tiled(x, i, o, r, w, 16),
    "tiled5": lambda x, i, o, r, w: kx._tiled(x, i, o, r, w, 5),
}


@pytest.mark.parametrize("storage", ["dense", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("rows", [1, 7, 40])
@pytest.mark.parametrize("how", list(FORMULATIONS) + ["reference", "invariant"])
def test_matches_plain_reference(how, rows, dtype, storage):
    gen = torch.Generator().manual_seed(rows * 7 + len(how))
    ew = random_weights(12, 64, 32, dtype, storage, gen, limit=1.0 if rows == 7 else 10.0)   # 1.0: clamps bind
    x, ids, offsets, r = routed_rows(rows, 12, 64, dtype, gen, experts=[0, 3, 4, 11] if rows == 40 else None)
    if how in FORMULATIONS:
        got = FORMULATIONS[how](x, ids, offsets, r, ew)
    else:
        with use(how):
            got = grouped_experts(x, ids, offsets, r, ew)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert got.shape == x.shape
    assert rel_err(got, expected(x, ids, r, ew)) <= BOUND[dtype]


@pytest.mark.parametrize("backend", ["reference", "invariant"])
def test_zero_rows_and_one_expert(backend):
    gen = torch.Generator().manual_seed(1)
    ew = random_weights(8, 32, 16, torch.float64, "dense", gen)
    with use(backend):
        x, ids, offsets, r = routed_rows(0, 8, 32, torch.float64, gen)
        assert grouped_experts(x, ids, offsets, r, ew).shape == (0, 32)
        x, ids, offsets, r = routed_rows(33, 8, 32, torch.float64, gen, experts=[5])    # every row on expert 5
        assert rel_err(grouped_experts(x, ids, offsets, r, ew), expected(x, ids, r, ew)) <= BOUND[torch.float64]


@pytest.mark.parametrize("chunk_experts", [None, 1, 3])
def test_grouped_mm_path_on_cpu(monkeypatch, chunk_experts):
    """The CUDA bf16 path's logic (torch._grouped_mm, FP4 in chunks of experts with rows rotated to the front)
    runs on CPU too, in fp32: same result as the plain reference."""
    gen = torch.Generator().manual_seed(3)
    ew = random_weights(10, 64, 32, torch.float32, "fp4" if chunk_experts else "dense", gen)
    if chunk_experts:
        monkeypatch.setattr(kx, "GROUPED_CHUNK_BYTES", chunk_experts * ew.bytes_per_expert())
    x, ids, offsets, r = routed_rows(50, 10, 64, torch.float32, gen, experts=[0, 2, 3, 4, 7, 9])
    assert rel_err(kx._grouped(x, offsets, r, ew), expected(x, ids, r, ew)) <= BOUND[torch.float32]


def test_tile_layout_bound():
    """Expert-aligned tiles: each tile holds one expert's rows; the static bound covers the worst case."""
    for ids in ([0] * 17 + [1] + [5] * 16, list(range(8)), [3] * 5, [0, 0, 1, 2, 2, 2, 7]):
        ids = torch.tensor(ids)
        offsets = torch.searchsorted(ids, torch.arange(9))
        slot, tile_expert, n_tiles = kx.tile_layout(ids, offsets, 4)
        assert len(set(slot.tolist())) == len(ids) and int(slot.max()) < n_tiles * 4
        assert torch.equal(tile_expert[slot // 4], ids)


def _target_bits(fn, x, ids, r, gen, n_experts, others: int, place: int):
    """The op's output for rows (x, ids, r) of one token, alone (others=0) or among `others` random rows, with
    the target's rows at `place` within each of its experts' groups (0 first, -1 last)."""
    ox, oids, _, orr = routed_rows(others, n_experts, x.shape[1], x.dtype, gen)
    allx, allids, allr = torch.cat([x, ox]), torch.cat([ids, oids]), torch.cat([r, orr])
    key = allids * 4 + torch.cat([torch.full_like(ids, 1 if place == 0 else 3), torch.full_like(oids, 2)])
    order = key.sort(stable=True).indices
    allx, allids, allr = allx[order], allids[order], allr[order]
    offsets = torch.searchsorted(allids, torch.arange(n_experts + 1))
    y = fn(allx, allids, offsets, allr)
    where = order.argsort()[: x.shape[0]]
    return y[where]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("how", ["invariant", "tiled16"])
@pytest.mark.parametrize("storage", ["dense", "fp4"])
def test_invariant_rows_independent_of_batch(how, storage):
    """A token's k rows give the same bits alone and inside batches of other rows (first / last in their
    experts' groups), for the invariant backend and the CUDA formulation it uses (run here on CPU)."""
    gen = torch.Generator().manual_seed(5)
    E = 16
    ew = random_weights(E, 64, 32, torch.float32, storage, gen)
    x = torch.randn(1, 64, generator=gen).expand(4, 64).contiguous()
    ids, r = torch.tensor([1, 6, 7, 12]), torch.rand(4, generator=gen)
    if how == "invariant":
        def fn(*a):
            with use("invariant"):
                return grouped_experts(*a, ew)
    else:
        def fn(x, i, o, r):
            return kx._tiled(x, i, o, r, ew, 16)
    alone = _target_bits(fn, x, ids, r, gen, E, 0, 0)
    for others in (1, 5, 30, 77):
        for place in (0, -1):
            assert torch.equal(_target_bits(fn, x, ids, r, gen, E, others, place), alone), (others, place)




# ------------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("storage", ["dense", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64], ids=["bf16", "f32", "f64"])
@pytest.mark.parametrize("rows", [3, 24, 300])     # 3: gathered; 24, 300: _grouped_mm (bf16) or tiles
@pytest.mark.parametrize("backend", ["reference", "invariant"])
def test_cuda_matches_plain_reference(backend, rows, dtype, storage):
    gen = torch.Generator().manual_seed(rows)
    ew = random_weights(16, 128, 64, dtype, storage, gen, device="cuda")
    x, ids, offsets, r = routed_rows(rows, 16, 128, dtype, gen, device="cuda",
                                     experts=[0, 1, 5, 9, 15] if rows == 300 else None)
    with use(backend):
        got = grouped_experts(x, ids, offsets, r, ew)
    err = rel_err(got, expected(x.cpu(), ids.cpu(), r.cpu(), _cpu(ew)))
    print(f"\n[grouped_experts cuda {backend} {dtype} {storage} rows={rows}] rel err {err:.2e}")
    assert err <= BOUND[dtype] * (4 if dtype == torch.float32 else 1)   # TF32 off; cuBLAS fp32 split-K order


def _cpu(ew: ExpertWeights) -> ExpertWeights:
    return ExpertWeights(ew.w1.cpu(), ew.w2.cpu(), ew.w3.cpu(), ew.dtype, ew.limit,
                         None if ew.scales is None else tuple(s.cpu() for s in ew.scales))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("storage", ["dense", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_cuda_invariant_rows_independent_of_batch(dtype, storage):
    gen = torch.Generator().manual_seed(9)
    E = 16
    ew = random_weights(E, 128, 64, dtype, storage, gen, device="cuda")
    x = torch.randn(1, 128, generator=gen).to(dtype).expand(4, 128).contiguous().cuda()
    ids, r = torch.tensor([1, 6, 7, 12], device="cuda"), torch.rand(4, generator=gen).cuda()

    def fn(*a):
        with use("invariant"):
            return grouped_experts(*a, ew)

    def others_gen():
        return torch.Generator().manual_seed(11)

    def bits(others, place):
        g = others_gen()
        ox, oids, _, orr = routed_rows(others, E, 128, dtype, g, device="cuda")
        allx, allids, allr = torch.cat([x, ox]), torch.cat([ids, oids]), torch.cat([r, orr])
        key = allids * 4 + torch.cat([torch.full_like(ids, 1 if place == 0 else 3), torch.full_like(oids, 2)])
        order = key.sort(stable=True).indices
        sx, sids, sr = allx[order], allids[order], allr[order]
        offsets = torch.searchsorted(sids, torch.arange(E + 1, device="cuda"))
        return fn(sx, sids, offsets, sr)[order.argsort()[:4]]
    alone = bits(0, 0)
    for others in (1, 5, 30, 200, 1000):
        for place in (0, -1):
            assert torch.equal(bits(others, place), alone), (others, place)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64, torch.float16])
def test_fast_fp4_dequant_is_the_reference_bitwise(dtype):
    """Every byte with every e8m0 scale (NaN 255 and the subnormal 2^-127 included)."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(256, 16)                      # [256, 4096]
    scale = torch.arange(256, dtype=torch.uint8).unsqueeze(-1).expand(256, 256).contiguous()   # [256, 256]
    want, got = dequantize_fp4(packed, scale, 32, dtype), kx.dequantize_fp4_fast(packed, scale, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.isnan(), want.isnan())
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    assert torch.equal(got[~want.isnan()].view(ints), want[~want.isnan()].view(ints))
