"""deepinfer-bench step: roofline arithmetic on hand-computed cases, what a step touches on the tiny model, row
contents, the CLI end to end on the tiny CPU model, resume, and one-line errors for bad input."""

import json
import math

import pytest
import torch
from click.testing import CliRunner

from deepinfer.errors import DeepInferError
from deepinfer.harness import step_bench
from deepinfer.harness.ceilings import measure_ceilings, roofline
from deepinfer.harness.cli import cli
from deepinfer.harness.options import parse_int_list
from deepinfer.harness.step_bench import StepConfig, StepPoint
from deepinfer.harness.step_roofline import Routing, attention_flops, inventory, routing_from_calls, step_traffic
from deepinfer.harness.step_timing import busy_union, idle_from_trace, top_kernels
from tests.helpers import assert_traffic

try:
    import deepinfer.runner.probe  # noqa: F401
    HAVE_PROBE = True
except ImportError:
    HAVE_PROBE = False


class FakeProbe:
    """Stands in for deepinfer.runner.probe.StepProbe until it lands: each run() sends B*q random rows through
    every MoE of the model (so the dispatch recorder sees real routing) and reports a fixed state size."""
    created = []

    def __init__(self, llm, batch_size, context_len, query_len=1, seed=0):
        if batch_size * max(context_len, 1) > 10_000:
            raise DeepInferError(f"the state pools cannot hold {batch_size} sequences of {context_len} positions")
        self.llm, self.n = llm, batch_size * query_len
        gen = torch.Generator().manual_seed(seed)
        cfg = llm.model.cfg
        self.x = torch.randn(self.n, cfg.hidden_size, generator=gen)
        self.ids = torch.randint(0, cfg.vocab_size, (self.n,), generator=gen)
        self.moes = [m for m in llm.model.layers.modules() if hasattr(m, "dispatch") and hasattr(m, "gate")]
        self.graphed, self.runs, self.closed = False, 0, False
        self.state_bytes_read = 1000 * batch_size
        FakeProbe.created.append(self)

    def run(self, eager=False):
        for moe in self.moes:
            moe(self.x.to(self.llm.model.dtype), self.ids)
        self.runs += 1

    def close(self):
        self.closed = True


def test_roofline_hand_computed():
    # 4.3e9 bytes at 4.3e12 B/s = 1 ms; 790e9 FLOPs at 790e12 FLOP/s = 1 ms; the larger bounds the step
    r = roofline(8.6e9, 790e9, 4.3e12, 790e12)
    assert r["roofline_memory_ms"] == pytest.approx(2.0) and r["roofline_compute_ms"] == pytest.approx(1.0)
    assert r["roofline_ms"] == pytest.approx(2.0) and r["bound"] == "memory"
    r = roofline(1e9, 1.58e12, 4.3e12, 790e12)
    assert r["roofline_ms"] == pytest.approx(2.0) and r["bound"] == "compute"


def test_attention_flops_hand_computed():
    from deepinfer.config.presets import TINY_V4
    cfg = TINY_V4     # H=4, d=96, window 16; layers: sliding, CSA (r 4, top-8), HCA (r 16), CSA; indexer 32 x 64
    p = 99            # 100 visible positions: window 16; CSA 25 entries -> top 8; HCA 6 entries, all
    keys = 16 + (16 + 8) + (16 + 6) + (16 + 8)
    attn, index = attention_flops(cfg, [p], rows_per_position=3)
    assert attn == 3 * 4 * 4 * 96 * keys
    assert index == 3 * 2 * (2 * 32 * 64 * 25)      # two CSA layers score all 25 entries


def test_intervals_and_idle():
    assert busy_union([(0, 2), (1, 3), (5, 6)]) == 4
    ev = [{"ph": "X", "cat": "kernel", "ts": 0, "dur": 2}, {"ph": "X", "cat": "kernel", "ts": 1, "dur": 2},
          {"ph": "X", "cat": "gpu_memcpy", "ts": 8, "dur": 2}, {"ph": "X", "cat": "cpu_op", "ts": 3, "dur": 4}]
    out = idle_from_trace(ev)
    assert out["busy_us"] == 5 and out["span_us"] == 10 and out["idle_fraction"] == pytest.approx(0.5)
    assert idle_from_trace([{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 1}]) is None


def test_top_kernels():
    ev = [{"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 6}, {"ph": "X", "cat": "kernel", "name": "add",
          "ts": 6, "dur": 1}, {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 9, "dur": 2},
          {"ph": "X", "cat": "cpu_op", "name": "gemm", "ts": 0, "dur": 50}, {"ph": "X", "cat": "gpu_memset",
          "name": "Memset", "ts": 12, "dur": 1}]
    top = top_kernels(ev, steps=2)
    assert [k["name"] for k in top] == ["gemm", "add", "Memset"]               # by total GPU time, cpu ops left out
    assert top[0] == {"name": "gemm", "us": 4.0, "calls": 1.0, "share": 0.8}
    assert top_kernels(ev, steps=1, top=1) == [{"name": "gemm", "us": 8.0, "calls": 2, "share": 0.8}]
    ev += [{"ph": "X", "cat": "kernel", "name": "add", "ts": 20, "dur": 1} for _ in range(2)]
    assert [k["name"] for k in top_kernels(ev, steps=1)] == ["gemm", "add", "Memset"]
    by_calls = top_kernels(ev, steps=1, by="calls")                           # the launches: add 3, gemm 2, Memset 1
    assert [(k["name"], k["calls"]) for k in by_calls] == [("add", 3), ("gemm", 2), ("Memset", 1)]
    with pytest.raises(ValueError, match="'us' or 'calls'"):
        top_kernels(ev, steps=1, by="time")


def test_parse_lists():
    assert parse_int_list("1,16, 64", "--batch") == (1, 16, 64)
    assert parse_int_list("0,1024", "--context", minimum=0) == (0, 1024)
    for bad in ("1,x", "0", "1,,2", "-3", "2,2", "²", "1,٣", "1_0"):
        with pytest.raises(DeepInferError, match="--batch"):
            parse_int_list(bad, "--batch")


def test_traffic_on_tiny_model():
    from deepinfer.api import resolve_model
    model = resolve_model("random:deepseek_v4:tiny:4", "cpu", "float32")
    inv = inventory(model)
    cfg = model.cfg
    D, I, E, V = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.vocab_size
    assert set(inv.experts) == {f"layers.{i}.ffn" for i in range(4)}          # MTP excluded
    one = inv.experts["layers.2.ffn"]
    assert (one.n_experts, one.bytes_per_expert, one.params_per_expert) == (E, 3 * I * D * 4, 3 * I * D)
    assert inv.head_params == V * D
    tables = {name: (row, rows) for name, row, rows, _ in inv.tables}
    assert tables["embed.weight"] == (D * 4, V) and tables["layers.0.ffn.gate.tid2eid"] == (2 * 8, V)
    dense = sum(t.numel() * t.element_size() for n, t in [*model.named_parameters(), *model.named_buffers()]
                if not n.startswith("mtp.") and ".experts." not in n and n != "embed.weight" and "tid2eid" not in n)
    assert inv.dense_bytes == dense
    point = StepPoint("decode", 4, 99, 1)
    ids = torch.tensor([[0, 1], [1, 2], [0, 1], [5, 1]])            # experts 0, 1, 2, 5 touched: 4; 8 pairs
    routing = routing_from_calls([("layers.2.ffn", ids), ("layers.3.ffn", ids[:1])])
    assert routing.touched == {"layers.2.ffn": 4, "layers.3.ffn": 2} and routing.pairs["layers.2.ffn"] == 8
    t = step_traffic(inv, routing, point, 12345, cfg)
    assert t["bytes"]["experts"] == 6 * 3 * I * D * 4 and t["experts_touched"] == 6 and t["experts_total"] == 4 * E
    assert t["bytes"]["dense_weights"] == dense + 4 * D * 4 + 2 * 4 * 2 * 8   # + 4 embedding rows, 4 tid2eid rows
    assert t["bytes"]["state"] == 12345
    assert t["bytes"]["total"] == t["bytes"]["dense_weights"] + t["bytes"]["experts"] + 12345
    assert t["flops"]["experts"] == 2 * 3 * I * D * 10
    assert t["flops"]["dense"] == 2 * 4 * inv.matmul_params + 2 * 4 * V * D
    assert t["flops"]["attention"] == attention_flops(cfg, [99], 4)[0]
    unknown = step_traffic(inv, Routing(recorded=False), point, 0, cfg)
    assert unknown["bytes"]["experts"] == 4 * E * 3 * I * D * 4          # unknown routing: every expert


@pytest.mark.parametrize("with_dispatcher", [True, False])
def test_routing_recorder_both_ways(with_dispatcher, monkeypatch):
    from deepinfer.api import resolve_model
    if not with_dispatcher:
        monkeypatch.setattr(step_bench, "record_routing", lambda: None)
    model = resolve_model("random:deepseek_v4:tiny:4", "cpu", "float32")
    step_bench.label_dispatchers(model)
    moe = model.layers[2].ffn
    x = torch.randn(5, model.cfg.hidden_size)
    with step_bench.routing_recorder(model) as calls:
        with torch.inference_mode():
            moe(x)
    assert [name for name, _ in calls["gate"]] == ["layers.2.ffn"] and calls["gate"][0][1].shape == (5, 2)
    if with_dispatcher and calls["dispatch"]:        # a build whose MoE dispatches: the same ids
        assert calls["dispatch"][0][0] == "layers.2.ffn"
        assert torch.equal(calls["dispatch"][0][1], calls["gate"][0][1])
    if not with_dispatcher:
        assert calls["dispatch"] == []


def test_ceilings_cpu():
    c = measure_ceilings("cpu", torch.float32)
    assert c["copy_bytes_per_s"] > 1e8 and c["gemm_flops_per_s"] > 1e8 and c["gemm_bf16_flops_per_s"] is None
    assert c["fp8_flops_per_s"] is None and "CUDA" in c["fp8_note"] and c["gemm_dtype"] == "float32"


def _check_row(r, cfg_model="random:deepseek_v4:tiny:4"):
    assert r["status"] == "ok" and r["schema_version"] == "1" and r["method_version"] == "1"
    assert r["bench"] == "step" and r["mode"] == "step" and r["model"] == cfg_model
    assert r["model_type"] == "deepseek_v4" and r["layers"] == 4 and r["config_hash"]
    assert r["precision"] == "float32" and r["expert_storage"] == "dense" and r["kernel_backend"] == "reference"
    assert r["git_sha"] and r["hardware_info"]["cpu_count"] >= 1 and r["graphed"] is False
    assert r["gpu_idle_fraction"] is None and r["gpu_ops_per_step"] is None and r["iters"] == 2
    assert len(r["step_ms_samples"]) == 2 and r["step_ms_median"] > 0 and r["step_ms_p90"] >= r["step_ms_median"]
    b = r["bytes"]
    assert b["total"] == b["dense_weights"] + b["experts"] + b["state"] and b["experts"] > 0
    assert r["flops"]["total"] == sum(v for k, v in r["flops"].items() if k != "total")
    c = r["ceilings"]
    mem_ms = 1e3 * b["total"] / c["copy_bytes_per_s"]
    comp_ms = 1e3 * r["flops"]["total"] / c["gemm_flops_per_s"]
    assert r["roofline_ms"] == pytest.approx(max(mem_ms, comp_ms))
    assert r["ratio"] == pytest.approx(r["step_ms_median"] / r["roofline_ms"])
    assert 0 < r["experts_touched"] <= r["experts_total"] == 32 and r["routing_recorded"] is True
    assert r["routing_source"] in ("dispatch", "gate")


def test_cli_end_to_end(tmp_path, monkeypatch):
    if not HAVE_PROBE:
        FakeProbe.created.clear()
        monkeypatch.setattr(step_bench, "default_probe_factory", lambda: FakeProbe)
    out = tmp_path / "run"
    common = ["step", "--iters", "2", "--warmup", "0", "--out", str(out)]
    res = CliRunner().invoke(cli, [*common, "--batch", "1,2", "--context", "16"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["key"] for r in rows] == ["decode-b1-c16-q1", "decode-b2-c16-q1"]
    for r in rows:
        _check_row(r)
        assert r["tokens"] == r["batch"] and r["routing_rows"] == r["batch"] and r["bytes"]["state"] > 0
        assert sum(r["experts_touched_per_layer"].values()) == r["experts_touched"]
        if HAVE_PROBE:
            assert_traffic(r)
        assert len(r["experts_touched_per_layer"]) == 4 and r["routing_outside_step_layers"] == []
        # each layer routes batch rows x top-2: at least 2, at most 2 x batch distinct experts
        assert all(2 <= n <= 2 * r["batch"] for n in r["experts_touched_per_layer"].values())
    if not HAVE_PROBE:
        assert all(p.closed and p.runs == 1 + 2 for p in FakeProbe.created)    # eager + timed
        assert rows[1]["bytes"]["state"] == 2000
    assert "decode-b2-c16-q1" in res.output and "roofline" in res.output
    assert (out / "step.json").exists() and (out / "env.json").exists()
    # resume with another context: only the new point runs
    res = CliRunner().invoke(cli, [*common, "--batch", "1", "--context", "16,32", "--resume"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [r["key"] for r in rows][2:] == ["decode-b1-c32-q1"]
    res = CliRunner().invoke(cli, ["step", "--iters", "4", "--out", str(out), "--resume"])
    assert res.exit_code != 0 and "iters" in str(res.exception)


FIXED_CEILINGS = {"copy_bytes_per_s": 1e10, "gemm_flops_per_s": 1e11, "gemm_bf16_flops_per_s": None,
                  "fp8_flops_per_s": None}


def test_failure_rows_and_continue(tmp_path, monkeypatch):
    monkeypatch.setattr(step_bench, "default_probe_factory", lambda: FakeProbe)
    monkeypatch.setattr(step_bench, "measure_ceilings", lambda device, dtype: FIXED_CEILINGS)
    cfg = StepConfig(batches=(1, 400), contexts=(64,), iters=2, warmup=0)
    with pytest.raises(DeepInferError, match="point decode-b400-c64-q1 failed .*cannot hold"):
        step_bench.run_step_bench(cfg, out=tmp_path / "a")
    rows = [json.loads(line) for line in (tmp_path / "a" / "rows.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "failed"] and "cannot hold" in rows[1]["error"]
    cfg = StepConfig(batches=(400, 1), contexts=(64,), iters=2, warmup=0)
    _, rows = step_bench.run_step_bench(cfg, out=tmp_path / "b", continue_on_error=True)
    assert [r["status"] for r in rows] == ["failed", "ok"]


@pytest.mark.parametrize("args, message", [
    (["--batch", "1,x"], "--batch '1,x'"),
    (["--context", "1k"], "--context '1k'"),
    (["--model", "random:deepseek_v9:tiny:4"], "deepseek_v9"),
    (["--model", "random:deepseek_v4:tiny"], "random:ARCH:PRESET:LAYERS"),
    (["--iters", "0"], "--iters must be at least 1"),
    (["--query-len", "²"], "--query-len '²'"),
    (["--expert-storage", "fp4"], "dense"),
])
def test_bad_input_is_one_line(args, message, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(step_bench, "default_probe_factory", lambda: FakeProbe)
    monkeypatch.setattr(step_bench, "measure_ceilings", lambda device, dtype: FIXED_CEILINGS)
    from deepinfer.harness.cli import main
    monkeypatch.setattr("sys.argv", ["deepinfer-bench", "step", "--out", str(tmp_path / "r"), *args])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "r" / "rows.jsonl").exists()


def test_no_probe_is_one_line(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_probe(name, *a, **k):
        if name == "deepinfer.runner.probe":
            raise ImportError("no module")
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_probe)
    with pytest.raises(DeepInferError, match="needs deepinfer.runner.probe.StepProbe"):
        step_bench.default_probe_factory()


def test_engine_args_cover_largest_point():
    cfg = StepConfig(batches=(1, 256), contexts=(1024, 8192), prefill=(8192,))
    args = cfg.engine_args()
    assert args["max_num_seqs"] == 256 and args["max_model_len"] == 8192 + 1
    assert args["max_num_batched_tokens"] == 8192 and not math.isnan(args["max_num_seqs"])
    assert [p.key for p in cfg.points()][-1] == "prefill-t8192" and len(cfg.points()) == 5


def test_expert_act_quant_options(tmp_path):
    """--expert-act-quant: refused without FP4 experts, and on a model whose widths are not multiples of 128 (one
    line each); passed to the engine; older runs' identity unchanged."""
    from tests.bad_input import refuse_cli
    refuse_cli(cli, ["step", "--expert-act-quant", "--out", str(tmp_path / "a")], r"--expert-storage fp4",
               watch=[tmp_path])
    refuse_cli(cli, ["step", "--model", "random:deepseek_v41:tiny:2", "--expert-storage", "fp4", "--expert-act-quant",
                     "--out", str(tmp_path / "b")], r"multiples of 128", watch=[tmp_path])
    cfg = StepConfig(model="random:deepseek_v41:tiny:2", expert_storage="fp4", expert_act_quant=True,
                     batches=(1,), contexts=(8,), iters=1, warmup=0, trace_steps=1)
    assert cfg.engine_args()["expert_act_quant"] is True
    assert "expert_act_quant" not in StepConfig().identity()          # older runs resume unchanged
