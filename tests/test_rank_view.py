"""The one-GPU rank view of expert parallelism (engine/parallel/rank_view.py, `deepinfer-bench step --ep`): rank
R of EP-N holds its experts, computes exactly the pairs the global batch routes to its slots, gives its own rows
the outputs of the pairs computed here, counts the exchange, and gives the model back whole."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from deepinfer.checkpoint.make import random_model
from deepinfer.errors import DeepInferError
from deepinfer.harness.cli import cli
from deepinfer.models.common.moe import Experts, moe_layers
from deepinfer.parallel.balancer import placement_for
from deepinfer.parallel.dispatch import LocalDispatch, label_dispatchers, record_routing
from deepinfer.parallel.rank_view import RankViewDispatch, rank_view
from deepinfer.reference import compute_logits
from tests.bad_input import refuse_cli

E, K, D, INTER = 8, 2, 16, 8


def _experts(seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    ex = Experts(E, D, INTER, limit=0.0, dtype=torch.float32)
    for t in ex.stack().values():
        t.data.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return ex


def _routing(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)])
    w = torch.rand(n, K, generator=g)
    return x, w, ids


def _global_slots(d: RankViewDispatch, own_ids: torch.Tensor, n: int) -> torch.Tensor:
    """The physical slots of every rank's rows, rank R's own rows at its place: [N, n, k]."""
    blocks, i = [], 0
    for j in range(d.shard.size):
        if j == d.shard.rank:
            blocks.append(d._physical(own_ids.sort(dim=1).values, j))
        else:
            blocks.append(d._physical(d.pool[i * n:(i + 1) * n], j))
            i += 1
    return torch.stack(blocks)


@pytest.mark.parametrize("size,rank,redundant", [(2, 0, 0), (2, 1, 0), (4, 3, 0), (4, 1, 4)])
def test_rank_computes_exactly_its_slots_pairs(size, rank, redundant):
    n = 5
    x, w, ids = _routing(n, seed=1)
    pool = _routing(3 * n, seed=2)[2]
    placement = None
    if redundant:
        load = torch.bincount(pool.reshape(-1), minlength=E).double()
        placement = placement_for(load[None], E + redundant, size)
    d = RankViewDispatch(E, rank, size, pool, "moe", placement)
    with record_routing() as rec:
        disp = d.dispatch(x, w, ids)
    slots = _global_slots(d, ids, n)
    mine = (slots >= d.shard.first) & (slots < d.shard.first + d.shard.count)
    assert int(mine.sum()) == int(disp.offsets[-1])
    expected = torch.bincount((slots[mine] - d.shard.first).reshape(-1), minlength=d.shard.count)
    assert torch.equal(torch.diff(disp.offsets), expected)                  # per local slot
    assert torch.equal(torch.bincount(rec.calls[0][1].reshape(-1), minlength=d.shard.count), expected)
    stats = d.stats[n]
    per_rank = torch.bincount((slots // d.shard.count).reshape(-1), minlength=size)
    assert stats.pairs_per_rank == per_rank.tolist() and sum(stats.pairs_per_rank) == size * n * K
    assert stats.received == int(disp.offsets[-1])
    own_here = int(mine[rank].sum())
    row, out = D * 4 + 12, D * 4
    assert stats.bytes_sent == (n * K - own_here) * row + (stats.received - own_here) * out
    assert stats.bytes_received == (stats.received - own_here) * row + (n * K - own_here) * out
    assert 0 < stats.balancedness <= 1


def test_own_rows_get_exactly_the_local_experts_outputs():
    """Rank R's combine = the one-rank combine with the pairs of other ranks' experts weighted 0."""
    n, size, rank = 6, 4, 2
    x, w, ids = _routing(n, seed=3)
    full = _experts()
    reference_w = w.clone()
    local = (ids >= rank * E // size) & (ids < (rank + 1) * E // size)
    reference_w[~local] = 0
    one = LocalDispatch(E)
    d1 = one.dispatch(x, reference_w, ids)
    want = one.combine(full.compute(d1), d1)
    part = _experts()
    d = RankViewDispatch(E, rank, size, _routing(3 * n, seed=4)[2])
    part.keep(d.held_experts())
    dr = d.dispatch(x, w, ids)
    got = d.combine(part.compute(dr), dr)
    assert bool(local.any()) and bool((~local).any())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ["deepseek_v4", "deepseek_v41"])
def test_model_view_one_rank_equals_the_model_and_gives_it_back(arch):
    model = random_model(arch, "tiny", seed=0)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    before = compute_logits(model, ids)
    names = [name for name, _ in moe_layers(model)]
    label_dispatchers(model)
    with record_routing() as rec:
        compute_logits(model, ids)
    pool = {name: t for name, t in rec.calls}
    keep_whole = model.drafting.modules if model.drafting is not None else ()
    with rank_view(model, 1, 0, pool, keep_whole=keep_whole):
        assert torch.equal(compute_logits(model, ids), before)
    with rank_view(model, 2, 1, pool, keep_whole=keep_whole) as view:
        split = {n for n, m in moe_layers(model) if isinstance(m.dispatch, RankViewDispatch)}
        assert split == set(view.dispatchers) and split
        assert all(m.experts.n_experts == m.gate.n_experts // 2 for n, m in moe_layers(model) if n in split)
        assert all(n.startswith(keep_whole) for n in set(names) - split)
        half = compute_logits(model, ids[:, :6])
        assert torch.isfinite(half).all()
        assert view.exchange(6)["pairs_received"] > 0
    assert all(m.experts.n_experts == m.gate.n_experts and isinstance(m.dispatch, LocalDispatch)
               for _, m in moe_layers(model))
    assert torch.equal(compute_logits(model, ids), before)


def test_view_errors_are_one_line():
    d = RankViewDispatch(E, 0, 4, torch.zeros(2, K, dtype=torch.long))
    with pytest.raises(DeepInferError, match="routing pool holds 2 rows; 3 other ranks of 1 rows need 3"):
        d.dispatch(*_routing(1, seed=0))
    model = random_model("deepseek_v4", "tiny", seed=0)
    with pytest.raises(DeepInferError, match="--rank 2: an expert-parallel group of 2 ranks"):
        with rank_view(model, 2, 2, {}):
            pass
    with pytest.raises(DeepInferError, match="no rows for MoE layer"):
        with rank_view(model, 2, 0, {}):
            pass
    assert all(m.experts.n_experts == 8 for _, m in moe_layers(model))


def _step(tmp_path, *args):
    result = CliRunner().invoke(cli, ["step", "--iters", "2", "--warmup", "0", "--trace-steps", "1",
                                      "--report-dir", str(tmp_path), *args])
    return result


def test_step_bench_rank_views_write_rows(tmp_path):
    res = _step(tmp_path, "--batch", "1,4", "--context", "16", "--ep", "1,2,4", "--rank", "1",
                "--eplb-redundant", "4")
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in next(tmp_path.glob("*/step-*/rows.jsonl")).read_text().splitlines()]
    by = {r["key"]: r for r in rows}
    assert set(by) == {f"decode-b{b}-c16-q1-ep{e}" for b in (1, 4) for e in (1, 2, 4)}
    layers = {r["layers"] for r in rows}.pop()
    for r in rows:
        assert r["status"] == "ok" and r["ep_rank"] == 1 and r["eplb_redundant"] == 4
        ep = r["expert_parallel"]
        if r["ep_size"] == 1:
            assert ep is None and r["experts_total"] == 8 * layers
            continue
        slots = (8 + 4) // r["ep_size"]
        assert r["experts_total"] == slots * layers
        assert ep["size"] == r["ep_size"] and ep["rank"] == 1
        assert ep["pairs_received"] == sum(v["pairs_per_rank"][1] for v in ep["layers"].values())
        assert all(sum(v["pairs_per_rank"]) == r["ep_size"] * r["batch"] * 2 for v in ep["layers"].values())
        assert 0 < ep["balancedness_min"] <= ep["balancedness_mean"] <= 1
        assert ep["bytes_sent"] > 0 and ep["bytes_received"] > 0
    assert "a2a MB" in res.output


@pytest.mark.parametrize("args,line", [
    (["--ep", "3"], "--ep 3: the model's 8 routed experts per layer do not divide over 3 ranks"),
    (["--ep", "2", "--eplb-redundant", "1"], r"8 routed experts \+ 1 redundant slots per layer do not divide"),
    (["--rank", "1"], "--rank sets up the expert-parallel rank view: add --ep"),
    (["--ep", "1,2", "--rank", "2"], r"--rank 2: every --ep group must have it; use 0\.\.1"),
    (["--ep", "2", "--prefill", "64"], "--ep measures decode / verify steps of one rank; drop --prefill"),
    (["--ep", "2,2"], "--ep"),
])
def test_step_bench_rank_view_bad_input(tmp_path, args, line):
    refuse_cli(cli, ["step", "--batch", "1", "--context", "16", "--report-dir", str(tmp_path), *args], line,
               watch=[tmp_path])


@pytest.mark.parametrize("arch", ["deepseek_v4", "deepseek_v41"])
def test_probe_rewind_lets_a_position_run_again(arch):
    """A decode step run twice at the same positions: V4.1's engram look-back ring (max_ngram - 1 rows) lost its
    oldest position to the first run's write, so the second differs unless the probe rewinds; V4's rings (windows
    that never read the overwritten row) give equal steps either way. Rewound, the logits are bitwise the first's."""
    from deepinfer import LLM
    from deepinfer.checkpoint.make import embedded_tiny_dir
    from deepinfer.runner.probe import StepProbe
    llm = LLM(embedded_tiny_dir(arch), device="cpu", dtype="float32", max_num_seqs=4, max_model_len=64)
    probe = StepProbe(llm, batch_size=4, context_len=16)
    runner = llm.engine.runner
    try:
        with torch.inference_mode():
            first = runner.run_shape(probe.inputs, graphed=False).clone()
            again = runner.run_shape(probe.inputs, graphed=False).clone()
            probe.rewind()
            rewound = runner.run_shape(probe.inputs, graphed=False)
    finally:
        probe.close()
    assert torch.equal(rewound, first)
    assert torch.equal(again, first) == (arch == "deepseek_v4")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["deepseek_v4", "deepseek_v41"])
def test_gpu_view_step_replays_as_a_cuda_graph(arch):
    """The view's dispatch has no host read: a decode step of rank 1 of EP 4 captures as a CUDA graph, and its
    replays give the eager step's logits; leaving the view, the whole model's graph is captured anew and equals
    its eager step."""
    from deepinfer import LLM
    from deepinfer.checkpoint.make import embedded_tiny_dir
    from deepinfer.harness.step_bench import StepPoint
    from deepinfer.harness.step_ranks import routing_pool
    from deepinfer.runner.probe import StepProbe
    llm = LLM(embedded_tiny_dir(arch), device="cuda", dtype="float32", max_num_seqs=8, max_model_len=64)
    label_dispatchers(llm.model)
    runner = llm.engine.runner
    with torch.inference_mode():
        pool = routing_pool(llm, StepProbe, 3 * 8, StepPoint("decode", 8, 16, 1), seed=1)
    probe = StepProbe(llm, batch_size=8, context_len=16)
    try:
        with torch.inference_mode():
            keep_whole = llm.model.drafting.modules if llm.model.drafting is not None else ()
            runner.drop_graphs()
            with rank_view(llm.model, 4, 1, pool, keep_whole=keep_whole) as view:
                eager = runner.run_shape(probe.inputs, graphed=False).clone()
                probe.rewind()                  # each step sees the seeded state (V4.1's look-back: probe.rewind)
                first = runner.run_shape(probe.inputs).clone()
                probe.rewind()
                again = runner.run_shape(probe.inputs).clone()
                assert view.exchange(8)["pairs_received"] > 0
            assert runner.graphs.graphs                      # it replayed a captured graph
            torch.testing.assert_close(first, eager, rtol=1e-5, atol=1e-5)
            assert torch.equal(first, again)
            runner.drop_graphs()
            probe.rewind()
            whole = runner.run_shape(probe.inputs, graphed=False).clone()
            probe.rewind()
            torch.testing.assert_close(runner.run_shape(probe.inputs), whole, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(whole, eager, rtol=1e-3, atol=1e-3)   # the view did change the step
    finally:
        probe.close()
