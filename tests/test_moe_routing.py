"""The MoE (route -> dispatch -> grouped experts -> combine) against the math of the per-expert loop it replaced,
written out plainly below: dense and FP4 experts, scored and hash-routed layers, float64 and float32, 0 / 1 /
many rows, every row on one expert, experts with no rows. Invariant backend: the same within tolerance, and a
row's bits independent of the batch. On CUDA: the forward is captured in a CUDA graph (no host sync)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture_graph
import torch.nn.functional as F

from deepinfer.kernels.quant import dequantize_fp4
from deepinfer.kernels.table import use
from deepinfer.models.common.moe import Gate, MoE

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

E, D, INTER, K, VOCAB = 32, 64, 32, 4, 50
BOUND = {torch.float64: 1e-14, torch.float32: 2e-6, torch.bfloat16: 2e-2}   # max |diff| / max |want|


def build(dtype, storage="dense", hash_layer=False, seed=0, device="cpu", limit=10.0) -> MoE:
    gen = torch.Generator().manual_seed(seed)
    gate = Gate(D, E, K, "sqrtsoftplus", 1.5, dtype, hash_vocab=VOCAB if hash_layer else None)
    moe = MoE(gate, D, INTER, 1, limit, dtype, storage)
    with torch.no_grad():
        for name, t in moe.named_parameters():
            t.copy_((torch.randn(t.shape, generator=gen, dtype=torch.float64) * 0.1).to(t.dtype))
        for name, t in moe.named_buffers():
            if name.endswith("_fp4"):
                t.copy_(torch.randint(0, 256, t.shape, generator=gen))
            elif name.endswith("_scale"):
                t.copy_(torch.randint(125, 129, t.shape, generator=gen))     # e8m0 2^-2..2^1
            elif name.endswith("tid2eid"):
                t.copy_(torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(VOCAB)]))
    return moe.to(device)


def old_moe(moe: MoE, x: torch.Tensor, input_ids=None) -> torch.Tensor:
    """The replaced implementation's math: per expert in ascending id, its rows' outputs index_add-ed."""
    ex = moe.experts
    weights, ids = moe.gate(x, input_ids)
    up = torch.float64 if x.dtype == torch.float64 else torch.float32
    out = torch.zeros(x.shape, dtype=up, device=x.device)
    for e in sorted(set(ids.flatten().tolist())):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if ex.storage == "fp4":
            w1, w2, w3 = (dequantize_fp4(getattr(ex, f"{n}_fp4")[e], getattr(ex, f"{n}_scale")[e], 32, ex.dtype)
                          for n in ("w1", "w2", "w3"))
        else:
            w1, w2, w3 = ex.w1[e], ex.w2[e], ex.w3[e]
        xs = x[token].to(ex.dtype)
        g, u = (xs @ w1.T).to(up), (xs @ w3.T).to(up)
        if ex.limit > 0:
            g, u = g.clamp(max=ex.limit), u.clamp(-ex.limit, ex.limit)
        h = F.silu(g) * u * weights[token, slot].unsqueeze(-1).to(up)
        out.index_add_(0, token, (h.to(ex.dtype) @ w2.T).to(up))
    sh = moe.shared_experts
    g, u = (x @ sh.w1.weight.T).to(up), (x @ sh.w3.weight.T).to(up)
    if sh.limit > 0:
        g, u = g.clamp(max=sh.limit), u.clamp(-sh.limit, sh.limit)
    shared = ((F.silu(g) * u).to(x.dtype) @ sh.w2.weight.T).to(up)
    return (out + shared).to(x.dtype)


def rel_err(got, want) -> float:
    return (got.double() - want.double()).abs().max().item() / max(want.double().abs().max().item(), 1e-30)


def inputs(n, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(n, D, generator=gen, dtype=torch.float64).to(dtype).to(device)
    return x, torch.randint(0, VOCAB, (n,), generator=gen).to(device)


@pytest.mark.parametrize("backend", ["reference", "invariant"])
@pytest.mark.parametrize("hash_layer", [False, True], ids=["scored", "hash"])
@pytest.mark.parametrize("storage", ["dense", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("rows", [0, 1, 3, 50])
def test_moe_equals_old_math(rows, dtype, storage, hash_layer, backend):
    moe = build(dtype, storage, hash_layer, seed=rows)
    x, tok = inputs(rows, dtype, rows)
    with use(backend):
        got = moe(x, tok)
    want = old_moe(moe, x, tok)
    assert got.shape == x.shape and got.dtype == dtype
    if rows:
        assert rel_err(got, want) <= BOUND[dtype]


@pytest.mark.parametrize("backend", ["reference", "invariant"])
def test_every_row_on_one_expert_set(backend):
    """All rows routed to the same k experts (the rest get no rows), through hash routing."""
    moe = build(torch.float64, "dense", hash_layer=True, seed=3)
    moe.gate.tid2eid.copy_(torch.tensor([5, 9, 17, 30]).expand(VOCAB, K))
    x, tok = inputs(37, torch.float64, 3)
    with use(backend):
        got = moe(x, tok)
    assert rel_err(got, old_moe(moe, x, tok)) <= BOUND[torch.float64]
    moe.gate.tid2eid.copy_(torch.arange(K).expand(VOCAB, K))   # experts 0..3
    with use(backend):
        assert rel_err(moe(x, tok), old_moe(moe, x, tok)) <= BOUND[torch.float64]


@pytest.mark.parametrize("storage", ["dense", "fp4"])
def test_invariant_close_to_reference(storage):
    moe = build(torch.float32, storage, seed=8, limit=1.0)
    x, _ = inputs(70, torch.float32, 8)
    with use("reference"):
        ref = moe(x)
    with use("invariant"):
        inv = moe(x)
    assert rel_err(inv, ref) <= BOUND[torch.float32]




def _row_in_batches(moe, x, tok, target: int):
    """MoE output of row `target` alone and inside batches of other sizes, at first / middle / last place."""
    outs = [moe(x[target:target + 1], tok[target:target + 1])[0]]
    for n in (2, 5, 16, 17, 40):
        others = [i for i in range(x.shape[0]) if i != target][: n - 1]
        for place in (0, len(others) // 2, len(others)):
            rows = others[:place] + [target] + others[place:]
            outs.append(moe(x[rows], tok[rows])[place])
    return outs


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("hash_layer", [False, True], ids=["scored", "hash"])
@pytest.mark.parametrize("storage", ["dense", "fp4"])
def test_invariant_row_independent_of_batch(storage, hash_layer):
    moe = build(torch.float32, storage, hash_layer, seed=4)
    x, tok = inputs(48, torch.float32, 4)
    with use("invariant"):
        outs = _row_in_batches(moe, x, tok, target=7)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])


@pytest.mark.usefixtures("one_thread")
def test_control_reference_depends_on_batch():
    """Without the invariant backend the same comparison is not bitwise equal (so the test above can fail).
    (float32 GEMMs of 1 vs many rows round differently on this CPU.)"""
    moe = build(torch.float32, "dense", seed=4)
    x, tok = inputs(48, torch.float32, 4)
    with use("reference"):
        outs = _row_in_batches(moe, x, tok, target=7)
    if all(torch.equal(o, outs[0]) for o in outs[1:]):
        pytest.skip("this CPU's BLAS happens to give batch-independent fp32 GEMMs here")


# ------------------------------------------------------------------------------------------------------- GPU

@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("backend", ["reference", "invariant"])
@pytest.mark.parametrize("storage", ["dense", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("rows", [1, 8, 200])      # gathered / grouped or tiles
def test_cuda_graph_capture(rows, dtype, storage, backend):
    """No host sync and static shapes: the MoE forward captures; replays on new inputs equal eager runs."""
    moe = build(dtype, storage, hash_layer=False, seed=rows, device="cuda")
    x, _ = inputs(rows, dtype, rows, device="cuda")
    with use(backend):
        graph, out = capture_graph(moe, x)
        for seed in (1, 2):
            x.copy_(inputs(rows, dtype, 100 + seed, device="cuda")[0])
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, moe(x))
    err = rel_err(out, old_moe(moe, x))
    print(f"\n[moe cuda {backend} {dtype} {storage} rows={rows}] vs the old math on CUDA: {err:.2e}")
    assert err <= BOUND[dtype] * (1 if dtype == torch.bfloat16 else 4)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("storage", ["dense", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_cuda_invariant_row_independent_of_batch(dtype, storage):
    moe = build(dtype, storage, seed=5, device="cuda")
    x, tok = inputs(48, dtype, 5, device="cuda")
    with use("invariant"):
        outs = _row_in_batches(moe, x, tok, target=7)
    assert all(torch.equal(o, outs[0]) for o in outs[1:])
