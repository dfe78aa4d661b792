"""Shared fixtures: one tiny checkpoint per session, and a private copy of it per test to corrupt."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint_dir(tmp_path_factory) -> Path:
    """The tiny deepseek_v4 preset (seed 0) in DeepSeek's on-disk layout (FP8 dense, FP4 experts, 2 shards),
    written once per session. Treat it as read-only: copy it (`tiny_checkpoint_copy`) before changing it."""
    from deepinfer.checkpoint.make import make_checkpoint

    return make_checkpoint("deepseek_v4", "tiny", "deepseek", 0, tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture
def tiny_checkpoint_copy(tiny_checkpoint_dir, tmp_path) -> Path:
    """A private, writable copy of the session's tiny checkpoint."""
    return Path(shutil.copytree(tiny_checkpoint_dir, tmp_path / "ckpt"))


V4_REFERENCE_TRANSFORMERS = "5.23.0"   # pyproject's test / reference extras pin the same version


@pytest.fixture(scope="session")
def transformers_v4_reference():
    """The transformers module when it is the V4 parity reference: transformers==5.23.0, exactly, the release
    whose DeepseekV4ForCausalLM / DeepseekV4Config every V4 comparison with transformers was written against.
    Any other version (the GPU image's 5.17, a build from main) or none: the requesting test skips with one line
    naming both versions, rather than failing. Every test that compares with transformers' deepseek_v4 requests
    this fixture (directly, through `pytest.mark.usefixtures`, or through a fixture of its own)."""
    try:
        import transformers
    except ImportError:
        installed = "none"
    else:
        installed = transformers.__version__
        if installed == V4_REFERENCE_TRANSFORMERS:
            return transformers
    pytest.skip(f"V4 parity needs transformers=={V4_REFERENCE_TRANSFORMERS} (installed: {installed})")


@pytest.fixture(scope="session", autouse=True)
def warm_cpu_kernels():
    """Run each op the model uses once before any test compares outputs bitwise.

    NOTE: on the CI machine kind, the first call of some torch CPU elementwise kernels in a fresh process
    can return results an ulp away from every later call (seen: `x.cos()` on the same tensor, first call vs
    second, in ~7% of fresh processes, with nothing else in between). A test whose forward happens to be the
    process's first would then see bitwise differences that no code of ours causes.
    """
    import torch

    from deepinfer.config.presets import TINY_V4
    from deepinfer.checkpoint.random_init import init_random_weights
    from deepinfer.models import build_model
    from deepinfer.reference import compute_logits

    model = build_model(TINY_V4, "cpu", torch.float32, qat_fake_quant=True)
    init_random_weights(model, 0)
    compute_logits(model, torch.arange(40).view(1, 40))


@pytest.fixture
def one_thread():
    """Single-threaded CPU torch for tests that run many small kernel calls (fixed-tile invariant ops): a 2-thread
    OpenMP pool spins at every call when other processes share the cores (minutes instead of seconds). The same
    comparisons pass with the default thread count too."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def no_engine_switches(monkeypatch):
    """No DEEPINFER_* variable from the calling shell (a CI or GPU run may set some): a test that sets switches
    sees only its own. Yields monkeypatch."""
    for name in [n for n in os.environ if n.startswith("DEEPINFER_")]:
        monkeypatch.delenv(name)
    yield monkeypatch
