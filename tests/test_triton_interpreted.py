"""Runs tests/interpreted/ (Triton kernels in Triton's CPU interpreter) in a subprocess with TRITON_INTERPRET=1:
Triton decides at import whether kernels are interpreted, so they cannot share this process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import interpreter_run

pytest.importorskip("triton")

HERE = Path(__file__).parent


def test_interpreted_kernels():
    args, env = interpreter_run()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
                           str(HERE / "interpreted")], env=env, capture_output=True, text=True, timeout=1200)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail, tail
