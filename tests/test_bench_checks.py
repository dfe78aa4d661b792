"""deepinfer-bench determinism / batch-invariance on the tiny CPU model: one output per prompt and bitwise equal
needle logprobs in batch-invariant mode; with the mode off the needle's logprobs move (the check can fail)."""

import torch
from click.testing import CliRunner

from deepinfer import LLM
from deepinfer.checkpoint.make import embedded_tiny_dir
from deepinfer.harness.checks import first_divergence, run_checks
from deepinfer.harness.cli import cli
from deepinfer.harness.rows import RowStore
from deepinfer.harness.workload import random_workload


def test_first_divergence():
    assert first_divergence([[1, 2, 3], [1, 2, 3]]) is None
    assert first_divergence([[1, 2, 3], [1, 5, 3], [1, 2, 4]]) == 1
    assert first_divergence([[1, 2, 3], [1, 2]]) == 2


def test_checks_in_both_modes(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)                    # small tiled calls: spinning OpenMP threads only slow them
    try:
        _both_modes(tmp_path)
    finally:
        torch.set_num_threads(before)


def _both_modes(tmp_path):
    llm = LLM(embedded_tiny_dir("deepseek_v41"), max_model_len=96, max_num_seqs=32)
    prompts = random_workload(3, 24, 1, 0.5, llm.model.cfg.vocab_size, seed=0).prompts
    det = run_checks(llm, "determinism", [True], tmp_path / "d", prompts, runs=4, trials=0, max_tokens=6, seed=0)
    assert {r["sampling"] for r in det} == {"greedy", "seeded"}
    assert all(r["unique"] == [1, 1, 1] and r["first_divergence"] == [None] * 3 for r in det)
    inv = run_checks(llm, "batch-invariance", [False, True], tmp_path / "b", prompts, runs=0, trials=3,
                     max_tokens=6, seed=0)
    on = [r for r in inv if r["batch_invariant"]]
    off = [r for r in inv if not r["batch_invariant"]]
    assert all(r["token_mismatches"] == 0 and r["logprob_mismatches"] == 0 for r in on)
    assert any(r["logprob_mismatches"] > 0 for r in off)       # measured on this CPU: batching moves the bits
    assert len(RowStore(tmp_path / "b").rows()) == 4 and not llm.batch_invariant


def test_check_cli(tmp_path):
    res = CliRunner().invoke(cli, ["batch-invariance", "--trials", "2", "--max-tokens", "4", "--prompt-len", "12",
                                   "--mode", "on", "--report-dir", str(tmp_path), "--run-id", "bi"])
    assert res.exit_code == 0, res.output
    assert "batch-invariant greedy  0/2 batches change the tokens, 0/2 change the logprobs" in res.output
    res = CliRunner().invoke(cli, ["report", "--all", "--report-dir", str(tmp_path), "--no-png"])
    assert res.exit_code == 0 and "no sweep points" in res.output
