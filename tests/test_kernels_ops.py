"""Every op of the op table (kernels/registry.py, kernels/table.py): each backend against the reference on fresh random inputs,
the sparse ops against a plain dense computation, and the invariant backends' batch invariance (a row alone
gives the same bits as inside a batch of another size, at another position).

Tolerances: float64 inputs, so 1e-12 absorbs only reduction-order differences (tiles vs one call)."""

import pytest
import torch

from deepinfer.kernels import attention, indexer, matmul, mhc, norm, rope, rowwise, softmax_pool
from deepinfer.kernels.table import BACKEND_SETS, KernelBackendError, KernelTable, active, use

G = torch.Generator().manual_seed(0)
F64 = torch.float64


def r(*shape, dtype=F64):
    return torch.randn(*shape, generator=G, dtype=dtype)


def _sparse_sources(n=37, k1=9, k2=5, d=24, m1=50, m2=30):
    s1, s2 = r(m1, d), r(m2, d)
    i1 = torch.randint(-1, m1, (n, k1), generator=G)
    i2 = torch.randint(-1, m2, (n, k2), generator=G)
    i1[3] = -1                                   # a row with no window key
    i2[3] = -1                                   # ... and none at all: only the sink
    return [(s1, i1), (s2, i2)]


# op name -> (function of the inputs, inputs builder); every input's dim 0 is the row dim
CASES = {
    "linear": (lambda x, w: matmul.linear(x, w), lambda n: (r(n, 33), r(17, 33))),
    "linear_f32": (lambda x, w: matmul.linear_f32(x, w), lambda n: (r(n, 33), r(17, 33))),
    "grouped_linear": (lambda x, w: matmul.grouped_linear(x, w), lambda n: (r(n, 4, 32), r(4, 16, 32))),
    "rms_norm": (lambda x, w: norm.rms_norm(x, w, 1e-6), lambda n: (r(n, 40), r(40))),
    "rope": (lambda x, c, s: rope.apply_rope(x, c, s), lambda n: (r(n, 4, 16), r(n, 4), r(n, 4))),
    "sink_attention": (lambda q, kv, b, s: attention.sink_attention(q, kv, b, s, 0.3),
                       lambda n: (r(n, 4, 16), r(23, 16), torch.where(r(n, 23) > 0, 0.0, float("-inf")), r(4))),
    "index_scores": (lambda q, w, k: indexer.index_scores(q, w, k, 0.5), lambda n: (r(n, 4, 8), r(n, 4), r(19, 8))),
    "softmax_pool": (lambda kv, s: softmax_pool.softmax_pool(kv, s), lambda n: (r(n, 6, 10), r(n, 6, 10))),
    "hc_collapse": (lambda h, p: mhc.hc_collapse(h, p), lambda n: (r(n, 4, 12), r(n, 4))),
    "hc_post": (lambda o, h, p, c: mhc.hc_post(o, h, p, c), lambda n: (r(n, 12), r(n, 4, 12), r(n, 4), r(n, 4, 4))),
    "hc_mixes": (lambda h, f, b, s: mhc.hc_mixes(h, f, b, s, 1e-6, 1e-6, 3),
                 lambda n: (r(n, 4, 12), r(24, 48), r(24), r(3))),
    "hc_head": (lambda h, f, b, s: mhc.hc_head(h, f, b, s, 1e-6, 1e-6), lambda n: (r(n, 4, 12), r(4, 48), r(4), r(1))),
    "rowwise": (lambda x: rowwise.rowwise(lambda t: (t.softmax(-1) * t).cumsum(-1), x), lambda n: (r(n, 9),)),
}
ROW_LOCAL = {"linear", "linear_f32", "grouped_linear", "rms_norm", "rope", "index_scores", "softmax_pool", "hc_collapse",
             "hc_post", "hc_mixes", "hc_head"}     # outputs of row i depend on input row i only


def _rows_of(args, op, rows):
    """Slice every per-row input of op's arguments to `rows`."""
    per_row = {"linear": [0], "linear_f32": [0], "grouped_linear": [0], "rms_norm": [0], "rope": [0, 1, 2], "sink_attention": [0, 2],
               "index_scores": [0, 1], "softmax_pool": [0, 1], "hc_collapse": [0, 1], "hc_post": [0, 1, 2, 3],
               "hc_mixes": [0], "hc_head": [0], "rowwise": [0]}[op]
    return tuple(a[rows] if i in per_row else a for i, a in enumerate(args))


def _flat(out):
    return torch.cat([o.flatten() for o in out]) if isinstance(out, tuple) else out


@pytest.mark.parametrize("op", sorted(CASES))
def test_every_backend_matches_reference(op):
    fn, build = CASES[op]
    args = build(29)
    with use("reference"):
        want = _flat(fn(*args))
    for name in BACKEND_SETS:
        with use(name):
            got = _flat(fn(*args))
        assert torch.allclose(got, want, atol=1e-12, rtol=1e-12), (op, name)


@pytest.mark.parametrize("backend", BACKEND_SETS)
def test_linear_f32_returns_fp32_from_16_bit_inputs(backend):
    """bf16 x and w -> fp32 (the LM head's case); off CUDA the triton backend computes the reference's bits, the
    invariant ones the reference on row tiles (CPU BLAS blocks them differently: last bits)."""
    x, w = r(9, 64).bfloat16(), r(40, 64).bfloat16()
    want = torch.nn.functional.linear(x.float(), w.float())
    with use(backend):
        got = matmul.linear_f32(x, w)
    assert got.dtype == torch.float32
    if backend in ("reference", "triton"):
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-5)
    assert matmul.linear_f32(x.double(), w.double()).dtype == torch.float64


@pytest.mark.parametrize("op", sorted(ROW_LOCAL | {"sink_attention"}))
def test_invariant_backend_is_batch_invariant(op):
    """In float32 at widths like the models' (multiples of 16): CPU BLAS may treat a row's odd-width vector
    tail by its position in the tile, and float64 calls may block rows differently."""
    fn, build = CASES[op]
    args = tuple(a.float() for a in build(45))
    with use("invariant"):
        full = fn(*args)
        alone = fn(*_rows_of(args, op, slice(21, 22)))
        middle = fn(*_rows_of(args, op, slice(5, 30)))
    pick = (lambda o, s: tuple(t[s] for t in o)) if isinstance(full, tuple) else (lambda o, s: o[s])
    assert torch.equal(_flat(pick(full, slice(21, 22))), _flat(alone)), op
    assert torch.equal(_flat(pick(full, slice(5, 30))), _flat(middle)), op


def _dense_sparse_attention(q, sources, sink, scale):
    """Row by row: keys = the named store rows, softmax with the sink."""
    out = torch.zeros_like(q)
    for n in range(q.shape[0]):
        keys = torch.cat([s[i[n][i[n] >= 0]] for s, i in sources])
        logits = torch.cat([torch.einsum("hd,kd->hk", q[n], keys) * scale, sink.view(-1, 1)], dim=1)
        out[n] = torch.softmax(logits, dim=1)[:, :-1] @ keys
    return out


@pytest.mark.parametrize("backend", BACKEND_SETS)
def test_sparse_sink_attention_equals_dense(backend, monkeypatch):
    sources = _sparse_sources()
    q, sink = r(37, 4, 24), r(4)
    want = _dense_sparse_attention(q, sources, sink, 0.2)
    monkeypatch.setattr(attention, "SCORE_BLOCK_ELEMENTS", 512)        # several row blocks
    with use(backend):
        got = attention.sparse_sink_attention(q, sources, sink, 0.2)
    assert torch.allclose(got, want, atol=1e-12)
    assert torch.equal(got[3], torch.zeros_like(got[3]))              # no key: the sink takes everything
    with use("invariant"):
        alone = attention.sparse_sink_attention(q[20:21], [(s, i[20:21]) for s, i in sources], sink, 0.2)
        assert torch.equal(alone, attention.sparse_sink_attention(q, sources, sink, 0.2)[20:21])


@pytest.mark.parametrize("backend", BACKEND_SETS)
def test_sparse_index_scores_and_top_k(backend, monkeypatch):
    store, q, w = r(40, 8), r(33, 4, 8), r(33, 4)
    index = torch.randint(-1, 40, (33, 12), generator=G)
    dense = indexer.index_scores(q, w, store[index.clamp(min=0)], 0.7)                  # [33, 12]
    want = dense.masked_fill(index < 0, float("-inf"))
    monkeypatch.setattr(indexer, "SCORE_BLOCK_ELEMENTS", 64)
    with use(backend):
        got = indexer.sparse_index_scores(q, w, store, index, 0.7)
        top = indexer.top_k_indices(got, 5)
    assert torch.allclose(got, want, atol=1e-12) and torch.equal(torch.isinf(got), index < 0)
    from deepinfer.models.common.selection import top_k_mask
    mask = torch.zeros_like(got, dtype=torch.bool)
    for n in range(33):
        mask[n, top[n][top[n] >= 0]] = True
    assert torch.equal(mask, top_k_mask(got, 5))                      # the reference path's selection


def test_top_k_ties_go_to_the_lower_position():
    scores = torch.tensor([[1.0, 3.0, 3.0, float("-inf"), 3.0], [float("-inf")] * 5])
    assert indexer.top_k_indices(scores, 2).tolist() == [[1, 2], [-1, -1]]


def test_tables_record_backends_and_refuse_unknown_names():
    table = KernelTable("invariant")
    assert table.backends["linear"] == "invariant" and table.backends["rope"] == "reference"
    assert set(table.backends) >= set(CASES) | {"sparse_sink_attention", "sparse_index_scores", "top_k_indices"}
    with pytest.raises(KernelBackendError, match="did you mean 'invariant'"):
        KernelTable("invarient")
    before = active()
    with use(table):
        assert active() is table
    assert active() is before
