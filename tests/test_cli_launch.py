"""A torchrun rank leaves through deepinfer.cli.leave_launch (os._exit after its command): the exit status and the
error contract are those of a single process, and nothing printed is lost."""

import os
import subprocess
import sys

import pytest

SCRIPT = """
import sys
from deepinfer.cli import run_cli
from deepinfer.errors import DeepInferError

def ok():
    print("rows written", end="")            # no newline: os._exit must not drop a buffered line

def bad_input():
    raise DeepInferError("the sweep file names no scenarios: add one")

def crash():
    raise RuntimeError("a bug")

def message():
    sys.exit("stopped: see above")

run_cli({"ok": ok, "bad_input": bad_input, "crash": crash, "message": message}[sys.argv[1]])
print("never reached")             # os._exit ended the rank in run_cli
"""


@pytest.mark.parametrize("case,code,out,err", [
    ("ok", 0, "rows written", None),
    ("bad_input", 2, "", "error: the sweep file names no scenarios: add one"),
    ("crash", 1, "", "RuntimeError: a bug"),
    ("message", 1, "", "stopped: see above"),
])
def test_a_launch_rank_exits_like_one_process(case, code, out, err):
    """(A single process keeps the plain sys.exit path: tests/test_bad_input.py.)"""
    env = {**os.environ, "WORLD_SIZE": "2"}
    p = subprocess.run([sys.executable, "-c", SCRIPT, case], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == code, p.stderr
    assert p.stdout == out
    if err is not None:
        assert err in p.stderr
    if case == "bad_input":
        assert p.stderr.strip() == err and "Traceback" not in p.stderr
    if case == "crash":
        assert "Traceback" in p.stderr
