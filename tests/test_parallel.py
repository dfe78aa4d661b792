"""Attention data parallelism x expert parallelism on torch.distributed (gloo, CPU), 2 and 4 processes under torchrun:
the outputs equal the one-process run's token for token, and in batch-invariant mode bitwise in logprobs too, with chunked prefill,
preemption, asynchronous scheduling and speculative decoding.
Launch mistakes end every rank with one line."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from deepinfer.errors import DeepInferError

from .helpers import run_worker

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "generate_worker.py"
PROMPTS = [[5 + i, 9, 11 + i, 13, 7 + i, 21, 30 + i, 2][: 3 + i % 6] for i in range(7)]
TIMEOUT_S = 240


def _run(spec: dict, tmp_path: Path, nproc: int | None) -> tuple[subprocess.CompletedProcess, list | None]:
    """The worker as one plain process (nproc None) or nproc ranks under torchrun -> (the process, rank 0's rows)."""
    return run_worker(WORKER, spec, tmp_path, nproc, TIMEOUT_S)


def _spec(model: str, **kw) -> dict:
    return {"model": model, "prompts": PROMPTS, "max_tokens": 6, "max_num_seqs": 3, **kw}


def _preempting_spec(model: str) -> dict:
    """8 prompts of 20-41 tokens, 24 new each, blocks of 16, and pools that hold 3 seats and 8 blocks per rank:
    sequences of 3-5 blocks outgrow them, so the ranks preempt and recompute."""
    from deepinfer.api import resolve_model
    from deepinfer.cache.pools import PoolLayout
    lay = PoolLayout.for_model(resolve_model(model, "cpu", "float32"), 16)
    prompts = [[(7 * i + 3 * j) % 400 + 5 for j in range(20 + 3 * i)] for i in range(8)]
    return {"model": model, "prompts": prompts, "max_tokens": 24, "max_num_seqs": 4, "block_size": 16,
            "max_model_len": 128, "kernel_backend": "invariant",
            "state_memory_bytes": 4 * lay.bytes_per_slot() + 10 * lay.bytes_per_block()}


CASES = {
    # invariant kernels: bitwise, logprobs included; chunked prefill (8-token budget) and preemption (few blocks)
    "v4-allgather-invariant": (_spec("random:deepseek_v4:tiny:2", kernel_backend="invariant",
                                     max_num_batched_tokens=8), 2, "allgather", True),
    "v4-alltoall-invariant": (_spec("random:deepseek_v4:tiny:2", kernel_backend="invariant"), 4, "alltoall", True),
    "v41-allgather-invariant": (_spec("random:deepseek_v41:tiny:2", kernel_backend="invariant"), 2, "allgather",
                                True),
    "v4-allgather-preempted": (_preempting_spec("random:deepseek_v4:tiny:2"), 2, "allgather", True),
    # speculative decoding: V4's MTP layer, V4.1's DSpark stages (confidence-scheduled, step rates profiled on each
    # rank); the draft layers keep their experts whole on every rank
    "v4-allgather-mtp": (_spec("random:deepseek_v4:tiny:2", kernel_backend="invariant", speculative=True), 2,
                         "allgather", True),
    "v41-alltoall-dspark": (_spec("random:deepseek_v41:tiny:2", kernel_backend="invariant",
                                  speculative={"schedule": "confidence"}), 2, "alltoall", True),
    # default kernels, asynchronous scheduling: greedy tokens equal
    "v4-alltoall-async": (_spec("random:deepseek_v4:tiny:2", async_scheduling=True), 2, "alltoall", False),
}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The one-process outputs of each case's model and settings."""
    cache = {}

    def get(spec: dict):
        key = json.dumps(spec, sort_keys=True)
        if key not in cache:
            r, rows = _run(spec, tmp_path_factory.mktemp("one"), None)
            assert r.returncode == 0, r.stderr[-3000:]
            cache[key] = rows
        return cache[key]
    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_dp_ep_equals_one_rank(case, one_rank, tmp_path):
    spec, nproc, dispatch, bitwise = CASES[case]
    want = one_rank(spec)
    r, got = _run({**spec, "data_parallel_size": nproc, "enable_expert_parallel": True, "expert_dispatch": dispatch},
                  tmp_path, nproc)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [g["ids"] for g in got["rows"]] == [w["ids"] for w in want["rows"]]
    if bitwise:
        assert [g["logprobs"] for g in got["rows"]] == [w["logprobs"] for w in want["rows"]]
    else:
        for g, w in zip(got["rows"], want["rows"]):
            assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-4)
    if case.endswith("preempted"):
        assert got["preemptions"] > 0 and want["preemptions"] > 0
    if "speculative" in spec:
        assert got["draft_tokens"] > 0 and want["draft_tokens"] > 0


def test_data_parallel_without_expert_parallel_equals_one_rank(one_rank, tmp_path):
    spec = _spec("random:deepseek_v4:tiny:2", kernel_backend="invariant")
    r, got = _run({**spec, "data_parallel_size": 2}, tmp_path, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert got == one_rank(spec)


def test_a_mismatched_launch_is_one_line(tmp_path):
    spec = _spec("random:deepseek_v4:tiny:2", data_parallel_size=4, enable_expert_parallel=True)
    r, got = _run(spec, tmp_path, 2)
    assert r.returncode != 0 and got is None
    assert "error: data_parallel_size=4, but torchrun started 2 processes" in r.stderr


def test_the_preempting_case_preempts_on_one_rank(one_rank):
    assert one_rank(CASES["v4-allgather-preempted"][0])["preemptions"] > 0


def test_a_lost_rank_is_one_line_on_the_others(tmp_path):
    """Rank 1 leaves before generating: rank 0's next collective fails and says so in one line, well inside the
    timeout."""
    spec = _spec("random:deepseek_v4:tiny:2", data_parallel_size=2, enable_expert_parallel=True,
                 distributed_timeout_s=60, stop_rank=1)
    r, got = _run(spec, tmp_path, 2)
    assert r.returncode != 0 and got is None
    assert "error: rank 0 of 2 lost the other ranks in " in r.stderr, r.stderr[-2000:]


# ---- the settings, checked before any rank waits on another ----
@pytest.mark.parametrize("kw, match", [
    ({"data_parallel_size": 2}, "not started by torchrun"),
    ({"data_parallel_size": 0}, "data_parallel_size=0 must be an integer >= 1"),
    ({"enable_expert_parallel": True}, "data_parallel_size=1 is one rank"),
    ({"expert_dispatch": "alltoall"}, "set enable_expert_parallel=True"),
    ({"expert_dispatch": "nvlink"}, "expert_dispatch='nvlink': use one of"),
    ({"distributed_timeout_s": 5}, "data_parallel_size=1 has none"),
    ({"distributed_timeout_s": -1}, "must be a number of seconds > 0"),
])
def test_bad_parallel_settings_are_one_line(kw, match, monkeypatch):
    from deepinfer import LLM
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(DeepInferError, match=match):
        LLM("random:deepseek_v4:tiny:2", device="cpu", skip_tokenizer_init=True, **kw)


@pytest.mark.parametrize("backend, module", [("nccl_ep", "nccl.ep"), ("deepep", "deep_ep")])
def test_device_count_dispatch_is_refused_in_one_line(backend, module, monkeypatch):
    """The nccl4py EP / DeepEP slot: one line naming the library when it does not import, and one line saying the
    backend is not built when it does (a stand-in module), both before any rank waits on another."""
    from deepinfer import LLM
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    kw = dict(device="cpu", skip_tokenizer_init=True, data_parallel_size=2, enable_expert_parallel=True,
              expert_dispatch=backend)
    monkeypatch.setitem(sys.modules, module, None)           # None in sys.modules: the import fails
    with pytest.raises(DeepInferError, match=rf"expert_dispatch='{backend}' needs .*`import {module}` fails here "
                                             r".*use one of \['allgather', 'alltoall'\]"):
        LLM("random:deepseek_v4:tiny:2", **kw)
    monkeypatch.setitem(sys.modules, module, types.ModuleType(module))
    with pytest.raises(DeepInferError, match=rf"expert_dispatch='{backend}': {module} imports, but deepinfer's "
                                             r"backend on it is not built yet"):
        LLM("random:deepseek_v4:tiny:2", **kw)


def test_expert_shard_buckets():
    from deepinfer.parallel.expert_parallel import ExpertShard
    shard = ExpertShard(8, rank=1, size=4)                     # experts 2, 3
    assert (shard.first, shard.count) == (2, 2)
    assert shard.bucket_of(torch.device("cpu")).tolist() == [2, 2, 0, 1, 2, 2, 2, 2, 2]   # else / pad id 8: bucket 2


# ---- EPLB: a static placement from a recorded load ----
SKEWED = "random:deepseek_v4:tiny:2:skew=1.2"


def _record_load(path: Path) -> Path:
    from deepinfer import LLM, SamplingParams
    from deepinfer.parallel.balancer import write_load
    llm = LLM(SKEWED, device="cpu", skip_tokenizer_init=True, expert_traffic=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=6),
                 use_tqdm=False)
    write_load(path, llm.traffic)
    return path


@pytest.mark.parametrize("dispatch", ["allgather", "alltoall"])
def test_eplb_placement_equals_one_rank(dispatch, one_rank, tmp_path):
    """8 experts + 2 replicas over 2 ranks, placed from the skewed model's recorded load: the hot experts get the
    replicas, and the outputs stay bitwise the one-rank ones."""
    from deepinfer.parallel.balancer import EplbConfig, layer_placement, read_load
    load = _record_load(tmp_path / "load.json")
    cfg = EplbConfig(2, load=read_load(load))
    name, per_expert = next(iter(cfg.load.items()))
    placed = layer_placement(cfg, name, 8, 2)
    hot = max(range(8), key=lambda e: per_expert[e])
    assert placed.counts[hot] == 2 and len(placed.phy2log) == 10
    spec = _spec(SKEWED, kernel_backend="invariant")
    r, got = _run({**spec, "data_parallel_size": 2, "enable_expert_parallel": True, "expert_dispatch": dispatch,
                   "enable_eplb": True, "eplb_config": {"num_redundant_experts": 2, "load": str(load),
                                                        "step_interval": 0}}, tmp_path, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert got["rows"] == one_rank(spec)["rows"]


def test_rebalancing_mid_generation_changes_no_output_bit(one_rank, tmp_path):
    """Live EPLB: every 3 steps the ranks sum a 4-step window of the skewed model's load, place anew and move the
    expert weights between them (starting from an even placement, so the first rebalance moves experts); the
    outputs, logprobs included, stay the one-rank ones."""
    spec = _spec(SKEWED, kernel_backend="invariant", max_tokens=12)
    r, got = _run({**spec, "data_parallel_size": 2, "enable_expert_parallel": True, "enable_eplb": True,
                   "eplb_config": {"num_redundant_experts": 2, "window_size": 4, "step_interval": 3}}, tmp_path, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert got["rebalances"] >= 2 and got["moved_slots"] > 0, got
    assert got["rows"] == one_rank(spec)["rows"]


def test_expert_traffic_counts_each_ranks_own_rows(one_rank, tmp_path):
    """expert_traffic under expert parallelism: each rank counts the logical experts of its own rows (idle steps
    count nothing), so the ranks' loads add up to the one-rank load, layer by layer."""
    spec = _spec("random:deepseek_v4:tiny:2", kernel_backend="invariant", expert_traffic=True)
    r, got = _run({**spec, "data_parallel_size": 2, "enable_expert_parallel": True}, tmp_path, 2)
    assert r.returncode == 0, r.stderr[-3000:]
    want = one_rank(spec)
    assert got["rows"] == want["rows"] and want["load"] and got["load"] == want["load"]


def test_replicas_share_a_logical_experts_pairs():
    from deepinfer.parallel.expert_parallel import Placement
    p = Placement(torch.tensor([0, 1, 2, 0]), torch.tensor([[0, 3], [1, -1], [2, -1]]), torch.tensor([2, 1, 1]))
    assert p.physical(torch.tensor([[0, 1], [0, 2], [0, 1]])).tolist() == [[0, 1], [3, 2], [0, 1]]
    assert p.physical(torch.tensor([[0, 2]]), first_row=1).tolist() == [[3, 2]]     # rank 1's one decode row


@pytest.mark.parametrize("kw, match", [
    ({"enable_eplb": True}, "set enable_expert_parallel=True"),
    ({"eplb_config": {"num_redundant_experts": 2}}, "set enable_eplb=True or drop it"),
    ({"enable_eplb": "yes"}, "enable_eplb='yes' must be True or False"),
])
def test_bad_eplb_settings_are_one_line(kw, match):
    from deepinfer import LLM
    with pytest.raises(DeepInferError, match=match):
        LLM("random:deepseek_v4:tiny:2", device="cpu", skip_tokenizer_init=True, **kw)


def test_a_bad_load_file_is_one_line(tmp_path):
    from deepinfer.parallel.balancer import eplb_config
    bad = tmp_path / "load.json"
    bad.write_text("{}")
    with pytest.raises(DeepInferError, match="not a load file written by"):
        eplb_config(True, {"num_redundant_experts": 1, "load": str(bad)}, True, {"eplb_config"})
    with pytest.raises(DeepInferError, match="must be a dict with num_redundant_experts"):
        eplb_config(True, {"num_redundant_experts": 1, "window": 10}, True, {"eplb_config"})
    with pytest.raises(DeepInferError, match="step_interval=-1 must be an integer >= 0"):
        eplb_config(True, {"num_redundant_experts": 1, "step_interval": -1}, True, {"eplb_config"})
