"""The shared-prefix benchmark workloads (harness/workload.py, harness/prefix_fields.py): agent traffic (one shared
head, a varying tail), multi-turn chat (each turn resends the conversation), the ideal hit a perfect block cache
reaches, and sweep rows with the engine's hits beside it, the cache on and off."""

from __future__ import annotations

import json

from deepinfer.harness.prefix_fields import ideal_hits
from deepinfer.harness.sweep import run_sweep
from deepinfer.harness.sweep_config import parse_sweep
from deepinfer.harness.workload import random_workload


def test_ideal_hits_are_whole_blocks_an_earlier_sequence_began_with():
    a = list(range(10, 30))                         # 20 tokens: blocks of 4 -> 5 blocks
    b = a[:9] + [99] * 6                            # parts inside block 2: 2 whole blocks shared
    c = a + [1, 2]                                  # all of a's 5 blocks; the last position is always computed
    d = list(a[:8])                                 # 8 tokens: 1 block at most (one position left to compute)
    assert ideal_hits([a, b, c, d], [a, b, c, d], 4) == [0, 8, 20, 4]
    x = a + [7, 7, 7, 7, 5]
    assert ideal_hits([a, x], [a, x], 4) == [0, 20] and ideal_hits([x, a], [x, a], 4) == [0, 16]
    assert ideal_hits([a + [7, 7, 7, 7], x], [a, x], 4) == [0, 24]      # what a left cached: prompt and output


def test_shared_heads_are_one_per_point():
    w = random_workload(6, 40, 4, 0.8, 500, seed=3, shared=0.5, prefix_seed=3)
    warm = random_workload(2, 40, 4, 0.8, 500, seed=3 + 7919, shared=0.5, prefix_seed=3)
    head = w.prompts[0][:20]
    assert all(p[:20] == head for p in w.prompts + warm.prompts)
    assert len({tuple(p[20:]) for p in w.prompts}) == 6 and all(32 <= len(p) <= 40 for p in w.prompts)


def _rows(tmp_path, cache: bool) -> dict[str, dict]:
    cfg = parse_sweep({"name": f"pc-{cache}", "model": "tiny", "device": "cpu", "mode": "prefill",
                       "engine_args": {"max_num_seqs": 4, "max_num_batched_tokens": 256, "max_model_len": 512,
                                       "block_size": 16, "enable_prefix_caching": cache},
                       "scenarios": [{"isl": 160, "osl": 4, "shared": 0.8}, {"isl": 96, "osl": 4, "turns": 3}],
                       "range_ratio": 1.0, "concurrency": [1], "num_prompts_per_concurrency": 5, "warmup": 1})
    run = run_sweep(cfg, tmp_path, f"r{cache}", progress=False)
    return {r["key"]: r for r in map(json.loads, (run / "rows.jsonl").read_text().splitlines())}


def test_sweep_rows_hit_the_ideal_and_compute_less(tmp_path):
    on, off = _rows(tmp_path, True), _rows(tmp_path, False)
    agent, chat = "prefill/isl160-osl4-shared80/c1", "prefill/isl96-osl4-turns3/c1"
    for key in (agent, chat):
        r, r0 = on[key], off[key]
        assert r["status"] == "ok" and r["prefix_caching"] and not r0["prefix_caching"]
        assert r["prefix_ideal_rate"] == r0["prefix_ideal_rate"] > 0.3
        assert r["prefix_hit_rate"] == r["prefix_ideal_rate"]              # a cache that holds the working set
        assert r["prefix_hit_tokens"] == r["prefix_ideal_tokens"]
        assert r0["prefix_queried_tokens"] is None and r0["prefix_hit_rate"] is None
        assert r["prefill_tokens_computed"] < r0["prefill_tokens_computed"] == r["prefix_queried_tokens"]
    assert on[agent]["shared_prefix"] == 0.8 and on[chat]["turns"] == 3 and on[chat]["num_prompts"] == 5
    assert on[agent]["prefix_replay_tokens"] == on[chat]["prefix_replay_tokens"] > 0
