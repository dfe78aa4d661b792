"""The error contract over `deepinfer-bench` and `deepinfer-eval` (docs/errors.md), table-driven: each bad input
exits 2 with one `error:` line that says what is wrong, and writes nothing under the report directory (no run
folder, no rows, no index). Cases by issue-13 item: 1 torn vs corrupt rows, 2 run folders only after the checks
(and gone again when a run fails before its first row), 3 a named corrupt run, 5 cuda without a GPU, 6 blank
eval options; third pass: one parser for every numeric option, list repeats, each bench's options against the
model's and the engine's limits before any build (the `no_build` fixture fails a test that builds), batch-invariant
mode. Tiny models, CPU, tmp_path report dirs only."""

from __future__ import annotations

import json
import re

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
    # third pass: the bench's parser (int() took '٣' as 3; '²' passed isdigit() and int() raised a traceback)
    ("limit-not-ascii", ["--limit", "٣"], "--limit '٣': give a whole number >= 1 in ASCII digits"),
    ("num-fewshot-superscript", ["--num-fewshot", "²"], "--num-fewshot '²'"),
    ("max-num-seqs-zero", ["--max-num-seqs", "0"], "--max-num-seqs must be at least 1, got 0"),
    ("concurrency-superscript", ["--concurrency", "²"], "concurrency\\[0\\]: got '²'; allowed: max, median"),
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


# ---- third pass: one parser for every numeric option, lists without repeats, each bench's options against the
# model's and the engine's limits before anything is built, batch-invariant mode honoured or refused by name ----
@pytest.fixture
def no_build(monkeypatch):
    """Fails the test if a model, an engine or the device ceilings get built: these refusals come first."""
    import deepinfer.checkpoint.make as make
    import deepinfer.llm as llm_mod
    import deepinfer.api as api
    from deepinfer.harness import kernel_bench, step_bench

    def built(*args, **kwargs):
        raise AssertionError("built a model / engine / ceilings before refusing")
    for owner, name in ((api, "resolve_model"), (make, "embedded_tiny_dir"), (llm_mod.LLM, "__init__"),
                        (step_bench, "measure_ceilings"), (kernel_bench, "measure_ceilings")):
        monkeypatch.setattr(owner, name, built)


def _bench_args(args, tmp_path) -> list[str]:
    """The command line, writing (if it ever did) under tmp_path/rep: ops writes nothing and has no such option."""
    out = tmp_path / "rep"
    if args[0] == "ops":
        return args
    return args + (["--out", str(out / "step")] if args[0] == "step" else ["--report-dir", str(out)])


NOT_ASCII_DIGITS = ["²", "٣", "1_000", "+3", "-1", "0x10", "1e3", "३"]   # isdigit() / int() take some of them
NUMERIC_OPTIONS = [     # (command, option): every numeric option of every bench
    ("step", "--batch"), ("step", "--context"), ("step", "--prefill"), ("step", "--query-len"), ("step", "--iters"),
    ("step", "--warmup"), ("step", "--seed"), ("kernels", "--tokens"), ("kernels", "--contexts"),
    ("kernels", "--experts-limit"), ("structured", "--batch"), ("structured", "--isl"), ("structured", "--rounds"),
    ("dspark", "--concurrency"), ("dspark", "--num-speculative-tokens"), ("dspark", "--osl"), ("dspark", "--repeats"),
    ("versus", "--batch"), ("versus", "--isl"), ("ops", "--batch"), ("ops", "--top"), ("sweep", "--decode-ranks"),
    ("determinism", "--runs"), ("determinism", "--prompt-len"), ("batch-invariance", "--trials"),
]


@pytest.mark.parametrize("command, option", NUMERIC_OPTIONS, ids=[f"{c}{o}" for c, o in NUMERIC_OPTIONS])
def test_every_numeric_option_takes_ascii_digits_only(command, option, tmp_path, no_build):
    """1: one parser: '²' passes str.isdigit() (then int() raised a traceback), '٣' is 3 to int(); both are
    refused in one line naming the option and the item, as a list's item too."""
    device = ["--device", "cpu"] if command == "kernels" else []
    for bad in NOT_ASCII_DIGITS[:2]:
        refuse_cli(bench_cli, _bench_args([command, option, bad, *device], tmp_path),
                   f"^error: {option} '{bad}': .*ASCII digits", watch=[tmp_path])
    refuse_cli(bench_cli, _bench_args([command, option, f"4,{NOT_ASCII_DIGITS[0]}", *device], tmp_path),
               f"^error: {option} '4,²'", watch=[tmp_path])


@pytest.mark.parametrize("bad", NOT_ASCII_DIGITS)
def test_the_parser_takes_what_a_user_means(bad):
    from deepinfer.harness.options import parse_count, parse_int_list
    refuse_api(lambda: parse_count(bad, "--iters", 1), DeepInferError, "--iters .*ASCII digits")
    refuse_api(lambda: parse_int_list(f"1,{bad}", "--batch"), DeepInferError,
               re.escape(f"--batch '1,{bad}': give a comma-separated list of integers >= 1") + ".*" +
               re.escape(f"{bad!r} is not one"))
    assert parse_count(" 16 ", "--iters", 1) == 16
    refuse_api(lambda: parse_count("0", "--iters", 1), DeepInferError, "^--iters must be at least 1, got 0$")
    assert parse_int_list(" 1, 16 ,64", "--batch") == (1, 16, 64)


LIST_CASES = [      # 1, 2: repeats (the same point twice, one row kept), empty items, plain decimals only
    ("dspark-modes-repeat", ["dspark", "--modes", "off,off"], "--modes 'off,off' lists off twice"),
    ("dspark-modes-unknown", ["dspark", "--modes", "off,greedy"],
     "--modes 'off,greedy': choose from .*'greedy' is not one"),
    ("dspark-modes-empty-item", ["dspark", "--modes", "off,"], "--modes 'off,' has an empty item"),
    ("dspark-concurrency-repeat", ["dspark", "--concurrency", "4,4"], "--concurrency '4,4' lists 4 twice"),
    ("dspark-acceptance-not-decimal", ["dspark", "--acceptance", "٠.٥,0.3"], "--acceptance '٠.٥,0.3'"),
    ("dspark-acceptance-nan", ["dspark", "--acceptance", "nan"], "--acceptance 'nan'"),
    ("structured-schemas-repeat", ["structured", "--schemas", "json,json"], "--schemas 'json,json' lists json"),
    ("structured-batch-repeat", ["structured", "--batch", "1,4,1"], "--batch '1,4,1' lists 1 twice"),
    ("structured-fractions-repeat", ["structured", "--fractions", "0,0.5,.5"], "--fractions '0,0.5,.5' lists 0.5"),
    ("structured-fractions-not-decimal", ["structured", "--fractions", "0,½"],
     "--fractions '0,½': .*'½' is not one"),
    ("versus-engines-repeat", ["versus", "--engines", "deepinfer,deepinfer"], "lists deepinfer twice"),
    ("versus-batch-repeat", ["versus", "--batch", "2,2"], "--batch '2,2' lists 2 twice"),
    ("kernels-op-repeat", ["kernels", "--device", "cpu", "--op", "experts,experts"], "--op 'experts,experts'"),
    ("kernels-tokens-repeat", ["kernels", "--device", "cpu", "--tokens", "1,1"], "--tokens '1,1' lists 1 twice"),
    ("step-context-repeat", ["step", "--context", "128,128"], "--context '128,128' lists 128 twice"),
    ("step-prefill-empty-item", ["step", "--prefill", "8,,16"], "--prefill '8,,16' has an empty item"),
]


@pytest.mark.parametrize("args, match", [c[1:] for c in LIST_CASES], ids=[c[0] for c in LIST_CASES])
def test_list_options_are_refused_whole(args, match, tmp_path, no_build):
    refuse_cli(bench_cli, _bench_args(args, tmp_path), match, watch=[tmp_path])


LIMIT_CASES = [     # 3: engine-argument limits mapped back to the bench's own options, before any build
    ("step-context", ["step", "--context", "99999999"],
     r"--context 99999999 \+ --query-len 1 needs 100000000 positions, but --model random:deepseek_v4:tiny:4 has 1024 "
     r"\(max_position_embeddings\): use --context <= 1023"),
    ("step-query-len", ["step", "--query-len", "1000"],
     r"--context 512 \+ --query-len 1000 needs 1512 positions.*use --query-len <= 512"),
    ("step-prefill", ["step", "--prefill", "2048"], "--prefill 2048 needs 2048 positions.*use --prefill <= 1024"),
    ("dspark-isl", ["dspark", "--isl", "100000"],
     r"--isl 100000 \+ --osl 64 \+ --num-speculative-tokens 5 \+ 8 the bench reserves needs 100077 positions.*"
     r"has 4096 .*use --isl <= 4019"),
    ("dspark-concurrency", ["dspark", "--concurrency", "1,100000"],
     r"--concurrency 100000: .*step budget is 8192 tokens \(max_num_batched_tokens\): use --concurrency <= 8192"),
    ("structured-isl", ["structured", "--isl", "100000"],
     r"--isl 100000 \+ --osl 64 \+ 8 the bench reserves needs 100072 positions, but --model tiny has 4096"),
    ("structured-osl", ["structured", "--osl", "5000"], "use --osl <= 4024"),
    ("structured-batch", ["structured", "--batch", "100000"], "--batch 100000: .*use --batch <= 8192"),
    ("versus-isl", ["versus", "--isl", "5000"], r"--isl 5000 \+ --osl 32 .*use --isl <= 984"),
    ("determinism-prompt-len", ["determinism", "--prompt-len", "3000"],
     r"--prompt-len 3000 \(x2\) \+ --max-tokens 32 .*use --prompt-len <= 2028"),
    ("batch-invariance-max-tokens", ["batch-invariance", "--max-tokens", "9000"], "use --max-tokens <= 3992"),
    ("ops-batch", ["ops", "--batch", "100000"], "--batch 100000: .*use --batch <= 8192"),
    ("ops-triton-on-cpu", ["ops", "--kernel-backend", "triton"],
     "--kernel-backend triton runs on the CPU under Triton.s interpreter only"),
]


@pytest.mark.parametrize("args, match", [c[1:] for c in LIMIT_CASES], ids=[c[0] for c in LIMIT_CASES])
def test_each_bench_names_its_own_option_before_any_build(args, match, tmp_path, no_build):
    line = refuse_cli(bench_cli, _bench_args(args, tmp_path), match, watch=[tmp_path])
    assert "max_model_len" not in line and "max_num_seqs" not in line      # engine arguments the user never gave


def test_ops_prompts_stay_in_the_vocabulary_at_any_batch():
    """3: ops --batch 100000 built prompt ids past the vocabulary; they wrap inside it, and batches that fit are
    the prompts the census always used (the counts of docs/bench.md stand)."""
    from deepinfer.harness.op_census import RESERVED_IDS, census_prompts
    prompts = [p["prompt_token_ids"] for p in census_prompts(2000, 32, 512)]
    assert all(RESERVED_IDS <= t < 512 for p in prompts for t in p)
    assert len({tuple(p) for p in prompts[:512 - RESERVED_IDS]}) == 512 - RESERVED_IDS
    assert prompts[3] == list(range(RESERVED_IDS + 3, RESERVED_IDS + 3 + 32))


INVARIANT_ENV = {"DEEPINFER_BATCH_INVARIANT": "1"}
INVARIANT_CASES = [     # 4: an option that contradicts the variable is refused naming both
    ("ops-reference", ["ops", "--kernel-backend", "reference"],
     "--kernel-backend reference is not batch-invariant but DEEPINFER_BATCH_INVARIANT=1 .*use --kernel-backend "
     "invariant, leave --kernel-backend out"),
    ("step-reference", ["step", "--kernel-backend", "reference"], "--kernel-backend reference is not batch-invariant"),
    ("determinism-both", ["determinism", "--mode", "both"],
     "--mode both runs batch-invariant mode off .*DEEPINFER_BATCH_INVARIANT=1 .*use --mode on"),
    ("batch-invariance-off", ["batch-invariance", "--mode", "off"], "--mode off runs batch-invariant mode off"),
]


@pytest.mark.parametrize("args, match", [c[1:] for c in INVARIANT_CASES], ids=[c[0] for c in INVARIANT_CASES])
def test_batch_invariant_mode_against_a_bench_option(args, match, tmp_path, no_build):
    refuse_cli(bench_cli, _bench_args(args, tmp_path), match, watch=[tmp_path], env=INVARIANT_ENV)


def test_batch_invariant_mode_picks_the_partner_of_a_bench_default(monkeypatch):
    """4: where the bench only defaults a backend or a mode, DEEPINFER_BATCH_INVARIANT=1 is honoured: ops runs
    `invariant` (its default was `reference`, which the engine then refused), versus' reference engine its
    invariant partner, the checks batch-invariant mode on only."""
    from deepinfer.harness.checks import check_modes
    from deepinfer.harness.limits import bench_backend, check_kernel_backend
    assert (check_kernel_backend(None, "cpu"), bench_backend("reference"), check_modes(None)) == \
        ("reference", "reference", [False, True])
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert (check_kernel_backend(None, "cpu"), bench_backend("reference"), check_modes(None)) == \
        ("invariant", "invariant", [True])
    assert check_kernel_backend("invariant", "cpu") == "invariant"


@pytest.mark.parametrize("env", [{"DEEPINFER_USE_NEXTN_DECODE": "3"},
                                 {"DEEPINFER_USE_NEXTN_DECODE": "3", "DEEPINFER_ENABLE_MTP_VARLEN": "1"}])
def test_speculation_switches_against_benches_that_set_it(env, tmp_path, no_build):
    """The dspark bench sets speculation per mode and a sweep's `speculative` axis per setting: the README's
    switches would contradict them, so they are refused before any build, never silently overridden."""
    refuse_cli(bench_cli, _bench_args(["dspark"], tmp_path), "deepinfer-bench dspark sets speculative decoding per "
               "mode .*DEEPINFER_USE_NEXTN_DECODE.* would contradict it: unset", watch=[tmp_path], env=env)
    sweep = tmp_path / "s.yaml"
    sweep.write_text("name: s\nmodel: random:deepseek_v41:tiny:2\ndevice: cpu\nscenarios: [{isl: 8, osl: 4}]\n"
                     "concurrency: [1]\nspeculative: [off, {schedule: confidence}]\n")
    refuse_cli(bench_cli, ["sweep", str(sweep), "--report-dir", str(tmp_path / "r")],
               r"speculative\[0\].*speculative=False turns speculative decoding off, but DEEPINFER_USE_NEXTN_DECODE=3",
               watch=[tmp_path / "r"], env=env)


def test_seeds_are_bounded_before_any_work(tmp_path, no_build):
    """A seed past what the generators take (after the benches' own seed arithmetic) is one line, not an overflow
    after the ceilings were measured."""
    refuse_cli(bench_cli, _bench_args(["kernels", "--device", "cpu", "--seed", "99999999999999999999"], tmp_path),
               "--seed must be at most 2147483647, got 99999999999999999999", watch=[tmp_path])
