"""Shared test builders: random V4 configs, our model with random weights, the transformers twin."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.checkpoint.random_init import init_random_weights
from deepinfer.config.deepseek_v4 import CSA, HASH_MOE, HCA, MOE, SLIDING
from deepinfer.config.presets import TINY_V4
from deepinfer.models import build_model

# Layer schedules the parity tests cover (plus the tiny preset's own S/CSA/HCA/CSA).
SCHEDULES = {
    "tiny": TINY_V4,
    "hca-first": dataclasses.replace(TINY_V4, layer_types=(HCA, HCA, CSA, SLIDING),
                                     mlp_layer_types=(HASH_MOE, MOE, MOE, MOE)),
    "csa-only-no-hash": dataclasses.replace(TINY_V4, num_hidden_layers=3, layer_types=(CSA, CSA, CSA),
                                            mlp_layer_types=(MOE, MOE, MOE), num_experts_per_tok=3,
                                            compress_rates=((CSA, 4), (HCA, 8)), sliding_window=8),
}


def our_model(cfg=TINY_V4, seed: int = 0, dtype=torch.float32, qat: bool = False, device: str = "cpu"):
    model = build_model(cfg, device, dtype, qat_fake_quant=qat)
    init_random_weights(model, seed)
    return model


def transformers_twin(model, dtype=torch.float32):
    """transformers' DeepseekV4ForCausalLM holding exactly our model's weights (harness/versus_bench.py)."""
    from deepinfer.harness.versus_bench import transformers_twin as twin
    return twin(model, dtype)


def config_error(raw: dict, *fragments: str) -> str:
    """parse_model_config(raw) must fail with one ConfigError line holding every fragment; returns it."""
    from deepinfer.config import parse_model_config
    from deepinfer.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_model_config(raw)
    msg = str(info.value)
    assert msg and "\n" not in msg, f"message is not one line: {msg!r}"
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


def deepinfer_exe() -> str:
    """The installed `deepinfer` console script (skips the test when it is not installed)."""
    exe = Path(sys.executable).parent / "deepinfer"
    found = str(exe) if exe.is_file() else shutil.which("deepinfer")
    if found is None:
        pytest.skip("the deepinfer console script is not installed")
    return found


def capture_graph(fn, *args):
    """fn(*args) captured in a CUDA graph (fails on any host sync); returns (graph, static output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args)
    return graph, out


def interpreter_run() -> tuple[list[str], dict[str, str]]:
    """pytest arguments and environment for a subprocess running tests in Triton's CPU interpreter
    (TRITON_INTERPRET=1): pytest-xdist's workers, one per core (at most 4), where it is installed. The interpreter
    runs one Python thread, so on CI's 2 cores two workers take about half the time; each worker's torch, OpenMP
    and BLAS then get one thread (two workers' thread pools spinning on two cores would cost more than they save)."""
    import os
    env = dict(os.environ, TRITON_INTERPRET="1")
    try:
        import xdist  # noqa: F401
    except ImportError:
        return [], env
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if min(cores, 4) < 2:
        return [], env
    env.update({v: "1" for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")})
    return ["-n", str(min(cores, 4))], env


def assert_traffic(row: dict) -> None:
    """A bench row carries the model's routed traffic (harness/traffic.py): experts touched per step beside a
    uniform router's, and per layer."""
    t = row.get("expert_traffic")
    assert t, f"{row.get('key')}: no expert_traffic"
    assert t["touched_per_step"] > 0 and t["uniform_per_step"] > 0 and t["layers"], row.get("key")
    assert isinstance(t["balanced"], bool) and t["load_max_over_mean"] >= 1.0, row.get("key")


def needs_gpu_memory(gib: float, what: str) -> None:
    """Skip, in one line, a test whose released-width build cannot fit this card (the H100's 78 GiB against the
    H200's 139 GiB); `what`: the measured reason."""
    total = torch.cuda.get_device_properties(0).total_memory / 2**30
    if total < gib:
        pytest.skip(f"needs {gib:.0f} GiB of GPU memory ({what}); this card has {total:.0f} GiB")


ROOT = Path(__file__).resolve().parents[1]


def torchrun() -> list[str]:
    """The torchrun launcher of this interpreter's environment (or the module form)."""
    exe = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


def run_worker(worker: Path, spec: dict, out_dir: Path, nproc: int | None,
               timeout_s: float = 240) -> tuple[subprocess.CompletedProcess, object]:
    """A tests/distributed worker (argv: output path, JSON spec) as one plain process (nproc None) or nproc ranks
    under torchrun, one thread each -> (the process, the JSON rank 0 wrote, or None when it wrote none)."""
    out = out_dir / f"out-{nproc}-{os.urandom(4).hex()}.json"
    launch = [sys.executable] if nproc is None else [*torchrun(), "--standalone", "--nproc-per-node", str(nproc)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([*launch, str(worker), str(out), json.dumps(spec)], capture_output=True, text=True,
                       timeout=timeout_s, env=env, cwd=ROOT)
    return r, (json.loads(out.read_text()) if out.exists() else None)
