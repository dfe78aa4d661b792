"""Context-parallel prefill (parallel/context_parallel.py) on torch.distributed (gloo, CPU), 2 and 4 processes under
torchrun: a prompt prefilled token-interleaved over the ranks leaves every rank the state a one-rank prefill leaves
(every ring and entry pool), the same last-position logits, and a decode step from that state gives the same
logits. fp32 tiny models; prompts of lengths that C does not divide, past the sliding window and over several
compression windows of every ratio, in two pieces (the second reads the first's state from the pools)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_parallel import _torchrun

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "distributed" / "cp_prefill_worker.py"
TIMEOUT_S = 240

# V4 tiny: window 16, CSA ratio 4 (top-8 of 23 entries), HCA ratio 16; V4.1 tiny: window 8, ratio-2 and ratio-1
# groups, candidate blocks. 75 + 18 and 45 + 11 tokens: no piece is a multiple of 2 or 4.
CASES = {
    "v4-cp2": ("deepseek_v4", 2, [75, 18], "invariant", 1e-6),
    "v4-cp4": ("deepseek_v4", 4, [75, 18], "invariant", 1e-6),
    "v41-cp2": ("deepseek_v41", 2, [45, 11], "invariant", 1e-6),
    # the default (reference) kernels: a rank's matmuls see fewer rows than one rank's, so fp32 rounding differs
    "v4-cp2-reference": ("deepseek_v4", 2, [75, 18], "reference", 1e-5),
}


def _run(spec: dict, nproc: int, tmp_path: Path) -> list[dict]:
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    r = subprocess.run([*_torchrun(), "--standalone", "--nproc-per-node", str(nproc), str(WORKER), str(out),
                        json.dumps(spec)], capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_cp_prefill_state_and_logits_equal_one_rank(case, tmp_path):
    arch, nproc, pieces, kernels, tol = CASES[case]
    ranks = _run({"arch": arch, "pieces": pieces, "kernels": kernels}, nproc, tmp_path)
    assert len(ranks) == nproc
    for r in ranks:
        assert r["kinds"] > 10 and r["state_abs"] > 0.1 and r["logits_abs"] > 0.1     # a real state was compared
        assert r["state"] <= tol, r
        assert r["logits"] <= tol, r
        assert r["decode"] <= tol, r
