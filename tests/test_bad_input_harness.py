"""The error contract over `deepinfer-bench` and `deepinfer-eval` (docs/errors.md), table-driven: each bad input
exits 2 with one `error:` line that says what is wrong, and writes nothing under the report directory (no run
folder, no rows, no index). Cases by issue-13 item: 1 torn vs corrupt rows, 2 run folders only after the checks
(and gone again when a run fails before its first row), 3 a named corrupt run, 5 cuda without a GPU, 6 blank
eval options. Tiny models, CPU, tmp_path report dirs only."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from deepinfer.errors import DeepInferError
from deepinfer.harness import sweep as sweep_mod
from deepinfer.harness.cli import cli as bench_cli
from deepinfer.harness.rows import CorruptRowError, RowStore, read_rows
from deepinfer.harness.sweep_config import parse_sweep
from tests.bad_input import refuse_api, refuse_cli

try:
    import lm_eval  # noqa: F401  imported up front: its loggers bind to the real stderr, not the runner's

    from deepinfer.evals.cli import cli as eval_cli
except ImportError:            # pragma: no cover  lm-eval is a base dependency
    eval_cli = None

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
NEEDS_EVAL = pytest.mark.skipif(eval_cli is None, reason="lm-eval is not installed")
MICRO = {"name": "micro", "model": "tiny", "device": "cpu",
         "engine_args": {"max_num_seqs": 2, "max_num_batched_tokens": 128, "max_model_len": 64},
         "scenarios": [{"isl": 16, "osl": 4}], "concurrency": [1], "mode": "decode"}
CORRUPT = '{"key": "a", "status": "ok"}\nnot json\n'          # a complete bad line, last line included


@pytest.fixture
def rep(tmp_path):
    """(report dir, a sweep file outside it); the report dir does not exist yet."""
    sweep_file = tmp_path / "micro.yaml"
    sweep_file.write_text(json.dumps(MICRO))
    return tmp_path / "rep", sweep_file


def stored_run(root, run_id: str, rows: str, sweep: dict | None = None):
    """A run folder under root/1/ holding `rows` (and the sweep.yaml of `sweep`)."""
    run = root / "1" / run_id
    run.mkdir(parents=True)
    (run / "rows.jsonl").write_text(rows)
    if sweep is not None:
        (run / "sweep.yaml").write_text(yaml.safe_dump(parse_sweep(sweep).to_dict(), sort_keys=False))
    return run


# ---- item 1: a complete line that is not a JSON row is corruption, wherever it is; the writer keeps it ----
@pytest.mark.parametrize("rows", [CORRUPT, '{"key": "a", "status": "ok"}\n[1]\n', 'not json\n{"key": "a", '
                                  '"status": "ok"}\n{"key": "b", "sta'], ids=["last-line", "not-an-object", "middle"])
def test_corrupt_rows_api(rows, tmp_path):
    (tmp_path / "rows.jsonl").write_text(rows)
    for call in (lambda: RowStore(tmp_path), lambda: read_rows(tmp_path)):
        refuse_api(call, CorruptRowError, r"rows.jsonl:\d: not a JSON row .*repair or remove that line",
                   watch=[tmp_path])


def test_a_torn_tail_is_not_an_error(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"key": "a", "status": "ok"}\n{"key": "b", "sta')
    assert [r["key"] for r in read_rows(tmp_path)] == ["a"]
    RowStore(tmp_path)                                  # the writer cuts the torn tail
    assert (tmp_path / "rows.jsonl").read_text() == '{"key": "a", "status": "ok"}\n'


# ---- the CLI cases: (id, command line with {rep} / {sweep}, runs to store first, message) ----
CLI_CASES = [
    # 1: resuming a run whose last complete line is corrupt stops before the model loads
    ("resume-corrupt-row", ["sweep", "{sweep}", "--run-id", "r", "--resume"], [("r", CORRUPT, MICRO)],
     r"1/r/rows.jsonl:2: not a JSON row \(invalid JSON\)"),
    # 2: nothing is made for a run refused before (or while) its model loads
    ("sweep-missing-model", ["sweep", "{sweep}", "--model", "{rep}/no-such-model"], [],
     "neither a local directory nor a hub id"),
    ("sweep-too-many-layers", ["sweep", "{sweep}", "--model", "random:deepseek_v4:tiny:99"], [],
     "outside 1..4"),
    ("sweep-run-has-rows", ["sweep", "{sweep}", "--run-id", "r"], [("r", '{"key": "a", "status": "ok"}\n', None)],
     "already has rows: pass --resume"),
    ("step-missing-model", ["step", "--model", "{rep}/no-such-model", "--iters", "1", "--warmup", "0",
                            "--batch", "1", "--context", "8"], [], "neither a local directory nor a hub id"),
    ("step-storage-not-built", ["step", "--expert-storage", "fp4", "--iters", "1", "--warmup", "0",
                                "--batch", "1", "--context", "8"], [], "expert_storage=.fp4. is not supported for deepseek_v4"),
    ("determinism-missing-model", ["determinism", "--model", "{rep}/no-such-model"], [],
     "neither a local directory nor a hub id"),
    ("checks-run-has-rows", ["batch-invariance", "--run-id", "r"], [("r", '{"key": "a", "status": "ok"}\n', None)],
     "already has rows: choose a new --run-id"),
    # 3: a corrupt row in a run the user names is an error before anything is written
    ("report-named-corrupt", ["report", "r"], [("r", CORRUPT, None), ("good", '{"key": "a", "status": "ok"}\n',
                                                                       None)], r"rows.jsonl:2: not a JSON row"),
    # blank values are never read as 'not given'
    ("sweep-blank-file", ["sweep", ""], [], "'' is empty"),
    ("step-blank-batch", ["step", "--batch", " "], [], "--batch"),
    ("dtype-not-a-name", ["determinism", "--dtype", "f32"], [], "'f32' is not one of 'bfloat16'"),
]
NO_GPU_CASES = [
    ("sweep-cuda", ["sweep", "{sweep}", "--device", "cuda"], [], "no CUDA GPU is visible"),
    ("sweep-cuda-ranks", ["sweep", "{sweep}", "--device", "cuda", "--decode-ranks", "8"], [],
     "no CUDA GPU is visible"),                         # the device line, not torchrun advice
    ("sweep-file-cuda", ["sweep", "{cuda_sweep}"], [], "no CUDA GPU is visible"),
    ("step-cuda", ["step", "--device", "cuda:1"], [], "device='cuda:1': no CUDA GPU is visible"),
    ("determinism-cuda", ["determinism", "--device", "cuda"], [], "no CUDA GPU is visible"),
    ("batch-invariance-cuda", ["batch-invariance", "--device", "cuda"], [], "no CUDA GPU is visible"),
]


def _args(args, rep_dir, sweep_file) -> list[str]:
    cuda_sweep = sweep_file.with_name("cuda.yaml")
    cuda_sweep.write_text(json.dumps({**MICRO, "device": "cuda"}))
    out = [a.format(rep=rep_dir, sweep=sweep_file, cuda_sweep=cuda_sweep) for a in args]
    if out[0] == "report":
        return out + ["--report-dir", str(rep_dir)]
    return out + (["--out", str(rep_dir / "1" / "step")] if out[0] == "step" else ["--report-dir", str(rep_dir)])


def _refuse(args, runs, match, rep, tmp_path):
    rep_dir, sweep_file = rep
    for run_id, rows, sweep in runs:
        stored_run(rep_dir, run_id, rows, sweep)
    refuse_cli(bench_cli, _args(args, rep_dir, sweep_file), match, watch=[tmp_path])


@pytest.mark.parametrize("args, runs, match", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_bench_refuses(args, runs, match, rep, tmp_path):
    _refuse(args, runs, match, rep, tmp_path)


@NO_GPU
@pytest.mark.parametrize("args, runs, match", [c[1:] for c in NO_GPU_CASES], ids=[c[0] for c in NO_GPU_CASES])
def test_bench_cuda_without_a_gpu(args, runs, match, rep, tmp_path):
    _refuse(args, runs, match, rep, tmp_path)


def test_a_run_that_fails_before_its_first_row_leaves_no_folder(rep, tmp_path, monkeypatch):
    """2: the folder is made once the engine is built; a failure after that but before any row removes it."""
    def no_env():
        raise DeepInferError("cannot read the environment")
    monkeypatch.setattr(sweep_mod, "environment", no_env)
    _refuse(["sweep", "{sweep}", "--run-id", "r"], [], "cannot read the environment", rep, tmp_path)
    assert not rep[0].exists()


@pytest.mark.parametrize("cli_name, args", [
    ("bench", ["sweep", "{sweep}", "--report-dir", "{blocker}"]),
    ("bench", ["step", "--out", "{blocker}/run"]),
    ("bench", ["determinism", "--report-dir", "{blocker}"]),
    ("eval", ["run", "--tasks", "deepinfer_text", "--out", "{blocker}/eval"]),
], ids=["sweep", "step", "determinism", "eval"])
def test_an_unwritable_report_dir_is_refused_before_the_model_loads(cli_name, args, rep, tmp_path):
    """2: checked before anything loads (and before any folder is made): a report dir under a file."""
    if cli_name == "eval" and eval_cli is None:
        pytest.skip("lm-eval is not installed")
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    refuse_cli(bench_cli if cli_name == "bench" else eval_cli,
               [a.format(sweep=rep[1], blocker=blocker) for a in args],
               f"cannot write the run directory .*{blocker.name} is not a directory", watch=[tmp_path])


def test_an_unreadable_other_run_is_no_error(rep, tmp_path):
    """3: `report good` with a corrupt run beside it: the index lists that one as unreadable, exit 0."""
    from click.testing import CliRunner
    rep_dir, _ = rep
    stored_run(rep_dir, "bad", CORRUPT)
    stored_run(rep_dir, "good", '{"key": "a", "status": "ok"}\n')
    res = CliRunner().invoke(bench_cli, ["report", "good", "--report-dir", str(rep_dir), "--no-png"])
    assert res.exit_code == 0, res.output
    assert "| bad (unreadable: rows.jsonl:2 is not a JSON row) |" in (rep_dir / "index.md").read_text()


# ---- files that decide a run before it starts (the independent probe's finds) ----
SUITE = {"name": "u", "model": "tiny", "tasks": ["deepinfer_text"], "limit": 2}
FILE_CASES = [
    ("sweep-duplicate-key", "sweep", "name: micro\nmodel: tiny\nmodel: tiny\n", "key 'model' is given twice"),
    ("sweep-concurrency-too-big", "sweep", json.dumps({**MICRO, "concurrency": [1, 4]}),
     "concurrency 4 needs 4 sequences per replica"),
    ("sweep-fp4-on-v4", "sweep", json.dumps({**MICRO, "model": "random:deepseek_v4:tiny:2",
                                             "engine_args": {**MICRO["engine_args"], "expert_storage": "fp4"}}),
     "expert_storage='fp4' is not supported for deepseek_v4"),
    ("sweep-blank-name", "sweep", json.dumps({**MICRO, "name": " "}), "name: must be a non-empty string, got ' '"),
    ("suite-min-above-max", "eval", json.dumps({**SUITE, "thresholds": {"deepinfer_text": {
        "bits_per_byte": {"min": 9, "max": 1}}}}), "min 9 > max 1"),
    ("suite-impossible-agreement", "eval", json.dumps({**SUITE, "agreement": {"min": 2}}), "holds for no value"),
    ("suite-duplicate-concurrency", "eval", json.dumps({**SUITE, "concurrency": ["max", "max"]}),
     "'max' is listed twice"),
    ("suite-duplicate-key", "eval", "name: u\nlimit: 2\nlimit: 3\n", "key 'limit' is given twice"),
]


@pytest.mark.parametrize("kind, text, match", [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES])
def test_bad_run_files_are_refused_before_any_work(kind, text, match, tmp_path):
    if kind == "eval" and eval_cli is None:
        pytest.skip("lm-eval is not installed")
    path = tmp_path / "f.yaml"
    path.write_text(text)
    out = tmp_path / "rep"
    args = ["sweep", str(path), "--report-dir", str(out)] if kind == "sweep" else \
        ["run", "--quiet", "--suite", str(path), "--out", str(out / "eval")]
    refuse_cli(bench_cli if kind == "sweep" else eval_cli, args, match, watch=[tmp_path])


def test_report_names_and_all_contradict(rep, tmp_path):
    rep_dir, _ = rep
    stored_run(rep_dir, "good", '{"key": "a", "status": "ok"}\n')
    refuse_cli(bench_cli, ["report", "good", "--all", "--report-dir", str(rep_dir)], "not both", watch=[tmp_path])


# ---- deepinfer-eval (items 2, 5, 6) ----
EVAL_CASES = [
    ("tasks-empty", ["--tasks", ""], "'--tasks': '' is empty"),
    ("tasks-blank-list", ["--tasks", " , "], "'--tasks': ' , ' has an empty entry"),
    ("tasks-empty-entry", ["--tasks", "deepinfer_text,,deepinfer_arith"], "has an empty entry"),
    ("suite-empty", ["--suite", ""], "'--suite': '' is empty"),
    ("concurrency-empty", ["--concurrency", ""], "'--concurrency': '' is empty"),
    ("concurrency-empty-entry", ["--concurrency", "4,"], "'--concurrency': '4,' has an empty entry"),
    ("model-empty", ["--model", ""], "'--model': '' is empty"),
    ("model-blank", ["--model", "  "], "'--model': ' +' is empty"),
    ("run-id-empty", ["--run-id", ""], "'--run-id': '' is empty"),
    ("dtype-not-a-name", ["--dtype", "f32"], "'f32' is not one of 'bfloat16'"),
    ("missing-model", ["--tasks", "deepinfer_text", "--model", "{rep}/no-such-model"],
     "neither a local directory nor a hub id"),
]


@NEEDS_EVAL
@pytest.mark.parametrize("args, match", [c[1:] for c in EVAL_CASES], ids=[c[0] for c in EVAL_CASES])
def test_eval_refuses(args, match, tmp_path):
    out = tmp_path / "rep" / "eval"
    refuse_cli(eval_cli, ["run", "--quiet", *[a.format(rep=tmp_path) for a in args], "--out", str(out)], match,
               watch=[tmp_path], env={"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})


@NO_GPU
@NEEDS_EVAL
def test_eval_cuda_without_a_gpu(tmp_path):
    refuse_cli(eval_cli, ["run", "--quiet", "--device", "cuda", "--out", str(tmp_path / "rep" / "eval")],
               "no CUDA GPU is visible", watch=[tmp_path])


# ---- item 7: every command says how it is used ----
@pytest.mark.parametrize("group, prog", [(bench_cli, "deepinfer-bench"), (eval_cli, "deepinfer-eval")],
                         ids=["bench", "eval"])
def test_every_command_has_an_example(group, prog):
    if group is None:
        pytest.skip("lm-eval is not installed")
    for name, command in group.commands.items():
        assert command.epilog and f"{prog} {name}" in command.epilog, name
        dtype = next((p for p in command.params if p.name == "dtype"), None)
        assert dtype is None or list(dtype.type.choices) == ["bfloat16", "bf16", "float16", "fp16", "float32",
                                                             "fp32", "float64"], name
        device = next((p for p in command.params if p.name == "device"), None)
        assert device is None or "cuda:N" in device.help, name
