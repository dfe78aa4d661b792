"""engine/parallel/dispatch.py: LocalDispatch groups (row, slot) pairs by expert and combines them back in
ascending expert id; the logical -> physical hook; routing records."""

from __future__ import annotations

import pytest
import torch

from deepinfer.parallel.dispatch import LocalDispatch, label_dispatchers, record_routing


def _routing(n, k, n_experts, gen, experts=None):
    pool = torch.arange(n_experts) if experts is None else torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(n)]) if n else \
        torch.zeros(0, k, dtype=torch.long)
    return ids, torch.rand(n, k, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("n,k,experts", [(0, 3, None), (1, 3, None), (9, 1, None), (40, 6, None), (25, 2, [3, 7]),
                                         (17, 1, [4])])
def test_dispatch_layout(n, k, experts):
    gen = torch.Generator().manual_seed(n * 10 + k)
    E, D = 16, 5
    ids, weights = _routing(n, k, E, gen, experts)
    x = torch.randn(n, D, generator=gen, dtype=torch.float64)
    d = LocalDispatch(E).dispatch(x, weights, ids)
    m = n * k
    assert d.x.shape == (m, D) and d.expert_ids.shape == (m,) and d.offsets.shape == (E + 1,)
    assert torch.equal(d.expert_ids, d.expert_ids.sort().values)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert torch.equal(d.offsets, torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]))
    assert torch.equal(d.order[d.inverse], torch.arange(m)) and torch.equal(d.inverse[d.order], torch.arange(m))
    # row-major source: the sorted (row, slot) pairs carry their row, expert and weight
    sorted_ids, perm = ids.sort(dim=1)
    assert torch.equal(d.x, x[d.order // k])
    assert torch.equal(d.expert_ids, sorted_ids.reshape(-1)[d.order])
    assert torch.equal(d.weights, weights.gather(1, perm).reshape(-1)[d.order])
    for e in range(E):                               # stable: each expert's rows in ascending row order
        rows = (d.order // k)[d.offsets[e]:d.offsets[e + 1]]
        assert torch.equal(rows, rows.sort().values)


@pytest.mark.parametrize("n", [0, 1, 13])
def test_combine_sums_in_ascending_expert_order(n):
    """combine(y) = each row's outputs added one by one from its lowest expert id up (bitwise, fp32)."""
    gen = torch.Generator().manual_seed(n)
    E, k, D = 12, 4, 7
    ids, weights = _routing(n, k, E, gen)
    disp = LocalDispatch(E)
    d = disp.dispatch(torch.zeros(n, D), weights, ids)
    y = torch.randn(n * k, D, generator=gen) * torch.logspace(-3, 3, n * k).unsqueeze(-1)   # order matters in fp32
    got = disp.combine(y, d)
    assert got.shape == (n, D) and got.dtype == torch.float32
    for row in range(n):
        want = None
        for e in ids[row].sort().values.tolist():
            j = int(((d.order // k == row) & (d.expert_ids == e)).nonzero())
            want = y[j].clone() if want is None else want + y[j]
        assert torch.equal(got[row], want)


def test_combine_round_trip():
    """y[j] = f(row, expert) -> row sum of f over its experts (float64, exact integers)."""
    gen = torch.Generator().manual_seed(2)
    E, k, n = 10, 3, 21
    ids, weights = _routing(n, k, E, gen)
    disp = LocalDispatch(E)
    d = disp.dispatch(torch.arange(n, dtype=torch.float64).unsqueeze(-1), weights, ids)
    y = d.x * 100 + d.expert_ids.unsqueeze(-1).double()
    want = (torch.arange(n, dtype=torch.float64) * 100 * k + ids.sum(1).double()).unsqueeze(-1)
    assert torch.equal(disp.combine(y, d), want)


def test_logical_to_physical_hook():
    """A map (EPLB placement) groups rows by physical slot; the combine still sums in logical-id order."""
    gen = torch.Generator().manual_seed(4)
    E, k, n = 8, 3, 15
    ids, weights = _routing(n, k, E, gen)
    disp = LocalDispatch(E)
    disp.logical_to_physical = torch.randperm(E, generator=gen)
    d = disp.dispatch(torch.randn(n, 4, generator=gen), weights, ids)
    assert torch.equal(d.expert_ids, disp.logical_to_physical[ids].reshape(-1).sort().values)
    y = torch.randn(n * k, 4, generator=gen)
    plain = LocalDispatch(E)
    d0 = plain.dispatch(d.x.new_zeros(n, 4), weights, ids)
    # the same (row, logical expert) output fed through either layout combines to the same bits
    logical = ids.sort(dim=1).values.reshape(-1)
    key = (d.order // k) * E + logical[d.order]
    key0 = (d0.order // k) * E + logical[d0.order]
    y0 = y[key.argsort()][key0.argsort().argsort()]
    assert torch.equal(disp.combine(y, d), plain.combine(y0, d0))


def test_record_routing():
    gen = torch.Generator().manual_seed(6)
    disp = LocalDispatch(8, name="layers.0.ffn")
    ids, weights = _routing(5, 2, 8, gen, experts=[1, 2, 6])
    disp.dispatch(torch.zeros(5, 3), weights, ids)               # not recording: nothing kept anywhere
    with record_routing() as rec:
        disp.dispatch(torch.zeros(5, 3), weights, ids)
        disp.dispatch(torch.zeros(5, 3), weights, ids[:2])
    disp.dispatch(torch.zeros(5, 3), weights, ids)
    assert [name for name, _ in rec.calls] == ["layers.0.ffn"] * 2
    touched = rec.touched(8)
    assert touched.shape == (2, 8) and touched[0].nonzero().flatten().tolist() == sorted(set(ids.flatten().tolist()))
    assert torch.equal(rec.counts(8)[0], torch.bincount(ids.flatten(), minlength=8))
    assert rec.counts(8)[1].sum() == 4


def test_label_dispatchers():
    from deepinfer.models.common.moe import Gate, MoE
    gate = Gate(8, 4, 2, "sqrtsoftplus", 1.0, torch.float32)
    net = torch.nn.ModuleDict({"a": MoE(gate, 8, 4, 1, 0.0, torch.float32)})
    label_dispatchers(net)
    assert net["a"].dispatch.name == "a"
