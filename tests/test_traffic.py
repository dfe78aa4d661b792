"""Expert traffic: the engine's device counters (LLM(expert_traffic=True)) against the routing the forwards really
did, the row fields every bench writes, and the one warning line for unbalanced routing."""

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.make import preset_model_config
from deepinfer.harness.rows import RowStore
from deepinfer.harness.traffic import layer_summary, noise_bound, traffic_summary, traffic_warning
from deepinfer.models import build_model
from deepinfer.checkpoint.random_init import init_random_weights
from deepinfer.parallel.dispatch import label_dispatchers, record_routing
from deepinfer.parallel.traffic import uniform_touched


def test_engine_counters_equal_the_recorded_routing():
    llm = LLM("tiny", enforce_eager=True, async_scheduling=False, expert_traffic=True)
    label_dispatchers(llm.model)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(20 + i)] for i in range(6)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)   # then reset
    llm.engine.reset_stats()
    with record_routing() as rec:
        llm.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    counted = llm.stats.expert_traffic
    experts = {n: v["experts"] for n, v in counted.items()}
    recorded = layer_summary(rec.calls, experts)
    assert set(counted) == set(recorded) and counted
    for name, v in counted.items():
        r = recorded[name]
        assert (v["forwards"], v["rows"]) == (r["forwards"], r["rows"]), name
        assert v["touched_per_forward"] == r["touched_per_forward"], name
        assert abs(v["uniform_per_forward"] - r["uniform_per_forward"]) < 1e-9, name
        assert v["load_max_over_mean"] == r["load_max_over_mean"], name
    llm.engine.reset_stats()
    assert llm.stats.expert_traffic == {}


def test_uniform_routing_is_balanced_and_concentrated_routing_warns():
    gen = torch.Generator().manual_seed(0)
    for rows, forwards in ((1, 50), (16, 20), (64, 20), (256, 20), (4096, 4)):
        calls = [("layers.0.ffn", torch.rand(rows, 384, generator=gen).topk(6).indices) for _ in range(forwards)]
        t = traffic_summary(layer_summary(calls, {"layers.0.ffn": 384}))
        assert t["balanced"] and abs(t["touched_vs_uniform"] - 1) < 0.1, rows
        assert traffic_warning({"key": "x", "expert_traffic": t}) is None
    hot = torch.rand(64, 384, generator=gen)
    hot[:, :24] += 10                                              # every token among the same 24 experts
    t = traffic_summary(layer_summary([("layers.0.ffn", hot.topk(6).indices)] * 8, {"layers.0.ffn": 384}))
    assert not t["balanced"] and t["touched_vs_uniform"] < 0.2
    line = traffic_warning({"key": "decode/c64", "expert_traffic": t})
    assert line.startswith("warning: decode/c64: routing far from balanced") and "\n" not in line
    assert uniform_touched(384, 6, 64) == 384 * (1 - (1 - 6 / 384) ** 64)
    assert noise_bound(1e4) < 1.1 < noise_bound(64) < 2


def test_rows_of_an_unbalanced_model_say_so(tmp_path, capsys):
    """The drawn (uncalibrated) routers of a tiny model: the row carries the fields, RowStore prints one line."""
    cfg, tok = preset_model_config("deepseek_v41", "tiny", 2)
    model = build_model(cfg, "cpu", torch.float32, True)
    init_random_weights(model, 0)
    model.bind_tokenizer(tok)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ffn.gate.bias"):
                p[:2] += 100.0                                      # two experts take every token
    model.checkpoint_dir = tmp_path / "ck"                          # a built model's tokenizer dir (unread here)
    llm = LLM(model, expert_traffic=True, skip_tokenizer_init=True)
    llm.generate([[5 + i, 9, 11 + 2 * i] for i in range(8)], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    t = traffic_summary(llm.stats.expert_traffic)
    assert not t["balanced"]
    RowStore(tmp_path / "run").append({"key": "p", "status": "ok", "expert_traffic": t})
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: p: routing far from balanced")


def test_report_shows_the_traffic(tmp_path):
    """`deepinfer-bench report`: summary.csv's traffic columns, the index's routing verdict per run, and a named
    step run's table with its traffic cell."""
    from click.testing import CliRunner

    from deepinfer.harness.cli import cli
    balanced = {"touched_per_step": 990.0, "uniform_per_step": 975.0, "touched_vs_uniform": 1.0154,
                "load_max_over_mean": 1.62, "load_over_noise": 1.1, "balanced": True}
    hot = {**balanced, "touched_per_step": 214.0, "touched_vs_uniform": 0.2195, "balanced": False}
    point = {"status": "ok", "mode": "decode", "isl": 8, "osl": 4, "concurrency": 1, "median_intvty": 10.0,
             "output_tput_per_gpu": 10.0, "hardware": "cpu", "engine": "deepinfer", "spec_mode": "off",
             "is_projected": False, "gpus": 1}
    for run, traffics in (("mixed", (balanced, hot)), ("even", (balanced,)), ("old", (None,))):
        store = RowStore(tmp_path / "1" / run)
        for i, t in enumerate(traffics):
            store.append({**point, "key": f"decode/c{i}", "concurrency": i + 1, "expert_traffic": t})
    step = {"key": "decode-b64-c1024-q1", "bench": "step", "status": "ok", "graphed": True, "step_ms_median": 12.5,
            "step_ms_p90": 12.9, "roofline_ms": 5.0, "bound": "memory", "ratio": 2.5, "experts_touched": 990,
            "experts_total": 1536, "bytes": {"total": 2e10}, "gpu_idle_fraction": None, "expert_traffic": balanced}
    RowStore(tmp_path / "1" / "steps").append(step)
    res = CliRunner().invoke(cli, ["report", "--all", "--report-dir", str(tmp_path), "--no-png"])
    assert res.exit_code == 0, res.output
    index = (tmp_path / "index.md").read_text()
    assert "| mixed | 1 | 2 / 0 | 1 of 2 rows unbalanced |" in index and "| even | 1 | 1 / 0 | balanced |" in index
    assert "| old | 1 | 1 / 0 | not recorded |" in index and "| steps | 1 | 1 / 0 | balanced |" in index
    import pandas as pd
    frame = pd.read_csv(tmp_path / "1" / "mixed" / "summary.csv")
    assert list(frame.columns[-4:]) == ["experts_touched_per_step", "experts_uniform_per_step", "load_max_over_mean",
                                       "routing_balanced"]
    assert list(frame["experts_touched_per_step"]) == [990.0, 214.0] and list(frame["routing_balanced"]) == [True, False]
    res = CliRunner().invoke(cli, ["report", "steps", "--report-dir", str(tmp_path), "--no-png"])
    assert res.exit_code == 0, res.output
    line = [x for x in res.output.splitlines() if "decode-b64-c1024-q1" in x]
    assert len(line) == 1 and line[0].rstrip().endswith("990/975 1.62"), res.output


def test_engines_on_one_model_share_its_counters(tmp_path):
    """The DSpark bench builds one engine per mode on one model before running any: each row must still count
    its own engine's steps (the counters are the model's; each engine zeroes them at reset_stats)."""
    cfg, tok = preset_model_config("deepseek_v41", "tiny", 2)
    model = build_model(cfg, "cpu", torch.float32, True)
    init_random_weights(model, 0)
    model.bind_tokenizer(tok)
    model.checkpoint_dir = tmp_path / "ck"
    first = LLM(model, expert_traffic=True, skip_tokenizer_init=True, enforce_eager=True)
    second = LLM(model, expert_traffic=True, skip_tokenizer_init=True, enforce_eager=True)
    assert first.engine.traffic is second.engine.traffic
    prompts = [[5 + i, 9, 11 + 2 * i] for i in range(4)]
    counted = []
    for llm in (first, second):
        llm.engine.reset_stats()
        llm.generate(prompts, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        counted.append(llm.stats.expert_traffic)
        assert traffic_summary(counted[-1])["touched_per_step"] > 0
    # the same greedy work on one model: each row counts its own run exactly once (reset in place, no carry-over)
    assert counted[0] == counted[1]
