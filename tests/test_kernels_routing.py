"""kernels/routing.py: `route` (the MoE router) and `permute` (the dispatch's grouping by expert).

1. The reference ops equal, bit for bit, the formulas Gate._route and LocalDispatch.dispatch computed before
   the ops existed (copied below as the oracle), and the invariant backend equals those formulas on fixed row
   tiles; the model classes give the same through the op table; on CPU the Triton backend sets fall back to them.
2. The Triton kernels against the reference in Triton's CPU interpreter. The interpreter has to be on when
   triton is first imported (triton.jit decides then), so those tests run in a subprocess with TRITON_INTERPRET=1
   (test_triton_kernels_in_the_interpreter), where they are defined; inputs are float32 / float16 (the
   interpreter reads bfloat16 wrong), and permute's block is shrunk so several blocks run and its sort stays fast.
   Inputs have no ties: on ties the kernel takes the lowest expert id, torch.topk an unspecified one.
3. On CUDA (marked gpu): the compiled kernels at V4 (E=256, D=4096) and V4.1 (E=384, D=5120) shapes, k=6,
   against the reference, batch invariance of `triton_invariant`, and capture in a CUDA graph."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers import capture_graph
import torch.nn.functional as F

from deepinfer.kernels import routing, routing_triton
from deepinfer.kernels.table import BACKEND_SETS, KernelTable, use
from deepinfer.kernels.tiles import row_tiles
from deepinfer.models.common.moe import Gate
from deepinfer.parallel.dispatch import LocalDispatch

INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@pytest.fixture(autouse=True)
def _one_thread():
    """Many tiny CPU calls: a 2-thread OpenMP pool spins at each when the cores are shared (as conftest's
    one_thread; defined here too, since the interpreter run goes without conftest)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------- the oracle: the old formulas

OLD_SCORE = {
    "sqrtsoftplus": lambda z: F.softplus(z).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda z: z.softmax(dim=-1),
}


def old_route(x, weight, bias, top_k, score_func, scale, temp, normalize, tid2eid=None, input_ids=None):
    """Gate._route as it was (logits through F.linear: what kernels.matmul.linear's reference runs)."""
    up = (lambda t: t if t.dtype == torch.float64 else t.float())
    logits = F.linear(up(x), up(weight))
    scores = OLD_SCORE[score_func](logits if temp == 1.0 else logits / temp)
    ids = tid2eid[input_ids] if tid2eid is not None else (scores + bias).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def old_dispatch(ids, weights, n_experts, logical_to_physical=None):
    """LocalDispatch.dispatch's permutation as it was -> (expert_ids, offsets, order, inverse, sorted weights, rows
    each sorted pair reads)."""
    n, k = ids.shape
    ids, perm = ids.sort(dim=1, stable=True)
    weights = weights.gather(1, perm).reshape(-1)
    phys = ids if logical_to_physical is None else logical_to_physical[ids]
    expert_ids, order = phys.reshape(-1).sort(stable=True)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(n * k))
    offsets = torch.searchsorted(expert_ids, torch.arange(n_experts + 1))
    return expert_ids, offsets, order, inverse, weights.index_select(0, order), order // k


# ------------------------------------------------------------------------------------------------- inputs

def router_inputs(n, d, e, k, seed, dtype=torch.float32, vocab=40, device="cpu"):
    """x [n, d], weight [e, d], bias [e] fp32, tid2eid [vocab, k] (distinct ids per token), input_ids [n]."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w = torch.randn(e, d, generator=gen, dtype=torch.float64) / d ** 0.5
    bias = torch.randn(e, generator=gen) * 0.05
    tid2eid = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(vocab)])
    tok = torch.randint(0, vocab, (n,), generator=gen)
    return [t.to(device) for t in (x.to(dtype), w.to(dtype), bias, tid2eid, tok)]


def routing_ids(n, k, e, gen, experts=None, distinct=True):
    """ids [n, k] over `experts` (default all e); distinct per row unless distinct=False; weights [n, k] fp32."""
    pool = torch.arange(e) if experts is None else torch.tensor(experts)
    if distinct:
        ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(n)]) if n else \
            torch.zeros(0, k, dtype=torch.long)
    else:
        ids = pool[torch.randint(0, len(pool), (n, k), generator=gen)]
    return ids, torch.rand(n, k, generator=gen)


def _route_kw(score_func, normalize, k, hashed, tid2eid, tok, temp=1.0, scale=2.5):
    return dict(top_k=k, score_func=score_func, route_scale=scale, temp=temp, normalize=normalize,
                tid2eid=tid2eid if hashed else None, input_ids=tok if hashed else None)


def _equal(got, want):
    return len(got) == len(want) and all(g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want))


# ------------------------------------------------------------------------- 1. reference == the old formulas

@pytest.mark.parametrize("hashed", [False, True], ids=["scored", "hash"])
@pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("score_func", SCORE_FUNCS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["f64", "f32", "bf16"])
@pytest.mark.parametrize("n", [0, 1, 7, 33])
def test_route_reference_and_invariant_equal_old_math(n, dtype, score_func, normalize, hashed):
    x, w, bias, tid2eid, tok = router_inputs(n, 32, 16, 3, seed=n, dtype=dtype)
    kw = _route_kw(score_func, normalize, 3, hashed, tid2eid, tok, temp=1.0 if n % 2 else 1.7)
    old = (bias, 3, score_func, 2.5, kw["temp"], normalize, kw["tid2eid"], kw["input_ids"])
    want = old_route(x, w, *old)
    with use("reference"):
        got = routing.route(x, w, bias, **kw)
    assert _equal(got, want)
    assert got[0].dtype == (torch.float64 if dtype == torch.float64 else torch.float32) and got[1].shape == (n, 3)
    want_tiles = row_tiles(lambda t, i: old_route(t, w, bias, 3, score_func, 2.5, kw["temp"], normalize,
                                                  kw["tid2eid"], i), x, kw["input_ids"])
    with use("invariant"):
        assert _equal(routing.route(x, w, bias, **kw), want_tiles)
    if not INTERPRETER:                            # CPU tensors: the Triton sets fall back to their partners
        for name, oracle in (("triton", want), ("triton_invariant", want_tiles)):
            with use(name):
                assert _equal(routing.route(x, w, bias, **kw), oracle), name


@pytest.mark.parametrize("hashed", [False, True], ids=["scored", "hash"])
@pytest.mark.parametrize("backend", ["reference", "invariant"])
def test_gate_routes_through_the_op(backend, hashed):
    """Gate.forward equals the old Gate (reference) and the old Gate on fixed row tiles (invariant)."""
    n, d, e, k, vocab = 37, 32, 16, 4, 40
    x, w, bias, tid2eid, tok = router_inputs(n, d, e, k, seed=5, vocab=vocab)
    gate = Gate(d, e, k, "sqrtsoftplus", 1.5, torch.float32, hash_vocab=vocab if hashed else None)
    with torch.no_grad():
        gate.weight.copy_(w)
        if hashed:
            gate.tid2eid.copy_(tid2eid)
        else:
            gate.bias.copy_(bias)
    old = lambda t, i: old_route(t, w, None if hashed else bias, k, "sqrtsoftplus", 1.5, 1.0, True,  # noqa: E731
                                 tid2eid if hashed else None, i if hashed else None)
    want = old(x, tok) if backend == "reference" else row_tiles(old, x, tok)
    with use(backend):
        assert _equal(gate(x, tok), want)


PERMUTE_CASES = {                       # name -> (n, k, n_experts, expert pool, distinct ids per row, map)
    "empty": (0, 3, 8, None, True, None),
    "one_row": (1, 6, 16, None, True, None),
    "rows7": (7, 2, 8, None, True, None),
    "rows33": (33, 3, 12, None, True, None),
    "one_expert": (33, 1, 16, [5], True, None),
    "all_rows_one_expert_set": (21, 3, 16, [2, 9, 14], True, None),
    "empty_experts": (20, 2, 16, [3, 7, 8], True, None),
    "repeated_ids": (33, 4, 5, None, False, None),          # equal ids in a row: the slot order breaks ties
    "map": (33, 3, 12, None, True, "perm"),
    "map_to_more_slots": (25, 2, 8, None, True, "spread"),  # 8 logical experts onto 12 physical slots
    "map_many_to_one": (25, 3, 8, None, True, "fold"),      # several logical experts share a slot
}


def _permute_case(name, seed=0):
    n, k, e, pool, distinct, kind = PERMUTE_CASES[name]
    gen = torch.Generator().manual_seed(seed + len(name))
    logical = e if kind != "spread" else 8
    ids, weights = routing_ids(n, k, logical, gen, pool, distinct)
    l2p = {None: None, "perm": torch.randperm(e, generator=gen), "spread": torch.randperm(12, generator=gen)[:8],
           "fold": torch.tensor([0, 0, 3, 1, 3, 7, 0, 2])}[kind]
    return ids, weights, (12 if kind == "spread" else e), l2p


@pytest.mark.parametrize("case", sorted(PERMUTE_CASES))
def test_permute_reference_equals_old_dispatch(case):
    ids, weights, e, l2p = _permute_case(case)
    want = old_dispatch(ids, weights, e, l2p)
    for name in BACKEND_SETS:                         # integer permutation: every set gives these bits (CPU)
        if INTERPRETER and name.startswith("triton"):
            continue
        with use(name):
            assert _equal(routing.permute(ids, weights, e, l2p), want), name
    expert_ids, offsets, order, inverse, _, rows = want
    assert torch.equal(order[inverse], torch.arange(ids.numel()))
    assert offsets[-1] == ids.numel() and torch.equal(offsets.diff(), torch.bincount(expert_ids, minlength=e))
    assert torch.equal(rows, torch.arange(ids.shape[0]).repeat_interleave(ids.shape[1])[order])


def test_local_dispatch_uses_permute():
    ids, weights, e, l2p = _permute_case("map")
    disp = LocalDispatch(e)
    disp.logical_to_physical = l2p
    x = torch.randn(ids.shape[0], 5)
    d = disp.dispatch(x, weights, ids)
    expert_ids, offsets, order, inverse, sorted_w, _ = old_dispatch(ids, weights, e, l2p)
    assert _equal((d.expert_ids, d.offsets, d.order, d.inverse, d.weights),
                  (expert_ids, offsets, order, inverse, sorted_w))
    assert torch.equal(d.x, x[order // ids.shape[1]])


def test_tables_name_the_routing_backends():
    for name in BACKEND_SETS:
        table = KernelTable(name)
        want = "reference" if name in ("reference", "triton") else "invariant"   # the FALLBACK chains
        if name.startswith("triton") and routing_triton.triton is not None:
            want = name
        assert table.backends["route"] == want
        triton_set = name.startswith("triton") and routing_triton.triton is not None
        assert table.backends["permute"] == (name if triton_set else "reference")


# --------------------------------------------------------------------------- 2. Triton in the interpreter

def test_triton_kernels_in_the_interpreter():
    """Runs this file's interpreter tests (defined below when TRITON_INTERPRET=1) in a fresh process."""
    pytest.importorskip("triton")
    if INTERPRETER:
        pytest.skip("already inside the interpreter run")
    from tests.helpers import interpreter_run
    args, env = interpreter_run()
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "--noconftest", "-p", "no:cacheprovider", *args, "-k", "interp",
           __file__]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout


def test_permute_kernels_compile_for_sm90_without_a_masked_histogram():
    """No GPU needed: the permute kernels compiled for sm_90 as the JIT specializes them at V4 (16-divisible
    pointers and E). The histogram must take no mask: its data arrives in the load's vectorized layout, the mask
    in another, and Triton lets each reshape into the histogram reorder on its own, so a mask is applied to
    other elements than its own (the H200's miscount; the interpreter tests model it, this checks the IR)."""
    if INTERPRETER or routing_triton.triton is None:
        pytest.skip("needs triton, compiled (not interpreted)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    div16 = [["tt.divisibility", 16]]
    common = dict(K=6, HAS_MAP=False, BLOCK_ROWS=routing_triton.PERMUTE_BLOCK_ROWS, K_PAD=8, BINS=512, PDL=True)
    scatter = {"ids_ptr": "*i64", "w_ptr": "*fp32", "l2p_ptr": "*i64", "delta_ptr": "*i64", "expert_ids_ptr": "*i64",
               "order_ptr": "*i64", "inverse_ptr": "*i64", "sorted_w_ptr": "*fp32", "rows_ptr": "*i64",
               "offsets_ptr": "*i64", "N": "i32", "E": "i32"}
    kernels = [                  # the histogram of several blocks; the scatter, and the one-block permute
        (routing_triton._expert_histogram_kernel, {"ids_ptr": "*i64", "l2p_ptr": "*i64", "counts_ptr": "*i32",
                                                   "N": "i32", "E": "i32"}, common),
        (routing_triton._permute_scatter_kernel, scatter, dict(common, SINGLE=False)),
        (routing_triton._permute_scatter_kernel, scatter, dict(common, SINGLE=True)),
        (routing_triton._permute_scatter_kernel, scatter, dict(common, SINGLE=True,            # b1's block
                                                                BLOCK_ROWS=routing_triton.PERMUTE_MIN_ROWS)),
    ]
    histograms = 0
    for kernel, runtime, consts in kernels:
        names = kernel.arg_names
        signature = {a: "constexpr" if a in consts else runtime[a] for a in names}
        attrs = {(i,): div16 for i, a in enumerate(names) if a in runtime and a != "N"}     # N = 37: not 16-divisible
        ttgir = triton.compile(ASTSource(kernel, signature, consts, attrs), target=GPUTarget("cuda", 90, 32)).asm["ttgir"]
        for line in ttgir.splitlines():
            if "tt.histogram" in line:
                histograms += 1
                assert re.search(r"tt\.histogram %[\w.]+ :", line), line.strip()
    assert histograms == 3                       # the histogram kernel's and the one-block scatters'


if INTERPRETER:
    import triton  # noqa: F401  (imported with the interpreter on)

    from tests.interpreter_dot import install as _install_order_fixed_dot

    assert routing_triton._INTERPRETED, "triton was imported before TRITON_INTERPRET=1 took effect"
    _install_order_fixed_dot()        # tl.dot summed in an order the code fixes, not the BLAS (the split = whole bits)

    def _check_route(got, want):
        # ids exactly: no near-ties in these inputs (the k-th and (k+1)-th biased scores of every row differ by
        # >= 1.4e-4, far above the fp32 rounding by which the kernel's and torch's logits may differ on any CPU)
        assert got[1].dtype == torch.int64 and torch.equal(got[1], want[1])
        assert got[0].dtype == torch.float32 and got[0].shape == want[0].shape
        assert torch.allclose(got[0], want[0].float(), rtol=1e-5, atol=1e-6), (got[0] - want[0]).abs().max()

    @pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
    @pytest.mark.parametrize("score_func", SCORE_FUNCS)
    @pytest.mark.parametrize("n", [0, 1, 7, 33])
    def test_interp_route(n, score_func, normalize):
        x, w, bias, tid2eid, tok = router_inputs(n, 48, 16, 2, seed=100 + n)
        kw = _route_kw(score_func, normalize, 2, False, tid2eid, tok, temp=1.0 if n % 2 else 1.3)
        _check_route(routing_triton._route_triton_default(x, w, bias, **kw), routing._route_reference(x, w, bias, **kw))

    @pytest.mark.parametrize("e,d,k,dtype,bias", [(8, 32, 2, torch.float32, True), (12, 64, 3, torch.float32, False),
                                                  (16, 40, 2, torch.float16, True), (10, 33, 6, torch.float32, True)])
    @pytest.mark.parametrize("score_func", SCORE_FUNCS)
    def test_interp_route_shapes(e, d, k, dtype, bias, score_func):
        """E below and between powers of two, D not a multiple of the D tile, k = 6, fp16 inputs, no bias."""
        x, w, b, tid2eid, tok = router_inputs(19, d, e, k, seed=e * d, dtype=dtype)
        kw = _route_kw(score_func, True, k, False, tid2eid, tok, temp=0.8)
        b = b if bias else None
        _check_route(routing_triton._route_triton_default(x, w, b, **kw), routing._route_reference(x, w, b, **kw))

    @pytest.mark.parametrize("d", [200, 130])
    def test_interp_route_chunks_split_or_not_same_bits(d, monkeypatch):
        """The logits in 64-column chunks (2-4 of them, a ragged last one): one program per (row block, chunk)
        then the epilogue, or one program walking its chunks, give the same bits, both = the reference."""
        monkeypatch.setattr(routing_triton, "ROUTE_CHUNK", 64)
        x, w, bias, tid2eid, tok = router_inputs(21, d, 16, 3, seed=d)
        kw = _route_kw("sqrtsoftplus", True, 3, False, tid2eid, tok)
        split = routing_triton._route_triton(x, w, bias, split=True, **kw)
        whole = routing_triton._route_triton(x, w, bias, split=False, **kw)
        assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1])
        _check_route(split, routing._route_reference(x, w, bias, **kw))

    def test_interp_route_expert_column_blocks(monkeypatch):
        """The chunk programs over several expert column blocks (E 40 in blocks of 16: the last one ragged) give
        the bits of one walking program over all columns, both = the reference."""
        monkeypatch.setattr(routing_triton, "ROUTE_CHUNK", 64)
        monkeypatch.setattr(routing_triton, "ROUTE_E_BLOCK", 16)
        x, w, bias, tid2eid, tok = router_inputs(9, 200, 40, 4, seed=11)
        kw = _route_kw("sigmoid", True, 4, False, tid2eid, tok)
        split = routing_triton._route_triton(x, w, bias, split=True, **kw)
        whole = routing_triton._route_triton(x, w, bias, split=False, **kw)
        assert torch.equal(split[0], whole[0]) and torch.equal(split[1], whole[1])
        _check_route(split, routing._route_reference(x, w, bias, **kw))

    @pytest.mark.parametrize("hashed", [False, True])
    @pytest.mark.parametrize("score_func", SCORE_FUNCS)
    def test_interp_route_gemm_logits_from_gemm_rows(score_func, hashed, monkeypatch):
        """`triton` from ROUTE_GEMM_ROWS rows: the logits on torch's fp32 GEMM into one part, the kernel's epilogue
        (= the reference); below it and in `triton_invariant` the chunk path."""
        monkeypatch.setattr(routing_triton, "ROUTE_GEMM_ROWS", 20)
        launched = []
        real = routing_triton._route_kernel

        class Spy:                                    # records whether each launch read one GEMM part
            def __getitem__(self, grid):
                def run(*args, **kw):
                    launched.append((args[0].shape[0], kw["CHUNKS"] == 1 and kw["FROM_PARTS"]))
                    return real[grid](*args, **kw)
                return run
        monkeypatch.setattr(routing_triton, "_route_kernel", Spy())
        x, w, bias, tid2eid, tok = router_inputs(33, 40, 12, 3, seed=3)
        kw = _route_kw(score_func, True, 3, hashed, tid2eid, tok)
        b = None if hashed else bias
        for n in (19, 20, 33):
            k = {**kw, "input_ids": kw["input_ids"][:n]} if hashed else kw
            _check_route(routing_triton._route_triton_default(x[:n], w, b, **k), routing._route_reference(x[:n], w, b, **k))
            _check_route(routing_triton._route_triton_invariant(x[:n], w, b, **k), routing._route_reference(x[:n], w, b, **k))
        assert launched == [(19, False), (19, False), (20, True), (20, False), (33, True), (33, False)]

    @pytest.mark.parametrize("hashed", [False, True])
    @pytest.mark.parametrize("n", [1, 3, 8, 15, 17])
    def test_interp_route_few_rows_fit_their_block(n, hashed, monkeypatch):
        """`triton`'s decode epilogue (logits from chunk parts) of fewer than 16 rows runs in a block of pow2(N)
        rows: the ids of the 16-row block, the weights to rounding, both = the reference; 16 rows and more keep
        the 16-row block."""
        monkeypatch.setattr(routing_triton, "ROUTE_CHUNK", 64)
        blocks = []
        real = routing_triton._route_kernel

        class Spy:                                    # records each launch's row block
            def __getitem__(self, grid):
                def run(*args, **kw):
                    blocks.append((grid[0], kw["BLOCK_N"], kw["FROM_PARTS"]))
                    return real[grid](*args, **kw)
                return run
        monkeypatch.setattr(routing_triton, "_route_kernel", Spy())
        x, w, bias, tid2eid, tok = router_inputs(n, 200, 40, 4, seed=50 + n)
        kw = _route_kw("sqrtsoftplus", True, 4, hashed, tid2eid, tok)
        b = None if hashed else bias
        fit = routing_triton._route_triton(x, w, b, split=True, fit_rows=True, **kw)
        block = routing_triton._route_triton(x, w, b, split=True, **kw)
        assert torch.equal(fit[1], block[1])
        assert torch.allclose(fit[0], block[0], rtol=1e-6, atol=1e-7)
        _check_route(fit, routing._route_reference(x, w, b, **kw))
        want = 1 << (n - 1).bit_length() if n < 16 else 16
        assert blocks == [(-(-n // want), want, True), (-(-n // 16), 16, True)]

    @pytest.mark.parametrize("normalize", [True, False], ids=["norm", "raw"])
    @pytest.mark.parametrize("score_func", SCORE_FUNCS)
    @pytest.mark.parametrize("n", [1, 33])
    def test_interp_route_hash(n, score_func, normalize):
        x, w, bias, tid2eid, tok = router_inputs(n, 32, 16, 3, seed=7 + n)
        kw = _route_kw(score_func, normalize, 3, True, tid2eid, tok)
        _check_route(routing_triton._route_triton_default(x, w, None, **kw), routing._route_reference(x, w, None, **kw))

    def test_interp_route_ties_take_the_lowest_id():
        """Equal biased scores: the kernel's choice, lowest expert id first (torch.topk's order is unspecified)."""
        x, w = torch.zeros(3, 32), torch.randn(16, 32)           # every logit 0: every score ties
        bias = torch.zeros(16)
        bias[[3, 9, 12]] = torch.tensor([1.0, 1.0, 0.5])
        kw = _route_kw("sigmoid", True, 4, False, None, None)
        weights, ids = routing_triton._route_triton_default(x, w, bias, **kw)
        assert ids.tolist() == [[3, 9, 12, 0]] * 3
        assert torch.allclose(weights, torch.full((3, 4), 2.5 / 4))

    def test_interp_route_orders_negative_values_and_ties():
        """Negative biased scores below positive ones, larger magnitudes of negatives lower, equal values by the lower
        id, and without a bias the weights are the chosen experts' scores."""
        x, w = torch.zeros(2, 32), torch.randn(16, 32)           # every logit 0: every sigmoid score 0.5
        bias = torch.tensor([-1.0, -2.0, -1.0, 0.25, -3.0, -0.5, -0.5, -0.75, -4.0, -1.0, -2.5, -0.6, -9.0, -0.1,
                             -0.1, -7.0])
        kw = _route_kw("sigmoid", False, 6, False, None, None, scale=1.0)
        weights, ids = routing_triton._route_triton_default(x, w, bias, **kw)
        assert ids.tolist() == [[3, 13, 14, 5, 6, 11]] * 2
        assert torch.equal(weights, torch.full((2, 6), 0.5))
        logits = torch.randn(5, 16)
        logits[:, 7] = logits[:, 2] = 4.0                         # the top two tie without a bias: 2 before 7
        xs, ws = logits, torch.eye(16)                            # x @ I^T: the logits themselves
        kw = _route_kw("sigmoid", False, 6, False, None, None, scale=1.0)
        weights, ids = routing_triton._route_triton_default(xs, ws, None, **kw)
        assert ids[:, :2].tolist() == [[2, 7]] * 5
        for r in range(5):                                        # torch.topk orders ties as it likes: sort here
            assert ids[r].tolist() == sorted(range(16), key=lambda e: (-float(torch.sigmoid(logits[r, e])), e))[:6]
        assert torch.allclose(weights, torch.sigmoid(logits).gather(1, ids), rtol=1e-6, atol=0)  # the kernel's sigmoid

    def test_interp_route_through_the_tables():
        x, w, bias, tid2eid, tok = router_inputs(20, 32, 16, 2, seed=3)
        kw = _route_kw("sqrtsoftplus", True, 2, False, tid2eid, tok)
        want = routing._route_reference(x, w, bias, **kw)
        for name in ("triton", "triton_invariant"):
            with use(name) as table:
                assert table.backends["route"] == name
                _check_route(routing.route(x, w, bias, **kw), want)
        with use("triton"):                                         # float64 runs the reference
            assert _equal(routing.route(x.double(), w.double(), bias, **kw),
                          routing._route_reference(x.double(), w.double(), bias, **kw))

    @pytest.mark.parametrize("case", sorted(PERMUTE_CASES))
    def test_interp_permute(case, monkeypatch):
        monkeypatch.setattr(routing_triton, "PERMUTE_BLOCK_ROWS", 4)      # several blocks, a short sort per block
        ids, weights, e, l2p = _permute_case(case, seed=11)
        assert _equal(routing_triton._permute_triton(ids, weights, e, l2p), old_dispatch(ids, weights, e, l2p))

    def test_interp_permute_default_block():
        ids, weights, e, l2p = _permute_case("rows33", seed=2)
        ids = torch.cat([ids, ids.flip(0)])[:40]
        assert _equal(routing_triton._permute_triton(ids, weights.repeat(2, 1)[:40], e, l2p),
                      old_dispatch(ids, weights.repeat(2, 1)[:40], e, l2p))

    def _reorder_histogram_inputs(monkeypatch):
        """What the compiler may do to tl.histogram's inputs, played in the interpreter: Triton marks the reshapes
        that feed a histogram allow_reorder, the data's and the mask's each on its own, so on the GPU a mask need
        not stay on its elements (it didn't on the H200: n=1, k=6, E=256 counted 3 padding zeros into bin 0 and
        lost 3 pairs). Here the data comes reversed and the mask rolled by one; a kernel whose counts survive this
        does not lean on the two staying paired (the interpreter itself never reorders)."""
        import numpy as np
        from triton.runtime import interpreter

        real = interpreter.InterpreterBuilder.create_histogram

        def reordered(self, data, bins, mask=None):
            data = interpreter.TensorHandle(np.ascontiguousarray(data.data[::-1]), data.dtype)
            if mask is not None:
                mask = interpreter.TensorHandle(np.roll(mask.data, 1), mask.dtype)
            return real(self, data, bins, mask)

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_histogram", reordered)

    def _garbage_empty(monkeypatch):
        """torch.empty hands out garbage (NaN floats, 0x5A5A5A5A ints): a kernel output or workspace read before
        it is written shows (CPU memory is often zero, as the GPU's caching allocator's is not)."""
        real = torch.empty

        def empty(*args, **kwargs):
            t = real(*args, **kwargs)
            return t.fill_(float("nan") if t.is_floating_point() else 90 if t.element_size() < 4 else 0x5A5A5A5A)

        monkeypatch.setattr(torch, "empty", empty)

    @pytest.mark.parametrize("case", sorted(PERMUTE_CASES))
    def test_interp_permute_histogram_inputs_reordered(case, monkeypatch):
        monkeypatch.setattr(routing_triton, "PERMUTE_BLOCK_ROWS", 4)
        ids, weights, e, l2p = _permute_case(case, seed=5)
        want = old_dispatch(ids, weights, e, l2p)
        _reorder_histogram_inputs(monkeypatch)
        _garbage_empty(monkeypatch)
        assert _equal(routing_triton._permute_triton(ids, weights, e, l2p), want)

    def test_interp_permute_of_one_block_is_one_launch(monkeypatch):
        """Rows that fit one block (decode up to PERMUTE_BLOCK_ROWS sequences) permute in the scatter kernel alone:
        it writes the offsets from its own histogram, so the histogram kernel and the torch prefix sums between
        the two kernels (about 11 launches a MoE layer) do not run."""
        class NotLaunched:
            def __getitem__(self, grid):
                raise AssertionError("the histogram kernel ran for rows that fit one block")

        class Recorded:                                       # the scatter kernel, its block size noted
            def __init__(self, kernel):
                self.kernel, self.blocks = kernel, []

            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    self.blocks.append(kwargs["BLOCK_ROWS"])
                    return self.kernel[grid](*args, **kwargs)
                return launch

        ids, weights = routing_ids(37, 6, 384, torch.Generator().manual_seed(4))
        want = old_dispatch(ids, weights, 384, None)
        monkeypatch.setattr(routing_triton, "_expert_histogram_kernel", NotLaunched())
        scatter = Recorded(routing_triton._permute_scatter_kernel)
        monkeypatch.setattr(routing_triton, "_permute_scatter_kernel", scatter)
        _reorder_histogram_inputs(monkeypatch)
        _garbage_empty(monkeypatch)
        assert _equal(routing_triton._permute_triton(ids, weights, 384, None), want)
        assert _equal(routing_triton._permute_triton(ids[:1], weights[:1], 384, None),
                      old_dispatch(ids[:1], weights[:1], 384, None))
        assert scatter.blocks == [64, routing_triton.PERMUTE_MIN_ROWS]   # a block of pow2(rows), not 128
        monkeypatch.setattr(routing_triton, "PERMUTE_BLOCK_ROWS", 16)                 # three blocks: it must run
        with pytest.raises(AssertionError, match="histogram kernel ran"):
            routing_triton._permute_triton(ids, weights, 384, None)

    @pytest.mark.parametrize("n,e", [(1, 256), (1, 255), (37, 384), (130, 12)])
    def test_interp_permute_h200_shapes(n, e, monkeypatch):
        """The default block (128 rows, k = 6 padded to 8 slots: 1024 lanes, 6 of them real at n = 1), E a power
        of two (the sentinel bin needs a histogram twice as wide), one below, V4.1's 384, two blocks; garbage
        workspaces and reordered histogram inputs. (1, 256) is the H200 failure's input."""
        if n == 1 and e == 256:
            ids = torch.tensor([[19, 170, 125, 242, 56, 234]])
            weights = torch.tensor([[0.3038, 0.3186, 0.7589, 0.0165, 0.2985, 0.8037]])
        else:
            ids, weights = routing_ids(n, 6, e, torch.Generator().manual_seed(n + e))
        l2p = torch.randperm(e, generator=torch.Generator().manual_seed(e))
        want = [old_dispatch(ids, weights, e, m) for m in (None, l2p)]
        _reorder_histogram_inputs(monkeypatch)
        _garbage_empty(monkeypatch)
        for mapping, w in zip((None, l2p), want):
            assert _equal(routing_triton._permute_triton(ids, weights, e, mapping), w)

    def test_interp_moe_forward_through_triton_tables(monkeypatch):
        """A MoE layer end to end with the Triton route and permute (experts: their reference on CPU)."""
        from deepinfer.models.common.moe import MoE
        monkeypatch.setattr(routing_triton, "PERMUTE_BLOCK_ROWS", 8)
        gen = torch.Generator().manual_seed(1)
        gate = Gate(32, 16, 2, "sqrtsoftplus", 1.5, torch.float32)
        moe = MoE(gate, 32, 16, 1, 10.0, torch.float32)
        with torch.no_grad():
            for t in moe.parameters():
                t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
        x = torch.randn(13, 32, generator=gen)
        with use("reference"):
            want = moe(x)
        with use("triton") as table:
            assert table.backends["route"] == table.backends["permute"] == "triton"
            got = moe(x)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


# -------------------------------------------------------------------------------------------------- 3. CUDA

SHAPES = {"v4": (256, 4096), "v41": (384, 5120)}      # (E, D); k = 6


def _check_route_cuda(got, x, w, bias, kw):
    """ids: the k best biased scores (exact fp32 near-ties may swap), weights: the reference's where ids agree."""
    want = routing._route_reference(x, w, bias, **kw)
    k = kw["top_k"]
    if kw["tid2eid"] is not None:
        assert torch.equal(got[1], want[1])
    else:
        scores = OLD_SCORE[kw["score_func"]](F.linear(x.float(), w.float()) / kw["temp"]) + bias
        assert torch.allclose(scores.gather(1, got[1]), scores.topk(k).values, atol=1e-5, rtol=0)
        assert (got[1] == want[1]).all(1).float().mean() > 0.99
    same = (got[1] == want[1]).all(1)
    assert torch.allclose(got[0][same], want[0][same], rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("hashed", [False, True], ids=["scored", "hash"])
@pytest.mark.parametrize("n", [1, 37, 1000])
@pytest.mark.parametrize("family", sorted(SHAPES))
def test_cuda_route_and_permute(family, n, hashed):
    e, d = SHAPES[family]
    x, w, bias, tid2eid, tok = router_inputs(n, d, e, 6, seed=n, dtype=torch.bfloat16, vocab=1000, device="cuda")
    for score_func in SCORE_FUNCS:
        kw = _route_kw(score_func, True, 6, hashed, tid2eid, tok)
        got = routing_triton._route_triton_default(x, w, None if hashed else bias, **kw)
        _check_route_cuda(got, x, w, None if hashed else bias, kw)
    ids, weights = got[1], got[0]
    l2p = torch.randperm(e, device="cuda")
    for mapping in (None, l2p):
        assert _equal(routing_triton._permute_triton(ids, weights, e, mapping),
                      routing._permute_reference(ids, weights, e, mapping))
    one = torch.full_like(ids, 3)                                  # every pair on one expert
    assert _equal(routing_triton._permute_triton(one, weights, e), routing._permute_reference(one, weights, e))


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("family", sorted(SHAPES))
def test_cuda_triton_invariant_route_is_batch_invariant(family):
    e, d = SHAPES[family]
    x, w, bias, tid2eid, tok = router_inputs(70, d, e, 6, seed=4, dtype=torch.bfloat16, device="cuda")
    kw = _route_kw("sqrtsoftplus", True, 6, False, tid2eid, tok)
    with use("triton_invariant"):
        full = routing.route(x, w, bias, **kw)
        for rows in (slice(21, 22), slice(5, 40), slice(3, 70)):
            part = routing.route(x[rows], w, bias, **kw)
            assert torch.equal(part[0], full[0][rows]) and torch.equal(part[1], full[1][rows])
    got = routing_triton._route_triton(x, w, bias, split=True, **kw)          # the invariant set's path: the same bits
    assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])
    walked = routing_triton._route_triton(x, w, bias, split=False, **kw)      # one program per row block: last bits only
    assert float((walked[0] - full[0]).abs().max()) <= 1e-5 and float((walked[1] != full[1]).float().mean()) <= 0.02


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("n", [1, 200, 1000])
@pytest.mark.parametrize("family", sorted(SHAPES))
def test_cuda_graph_capture(family, n):
    """Route + permute with no host sync: captured, replayed on new inputs, equal to eager runs (n = 1000: the
    logits on cuBLAS, ROUTE_GEMM_ROWS)."""
    e, d = SHAPES[family]
    x, w, bias, tid2eid, tok = router_inputs(n, d, e, 6, seed=9, dtype=torch.bfloat16, device="cuda")
    kw = _route_kw("sqrtsoftplus", True, 6, False, tid2eid, tok)

    def step(x):
        weights, ids = routing_triton._route_triton_default(x, w, bias, **kw)
        return (weights, ids) + routing_triton._permute_triton(ids, weights, e)

    graph, out = capture_graph(step, x)
    for seed in (1, 2):
        x.copy_(router_inputs(n, d, e, 6, seed=100 + seed, dtype=torch.bfloat16, device="cuda")[0])
        graph.replay()
        torch.cuda.synchronize()
        assert _equal(out, step(x))
