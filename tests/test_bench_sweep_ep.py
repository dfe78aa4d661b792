"""deepinfer-bench sweep with expert parallelism: a role with ep > 1 is one expert-parallel engine over the launch's
ranks (two CPU processes on gloo under torchrun, the tiny model), stepping in lockstep; rows record the topology
and the balancedness of the ranks' experts; bad topologies are one line."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from deepinfer.harness.cli import cli
from deepinfer.harness.expert_balance import balance_fields, rank_pairs
from deepinfer.harness.rows import RowStore
from deepinfer.harness.sweep import TopologyError, run_sweep
from deepinfer.harness.sweep_config import SweepConfigError, parse_sweep
from deepinfer.parallel.eplb import balancedness as eplb_balancedness

ROOT = Path(__file__).resolve().parents[1]
EP2 = {"name": "ep2", "model": "tiny", "device": "cpu", "mode": "decode",
       "engine_args": {"max_num_seqs": 4, "max_num_batched_tokens": 256, "max_model_len": 64},
       "scenarios": [{"isl": 16, "osl": 4}], "concurrency": [1, 2], "num_prompts_per_concurrency": 5,
       "range_ratio": 1.0, "warmup": 1, "topology": {"decode_ranks": 2, "ep": 2}}


# ---- balancedness: pairs per rank's experts from the summed logical load and the placement ----

def test_rank_pairs_contiguous_and_eplb():
    assert rank_pairs([1, 2, 3, 4], 2) == [3.0, 7.0]                     # rank r holds experts [r E/N, (r+1) E/N)
    load, phy2log = [6, 1, 1, 2], [0, 1, 2, 0, 3, 0]                     # expert 0 has three replicas
    pairs = rank_pairs(load, 2, phy2log)
    assert pairs == pytest.approx([6 / 3 + 1 + 1, 6 / 3 + 2 + 6 / 3]) and sum(pairs) == pytest.approx(sum(load))
    ours = sum(pairs) / 2 / max(pairs)
    theirs = eplb_balancedness(torch.tensor([load]), torch.tensor([phy2log]), 2)    # the engine's EPLB measure
    assert ours == pytest.approx(float(theirs[0]))


def test_balance_fields_sum_ranks_and_skip_unrouted_and_local_layers():
    rank0 = {"a": {"load": [4, 0, 0, 0], "rows": 2, "top_k": 2}, "b": {"load": [0, 0, 0, 0], "rows": 0, "top_k": 0},
             "draft": {"load": [9, 9], "rows": 9, "top_k": 2}}
    rank1 = {"a": {"load": [0, 0, 2, 2], "rows": 2, "top_k": 2}, "b": {"load": [0, 0, 0, 0], "rows": 0, "top_k": 0},
             "draft": {"load": [1, 1], "rows": 1, "top_k": 2}}
    placement = {"a": {"ranks": 2, "phy2log": None}, "b": {"ranks": 2, "phy2log": None}}   # draft: not parallel
    out = balance_fields([rank0, rank1], placement)
    layer = out["expert_load"]["layers"]["a"]
    assert set(out["expert_load"]["layers"]) == {"a"}                     # b routed nothing; draft runs whole
    assert layer["pairs_per_rank"] == [4.0, 4.0] and layer["pairs"] == 8 == layer["rows"] * layer["top_k"]
    assert out["balancedness"] == out["balancedness_min"] == 1.0
    skewed = balance_fields([{"a": {"load": [3, 1, 0, 0], "rows": 2, "top_k": 2}}], placement)
    assert skewed["balancedness"] == 0.5 and skewed["expert_load"]["pairs_per_rank"] == [4.0, 0.0]
    assert balance_fields([], {}) == {"balancedness": None, "balancedness_min": None, "expert_load": None}


# ---- bad combinations: one line each ----

@pytest.mark.parametrize("change, message", [
    ({"topology": {"decode_ranks": 4, "ep": 3}}, r"topology\.ep: got 3; the decode role has decode_ranks=4.*1 or "
                                                 r"the role's ranks \(4\)"),
    ({"topology": {"decode_ranks": 4, "ep": 4, "dp": 2}}, r"topology\.dp: got 2.*must be 1 or the role's ranks"),
    ({"mode": "both", "topology": {"prefill_ranks": 4, "decode_ranks": 2, "ep": 2}},
     r"topology\.ep: got 2; the prefill role has prefill_ranks=4"),
    ({"topology": {"decode_ranks": 2}, "engine_args": {**EP2["engine_args"], "expert_dispatch": "alltoall"}},
     r"engine_args\.expert_dispatch: configures expert parallelism, and no role runs it"),
    ({"engine_args": {**EP2["engine_args"], "expert_dispatch": "nvshmem"}},
     r"engine_args\.expert_dispatch: got 'nvshmem'; allowed: allgather, alltoall, nccl_ep, deepep"),
    ({"engine_args": {**EP2["engine_args"], "eplb_config": {"num_redundant_experts": 2}}},
     r"engine_args: eplb_config configures EPLB: set enable_eplb"),
    ({"engine_args": {**EP2["engine_args"], "enable_eplb": True, "eplb_config": {"window": 3}}},
     r"engine_args: eplb_config=.* must be a dict with num_redundant_experts"),
])
def test_bad_topology_and_expert_parallel_args_are_one_line(change, message):
    with pytest.raises(SweepConfigError, match=message) as e:
        parse_sweep({**EP2, **change}, "s.yaml")
    assert "\n" not in str(e.value)


def test_launch_must_match_the_expert_parallel_engine(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cases = [(None, EP2, r"asks for 2 decode ranks but this launch has 1 \(one CPU process\).*torchrun"),
             ("4", EP2, r"ep=2: the expert-parallel engine spans every rank of the launch, and this launch has 4"),
             ("2", {**EP2, "mode": "both"}, r"the decode role runs one expert-parallel engine over the launch's 2 "
                                            r"ranks .* prefill role has prefill_ranks=1: run the roles as two sweeps")]
    for world, sweep, message in cases:
        if world is not None:
            monkeypatch.setenv("WORLD_SIZE", world)
        with pytest.raises(TopologyError, match=message) as e:
            run_sweep(parse_sweep(sweep), tmp_path, progress=False)
        assert "\n" not in str(e.value)
    assert not (tmp_path / "1").exists()                 # refused before any run directory


def test_cli_rank_flags_reach_the_expert_parallel_checks(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    (tmp_path / "ep2.yaml").write_text(json.dumps(EP2))
    runner = CliRunner()
    res = runner.invoke(cli, ["sweep", str(tmp_path / "ep2.yaml"), "--decode-ranks", "4", "--report-dir",
                              str(tmp_path / "r"), "--no-progress"])
    assert res.exit_code != 0 and "topology.ep: got 2; the decode role has decode_ranks=4" in str(res.exception)
    (tmp_path / "dp.yaml").write_text(json.dumps({**EP2, "topology": {}}))
    res = runner.invoke(cli, ["sweep", str(tmp_path / "dp.yaml"), "--decode-ranks", "2", "--report-dir",
                              str(tmp_path / "r"), "--no-progress"])          # the flag sets the role's ranks
    assert res.exit_code != 0 and "asks for 2 decode ranks but this launch has 1" in str(res.exception)


# ---- two ranks under torchrun: one expert-parallel engine, lockstep, rows with topology and balancedness ----

def _torchrun_sweep(tmp_path: Path, sweep: dict, run_id: str) -> list[dict]:
    exe = Path(sys.executable).parent / "deepinfer-bench"
    if not exe.exists():
        pytest.skip("deepinfer-bench is not installed")
    (tmp_path / f"{run_id}.yaml").write_text(json.dumps(sweep))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                        str(port), str(exe), "sweep", str(tmp_path / f"{run_id}.yaml"), "--report-dir",
                        str(tmp_path / "r"), "--run-id", run_id, "--no-progress", "--no-report"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return RowStore(tmp_path / "r" / "1" / run_id).rows()


def _check_rows(rows: list[dict], run_dir: Path, dispatch: str, eplb: dict | None) -> None:
    assert [r["key"] for r in rows] == ["decode/isl16-osl4/c1", "decode/isl16-osl4/c2"]
    for r in rows:
        c = r["concurrency"]
        assert r["status"] == "ok" and r["launch_ranks"] == 2 and r["gpus"] == 2
        assert (r["ep"], r["dp"], r["expert_parallel"], r["expert_dispatch"], r["eplb"]) == (2, 2, True, dispatch,
                                                                                               eplb)
        assert r["completed"] == 5 * c and r["failed"] == 0
        assert r["total_output_tokens"] == 4 * 5 * c and r["total_input_tokens"] == 16 * 5 * c   # range_ratio 1
        assert r["output_tput_per_gpu"] == pytest.approx(r["output_throughput"] / 2) and r["median_tpot"] > 0
        raw = json.loads((run_dir / "raw" / f"decode__isl16-osl4__c{c}.json").read_text())
        assert raw["output_lens"] == [4] * (5 * c) and all(t > 0 for t in raw["ttfts"])
        load = r["expert_load"]
        assert 0 < r["balancedness_min"] <= r["balancedness"] <= 1
        assert len(load["layers"]) == 10                        # the main stack's MoE layers; draft layers run whole
        for layer in load["layers"].values():
            assert len(layer["pairs_per_rank"]) == 2 and 0 < layer["balancedness"] <= 1
            assert sum(layer["pairs_per_rank"]) == pytest.approx(layer["pairs"])
            assert layer["pairs"] == layer["rows"] * layer["top_k"]    # two counters of every rank's routed rows
            assert layer["balancedness"] == pytest.approx(layer["pairs"] / 2 / max(layer["pairs_per_rank"]), abs=1e-4)
        assert min(v["rows"] for v in load["layers"].values()) >= 5 * c   # at least one row per request
        assert sum(load["pairs_per_rank"]) == pytest.approx(sum(v["pairs"] for v in load["layers"].values()), abs=0.1)
    # rank 0's engine (its stats are the row's) ran 5 requests of 4 tokens at both points: all of c1 (rank 1 had
    # no share and ran idle steps in lockstep) and its half of c2
    assert [r["engine_stats"]["committed_tokens"] for r in rows] == [4 * 5, 4 * 5]


@pytest.mark.parametrize("dispatch, eplb", [("allgather", None),
                                            ("alltoall", {"num_redundant_experts": 2, "step_interval": 0})])
def test_expert_parallel_sweep_under_torchrun(tmp_path, dispatch, eplb):
    """decode_ranks 2, ep 2: one engine over both ranks (allgather; alltoall with a static EPLB placement of 8
    experts + 2 replicas); at concurrency 1 one rank has no share and steps idle in lockstep; every request
    completes with its osl tokens; rows say the topology and the balancedness."""
    extra = {} if eplb is None else {"expert_dispatch": dispatch, "enable_eplb": True, "eplb_config": eplb}
    rows = _torchrun_sweep(tmp_path, {**EP2, "engine_args": {**EP2["engine_args"], **extra}}, "ep2")
    _check_rows(rows, tmp_path / "r" / "1" / "ep2", dispatch,
                None if eplb is None else {"window_size": 1000, "load": None, **eplb})


def test_generate_local_on_one_rank_is_generate():
    """The engine API the sweep's ranks use: this rank's own prompts, no gather; an empty share runs nothing."""
    from deepinfer import LLM, SamplingParams
    llm = LLM("tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=256, max_model_len=64)
    prompts = [{"prompt_token_ids": [20 + i, 31, 47, 9 + i]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    local = llm.generate_local(prompts, params)
    assert [o.outputs[0].token_ids for o in local] == [o.outputs[0].token_ids
                                                       for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(o.outputs[0].token_ids) == 3 and o.finished for o in local)
    before = llm.stats.steps
    assert llm.generate_local([]) == [] and llm.stats.steps == before      # one rank: no idle steps to meet
