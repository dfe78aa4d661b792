"""Sharded loading under expert parallelism (gloo, CPU, 2 and 4 processes under torchrun) of checkpoints written by
make-checkpoint in several shards: each rank reads from the shards only what it holds (every routed expert of the
expert-parallel layers on exactly the ranks that hold it, every other tensor once per rank), allocates only its
expert slots, never holds more read bytes at once than the largest shard, and the engine's outputs equal a
single-process load of the same checkpoint token for token and bitwise in logprobs (batch-invariant kernels).
V4.1 runs with its engram tables in host memory (engram_table_device="cpu"); an EPLB placement with replicas
loads with keep_quantized. In-process: transformers' stacked V4 experts read by row, the loader's one-line errors
under sharding, host tables equal on-device ones bitwise."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest
import torch

from deepinfer.checkpoint.names import split_expert_name
from deepinfer.errors import DeepInferError

from .helpers import run_worker

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "load_worker.py"
PROMPTS = [[5 + i, 9, 11 + i, 13, 7 + i, 21, 30 + i, 2][: 3 + i % 6] for i in range(5)]
SHARD_BYTES = 256 << 10          # several shards even for the tiny presets
TIMEOUT_S = 240
DRAFT = "mtp."                   # V4's MTP layer, V4.1's DSpark stages: whole on every rank


def _run(spec: dict, out_dir: Path, nproc: int | None) -> dict:
    """The worker as one plain process (nproc None) or nproc ranks under torchrun -> rank 0's JSON."""
    r, got = run_worker(WORKER, spec, out_dir, nproc, TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    return got


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from deepinfer.checkpoint.make import make_checkpoint
    root = tmp_path_factory.mktemp("sharded")
    with mock.patch("deepinfer.checkpoint.make.SHARD_BYTES", SHARD_BYTES):
        return {"v4": make_checkpoint("deepseek_v4", "tiny", "deepseek", 0, root / "v4"),
                "v41": make_checkpoint("deepseek_v41", "tiny", "deepseek", 0, root / "v41", layers=5)}   # engram layer 1


def _weight_map(ckpt: Path) -> dict[str, str]:
    return json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]


def _spec(ckpt: Path, **kw) -> dict:
    return {"model": str(ckpt), "prompts": PROMPTS, "max_tokens": 5, "max_num_seqs": 3,
            "kernel_backend": "invariant", **kw}


def _ep_expert(name: str) -> tuple[str, int] | None:
    """(stack, expert) of a routed expert's tensor in an expert-parallel layer; None for everything else."""
    e = split_expert_name(name)
    return None if e is None or name.startswith(DRAFT) else (e[0], e[1])


def _check_reads(ranks: list[dict], weight_map: dict[str, str], holders) -> None:
    """Every checkpoint tensor read on exactly the ranks that need it, once each: a routed expert of an
    expert-parallel layer on holders(stack, expert), everything else on every rank; whole tensors only."""
    for r, rank in enumerate(ranks):
        names = [name for name, rows in rank["reads"]]
        assert all(rows is None for _, rows in rank["reads"])       # the DeepSeek layout: one tensor per expert
        assert len(names) == len(set(names)), f"rank {r} read a tensor twice"
        want = {n for n in weight_map if _ep_expert(n) is None or r in holders(*_ep_expert(n))}
        assert set(names) == want, (r, sorted(set(names) ^ want)[:5])
    experts = [n for n in weight_map if _ep_expert(n) is not None]
    assert experts and sum(len(holders(*_ep_expert(n))) for n in experts) < len(experts) * len(ranks)


def _check_memory(ranks: list[dict], one: dict, ckpt: Path, share) -> None:
    """Each rank's expert-parallel stacks hold share(r, stack) of the one-process bytes, the rest is whole, and the
    read tensors alive at once (besides those the model keeps) never exceeded the largest shard."""
    largest = max((ckpt / shard).stat().st_size for shard in set(_weight_map(ckpt).values()))
    full = one["ranks"][0]["model_bytes"]
    for r, rank in enumerate(ranks):
        got = rank["model_bytes"]
        assert got["other"] == full["other"]
        for stack, n in full["experts"].items():
            assert got["experts"][stack] == (n if stack.startswith(DRAFT) else n * share(r, stack)), (r, stack)
        assert 0 < rank["peak_read_bytes"] <= largest


def _check_outputs(got: dict, want: dict) -> None:
    assert [g["ids"] for g in got["rows"]] == [w["ids"] for w in want["rows"]]
    assert [g["logprobs"] for g in got["rows"]] == [w["logprobs"] for w in want["rows"]]


@pytest.fixture(scope="module")
def one_process(checkpoints, tmp_path_factory):
    """The single-process load and generate of each checkpoint (tables on the model's device)."""
    return {k: _run(_spec(ckpt), tmp_path_factory.mktemp("one"), None) for k, ckpt in checkpoints.items()}


@pytest.mark.parametrize("model, nproc, dispatch", [("v4", 2, "allgather"), ("v41", 2, "alltoall")])
def test_each_rank_reads_only_its_experts_and_matches_one_process(model, nproc, dispatch, checkpoints, one_process,
                                                                  tmp_path):
    ckpt = checkpoints[model]
    extra = {"engram_table_device": "cpu"} if model == "v41" else {}
    got = _run(_spec(ckpt, data_parallel_size=nproc, enable_expert_parallel=True, expert_dispatch=dispatch,
                     **extra), tmp_path, nproc)
    per_rank = 8 // nproc                                # the tiny presets' 8 routed experts
    _check_reads(got["ranks"], _weight_map(ckpt), lambda stack, j: {j // per_rank})
    _check_memory(got["ranks"], one_process[model], ckpt, lambda r, stack: 1 / nproc)
    _check_outputs(got, one_process[model])
    assert all(rank["kept_read_bytes"] == 0 for rank in got["ranks"])
    if model == "v41":
        assert all(rank["host_tables"] == ["cpu"] for rank in got["ranks"])
        assert one_process[model]["ranks"][0]["host_tables"] == []


def test_an_eplb_placement_with_replicas_loads_sharded_with_keep_quantized(checkpoints, one_process, tmp_path):
    """8 experts + 4 replicas over 4 ranks (3 slots each): a replicated expert is read once by each rank holding it;
    the quantized tensors kept beside the weights are this rank's experts' only."""
    from deepinfer.parallel.balancer import EplbConfig, layer_placement
    ckpt, nproc = checkpoints["v4"], 4
    got = _run(_spec(ckpt, data_parallel_size=nproc, enable_expert_parallel=True, expert_dispatch="alltoall",
                     enable_eplb=True, eplb_config={"num_redundant_experts": 4, "step_interval": 0},
                     keep_quantized=True), tmp_path, nproc)
    placement = layer_placement(EplbConfig(4), "layers.0.ffn", 8, nproc).phy2log.tolist()     # even load: any layer
    held = [placement[3 * r: 3 * r + 3] for r in range(nproc)]
    assert len({j for slots in held for j in slots}) == 8 and len(placement) == 12
    _check_reads(got["ranks"], _weight_map(ckpt), lambda stack, j: {r for r in range(nproc) if j in held[r]})
    _check_memory(got["ranks"], one_process["v4"], ckpt, lambda r, stack: 3 / 8)
    for r, rank in enumerate(got["ranks"]):                       # 4 EP layers x distinct experts x w1 w2 w3, + MTP
        assert rank["quantized_experts"] == 3 * (4 * len(set(held[r])) + 8)
        assert rank["kept_read_bytes"] > 0
    _check_outputs(got, one_process["v4"])


# ---- in one process: the loader's view of a rank (a dispatcher that holds some experts) ----
class _Holds:
    """A stand-in dispatcher that holds these experts (as an expert-parallel one's held_experts says)."""

    def __init__(self, experts: list[int]):
        self.experts = experts

    def held_experts(self) -> list[int]:
        return self.experts


def _hold(experts: list[int]):
    from deepinfer.models.common.moe import use_expert_parallel
    return lambda m: use_expert_parallel(m, lambda name, n: _Holds(experts), m.drafting.modules)


def test_stacked_transformers_experts_are_read_by_row(tmp_path):
    """V4 in transformers' layout stacks a layer's experts in one tensor: a rank reads only its experts' rows, and
    holds the values a whole load holds there (a replica twice)."""
    import deepinfer.checkpoint.loader as loader
    from deepinfer.api import load_model
    from deepinfer.checkpoint.make import make_checkpoint
    ckpt = make_checkpoint("deepseek_v4", "tiny", "hf", 0, tmp_path / "hf", layers=2)
    held = [5, 2, 2]
    rows, opened = [], loader.safe_open

    class Recording:
        def __init__(self, path, **kw):
            self.f = opened(path, **kw)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            assert ".mlp.experts." not in name or name.startswith("mtp."), f"{name} read whole"
            return self.f.get_tensor(name)

        def get_slice(self, name):
            sl = self.f.get_slice(name)
            return type("Rows", (), {"get_shape": lambda _: sl.get_shape(),
                                     "__getitem__": lambda _, s: rows.append((name, s.start)) or sl[s]})()
    whole = load_model(ckpt)
    with mock.patch.object(loader, "safe_open", Recording):
        part = load_model(ckpt, prepare=_hold(held))
    assert sorted(r for r in rows if not r[0].startswith(DRAFT)) == sorted((f"model.layers.{i}.mlp.experts.{p}", j) for i in range(2)
                                  for p in ("gate_up_proj", "down_proj") for j in (2, 5))
    for name, t in part.state_dict().items():
        ref = whole.state_dict()[name]
        assert torch.equal(t, ref[held] if ".ffn.experts.w" in name and not name.startswith(DRAFT) else ref), name


def test_sharded_errors_stay_one_line(tiny_checkpoint_copy):
    """Another rank's expert is not unexpected, but a missing one is still missing on every rank, and an expert id
    beyond the layer's experts is still unexpected."""
    from safetensors.torch import load_file, save_file

    from deepinfer.api import load_model
    from deepinfer.errors import CheckpointError
    index = tiny_checkpoint_copy / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    victim = "layers.1.ffn.experts.6.w2.weight"                  # held by the other rank of two
    shard = tiny_checkpoint_copy / weight_map[victim]
    tensors = load_file(shard)
    save_file({k: v for k, v in tensors.items() if k != victim}, shard)
    del weight_map[victim]
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor\(s\) .*layers\.1\.ffn\.experts\.6\.w2\.weight"):
        load_model(tiny_checkpoint_copy, prepare=_hold([0, 1, 2, 3]))
    tensors = load_file(shard)
    tensors[victim] = tensors[next(k for k in tensors if ".experts." in k and k.endswith(".w2.weight"))].clone()
    tensors["layers.1.ffn.experts.8.w2.weight"] = tensors[victim].clone()
    save_file(tensors, shard)
    weight_map.update({victim: shard.name, "layers.1.ffn.experts.8.w2.weight": shard.name})
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor layers\.1\.ffn\.experts\.8\.w2\.weight"):
        load_model(tiny_checkpoint_copy, prepare=_hold([0, 1, 2, 3]))


def test_host_engram_tables_equal_device_tables(checkpoints):
    """engram_table_device='cpu' on a CPU run: the tables in plain host memory, gathered per forward, give the
    on-device tables' logprobs bit for bit."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.models.deepseek_v41.host_table import HostEngramEmbedding
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    outs = {}
    for where in (None, "cpu"):
        llm = LLM(str(checkpoints["v41"]), device="cpu", skip_tokenizer_init=True, engram_table_device=where)
        tables = [m for m in llm.model.modules() if isinstance(m, HostEngramEmbedding)]
        assert len(tables) == (1 if where else 0)
        outs[where] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
    assert outs["cpu"] == outs[None]


@pytest.mark.parametrize("model, kw, match", [
    ("v41", {"engram_table_device": "cuda:3"}, r"engram_table_device='cuda:3': use 'cpu'"),
    ("v4", {"engram_table_device": "cpu"}, r"this model has no engram layers: drop engram_table_device"),
])
def test_bad_engram_table_device_is_one_line(model, kw, match, checkpoints):
    from deepinfer import LLM
    with pytest.raises(DeepInferError, match=match) as err:
        LLM(str(checkpoints[model]), device="cpu", skip_tokenizer_init=True, **kw)
    assert "\n" not in str(err.value)
