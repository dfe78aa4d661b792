"""Context-parallel prefill (parallel/context_parallel.py) on torch.distributed (gloo, CPU), 2 and 4 processes under
torchrun: a prompt prefilled token-interleaved over the ranks leaves every rank the state a one-rank prefill leaves
(every ring and entry pool), the same last-position logits, and a decode step from that state gives the same
logits. fp32 tiny models; prompts of lengths that C does not divide, past the sliding window and over several
compression windows of every ratio, in two pieces (the second reads the first's state from the pools)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .helpers import run_worker

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
    r, got = run_worker(WORKER, spec, tmp_path, nproc, TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    return got


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


# ---- the engine option: LLM(data_parallel_size=N, prefill_context_parallel_size=C) ----
GENERATE_WORKER = ROOT / "tests" / "distributed" / "generate_worker.py"
# 41, 57, 30 and 64 tokens are prefilled over the group (more than 20), 9 and 5 on their owner alone
PROMPTS = [[(7 * i + 3 * j) % 400 + 5 for j in range(n)] for i, n in enumerate([41, 9, 57, 30, 5, 64])]
ENGINE_CASES = {"v4-dp2-cp2": ("random:deepseek_v4:tiny:4", 2, 2), "v41-dp2-cp2": ("random:deepseek_v41:tiny:10", 2, 2)}


def _generate(spec: dict, nproc: int | None, tmp_path: Path) -> dict:
    r, got = run_worker(GENERATE_WORKER, spec, tmp_path, nproc, TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    return got


@pytest.mark.parametrize("case", sorted(ENGINE_CASES))
def test_cp_generate_equals_one_rank(case, tmp_path):
    model, nproc, c = ENGINE_CASES[case]
    spec = {"model": model, "prompts": PROMPTS, "max_tokens": 6, "max_num_seqs": 3, "kernel_backend": "invariant"}
    want = _generate(spec, None, tmp_path)
    got = _generate({**spec, "data_parallel_size": nproc, "prefill_context_parallel_size": c,
                     "context_parallel_min_tokens": 20}, nproc, tmp_path)
    assert got["context_parallel_prefills"] == 4 and want["context_parallel_prefills"] == 0
    assert [g["ids"] for g in got["rows"]] == [w["ids"] for w in want["rows"]]
    assert [g["logprobs"] for g in got["rows"]] == [w["logprobs"] for w in want["rows"]]     # bitwise, invariant


@pytest.mark.parametrize("kw, match", [
    ({"data_parallel_size": 4, "prefill_context_parallel_size": 3}, "prefill_context_parallel_size=3 must divide "
                                                                      "data_parallel_size=4"),
    ({"prefill_context_parallel_size": 2}, "prefill_context_parallel_size=2 must divide data_parallel_size=1"),
    ({"data_parallel_size": 2, "prefill_context_parallel_size": 0}, "prefill_context_parallel_size=0 must be"),
    ({"data_parallel_size": 2, "prefill_context_parallel_size": 2, "enable_expert_parallel": True},
     "prefill_context_parallel_size with enable_expert_parallel=True is not validated"),
    ({"data_parallel_size": 2, "prefill_context_parallel_size": 2, "speculative": True},
     "speculative with prefill_context_parallel_size is not validated"),
    ({"data_parallel_size": 2, "context_parallel_min_tokens": 64}, "context_parallel_min_tokens chooses"),
    ({"data_parallel_size": 2, "prefill_context_parallel_size": 2, "context_parallel_min_tokens": 0},
     "context_parallel_min_tokens=0 must be"),
])
def test_cp_settings_are_refused_in_one_line(kw, match):
    """The checks run before any rank joins (parallel_config), so one process sees them."""
    from deepinfer.errors import DeepInferError
    from deepinfer.llm import ENGINE_DEFAULTS
    from deepinfer.parallel.ranks import parallel_config
    with pytest.raises(DeepInferError, match=match) as e:
        parallel_config({**ENGINE_DEFAULTS, **kw}, set(kw))
    assert "\n" not in str(e.value)
