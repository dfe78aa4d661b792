"""Shared fixtures: one tiny checkpoint per session, and a private copy of it per test to corrupt."""

from __future__ import annotations

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
