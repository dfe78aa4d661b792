"""Random workloads (InferenceX lengths) and one measured point on the tiny engine at a fixed concurrency."""

import pytest

from deepinfer import LLM
from deepinfer.checkpoint.make import embedded_tiny_dir
from deepinfer.harness.workload import random_workload, run_workload


def test_random_workload_lengths_and_seed():
    w = random_workload(200, 100, 20, 0.8, vocab_size=512, seed=3)
    assert all(80 <= len(p) <= 100 for p in w.prompts) and all(16 <= k <= 20 for k in w.output_lens)
    assert all(16 <= t < 512 for p in w.prompts for t in p)
    assert {len(p) for p in w.prompts} >= {80, 100}                 # both ends are drawn
    assert random_workload(200, 100, 20, 0.8, 512, seed=3) == w and random_workload(200, 100, 20, 0.8, 512, 4) != w
    with pytest.raises(ValueError, match="range_ratio"):
        random_workload(1, 10, 10, 0.0, 512, 0)


def test_run_workload_respects_concurrency():
    llm = LLM(embedded_tiny_dir("deepseek_v41"), max_model_len=128)
    w = random_workload(6, 24, 6, 0.8, llm.model.cfg.vocab_size, seed=1)
    seats = llm.engine.scheduler.max_num_seqs
    records, duration = run_workload(llm, w, concurrency=2)
    assert duration > 0 and llm.engine.max_num_seqs == 256 and llm.engine.scheduler.max_num_seqs == seats  # restored
    assert llm.stats.max_step_rows <= 2
    for r, k in zip(records, w.output_lens):
        assert r.success and r.output_tokens == k == len(r.token_times)
        assert r.start <= r.token_times[0] and r.token_times == sorted(r.token_times)
    events = sorted([(r.start, 1) for r in records] + [(r.token_times[-1], -1) for r in records])
    live = peak = 0
    for _, d in events:
        live += d
        peak = max(peak, live)
    assert peak <= 2


def test_client_send_times():
    from deepinfer.harness.workload import client_send_times
    assert client_send_times(1.0, [5.0, 3.0, 4.0, 9.0], 2) == [1.0, 1.0, 3.0, 4.0]   # slots free at 3 s, 4 s
    assert client_send_times(1.0, [2.0, 3.0], 4) == [1.0, 1.0]


def test_engine_queueing_counts_in_ttft():
    """c x ISL above the step budget: the second request waits inside the engine, and that wait is its TTFT."""
    llm = LLM(embedded_tiny_dir("deepseek_v41"), max_model_len=128, max_num_batched_tokens=40, max_num_seqs=4)
    w = random_workload(2, 40, 2, 1.0, llm.model.cfg.vocab_size, seed=2)
    records, _ = run_workload(llm, w, concurrency=2)
    assert records[0].start == records[1].start                        # both sent at once
    assert records[1].token_times[0] > records[0].token_times[0]     # prefilled a step later, counted
