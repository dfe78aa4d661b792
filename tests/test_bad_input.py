"""The error contract over the API and the `deepinfer` CLI (docs/errors.md), table-driven: each bad input is refused
with the API's error type or exit status 2, one line that says what is wrong, and nothing written; the vLLM habits
that are not errors (tuples and numpy arrays of ids, model="tiny", skip_tokenizer_init, Logprob objects) work.
The harness / eval cases are in test_bad_input_harness.py, the checkpoint ones in test_bad_input_checkpoint.py."""

from __future__ import annotations

import shutil
import numpy as np
import pytest
import torch

from deepinfer import LLM, DeepInferError, SamplingParams, load_model
from deepinfer.cli import cli as deepinfer_cli
from deepinfer.env import VARIABLES
from deepinfer.evals.cli import cli as eval_cli
from deepinfer.harness.cli import cli as bench_cli
from deepinfer.outputs import Logprob
from tests.bad_input import refuse_api, refuse_cli

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
LONG = "word " * 5000                                          # > the tiny models' 4096 positions


@pytest.fixture(scope="module")
def llm(tiny_checkpoint_dir):
    return LLM(model=str(tiny_checkpoint_dir), max_num_seqs=4, max_model_len=512)


# ---- API: LLM(...) and load_model(...) refuse before any work ----
CONSTRUCTION = [
    ("model-int", dict(model=3), "model=3 is a int"),
    ("model-list", dict(model=["a"]), r"model=\['a'\] is a list"),
    ("model-empty", dict(model=""), "model='' is empty"),
    ("model-bad-random", dict(model="random:deepseek_v5:tiny:2"), "random:ARCH:PRESET:LAYERS"),
    ("model-missing-dir", dict(model="./no/such/dir"), "neither a local directory nor a hub id"),
    ("dtype", dict(dtype="f32"), "dtype='f32' is not supported; use one of bfloat16"),
    ("device-name", dict(device="tpu"), "device='tpu'"),
    ("device-type", dict(device=0), "device=0 is a int"),
    ("skip-tokenizer-not-bool", dict(skip_tokenizer_init="yes"), "skip_tokenizer_init='yes' must be True or False"),
    ("unknown-arg", dict(max_num_seq=4), r"unknown arguments \['max_num_seq'\]"),
    ("fp4-on-random-v4", dict(model="random:deepseek_v4:tiny:2", expert_storage="fp4"),
     "expert_storage='fp4' is not supported for deepseek_v4"),
    ("gpu-util-on-cpu", dict(model="tiny", gpu_memory_utilization=0.5), "on cpu it has no effect"),
    ("qat-not-bool", dict(qat_fake_quant="no"), "qat_fake_quant='no' must be True or False"),
    ("act-quant-dense", dict(model="tiny", expert_act_quant=True), "this model's experts are dense"),
    ("act-quant-not-bool", dict(model="tiny", expert_act_quant="on"), "expert_act_quant='on' must be True or False"),
    ("triton-on-cpu", dict(model="tiny", kernel_backend="triton"), "'triton' needs a CUDA device"),
]


@pytest.mark.parametrize("kwargs, match", [c[1:] for c in CONSTRUCTION], ids=[c[0] for c in CONSTRUCTION])
def test_llm_construction_refuses(kwargs, match, tmp_path):
    refuse_api(lambda: LLM(**kwargs), DeepInferError, match, watch=[tmp_path])


@NO_GPU
@pytest.mark.parametrize("how", ["argument", "environment"])
def test_cuda_without_a_gpu(how, monkeypatch):
    if how == "environment":
        monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cuda")
    kwargs = {"device": "cuda"} if how == "argument" else {}
    refuse_api(lambda: LLM(model="tiny", **kwargs), DeepInferError, "no CUDA GPU is visible")


ENVIRONMENT = [
    ("async-2", "DEEPINFER_ASYNC_SCHEDULING", "2", "DEEPINFER_ASYNC_SCHEDULING='2' is not a flag; use 1 or 0"),
    ("logging-banana", "DEEPINFER_CONFIGURE_LOGGING", "banana", "DEEPINFER_CONFIGURE_LOGGING='banana' is not a flag"),
    ("yoco-min-0", "DEEPINFER_YOCO_PREFILL_MIN_TOKENS", "0", "must be >= 1"),
    ("accelerator", "DEEPINFER_ACCELERATOR", "tpu", "DEEPINFER_ACCELERATOR='tpu': use one of cpu, nvidia"),
    ("backend", "DEEPINFER_KERNEL_BACKEND", "fast", "'fast': use one of reference, invariant"),
    ("typo", "DEEPINFER_BATCH_INVARIENT", "1", "did you mean DEEPINFER_BATCH_INVARIANT"),
    ("model-dir-missing", "DEEPINFER_HF_MODEL_DIR", "/no/such/dir", "='/no/such/dir' is not a directory"),
    ("build-flag", "DEEPINFER_NO_TEST_DEPS", "maybe", "DEEPINFER_NO_TEST_DEPS='maybe' is not a flag"),
    ("nextn-9", "DEEPINFER_USE_NEXTN_DECODE", "9", r"DEEPINFER_USE_NEXTN_DECODE=9 must be in 0\.\.5"),
    ("nextn-superscript", "DEEPINFER_USE_NEXTN_DECODE", "\u00b2", "is not an integer; use an integer in 0..5"),
]


@pytest.mark.parametrize("name, value, match", [c[1:] for c in ENVIRONMENT], ids=[c[0] for c in ENVIRONMENT])
def test_environment_is_one_rule_everywhere(name, value, match, monkeypatch, tmp_path, tiny_checkpoint_dir):
    """The same value gets the same line from LLM, load_model and all three CLIs (before anything else)."""
    monkeypatch.setenv(name, value)
    lines = {refuse_api(lambda: LLM(model=str(tiny_checkpoint_dir)), DeepInferError, match),
             refuse_api(lambda: load_model(tiny_checkpoint_dir), DeepInferError, match)}
    for group, args in ((deepinfer_cli, ["run", "--max-tokens", "1"]),
                        (bench_cli, ["sweep", "--report-dir", str(tmp_path / "r")]),
                        (eval_cli, ["run", "--out", str(tmp_path / "e")])):
        lines.add(refuse_cli(group, args, match, watch=[tmp_path], env={name: value}).removeprefix("error: "))
    assert len(lines) == 1, lines


def test_the_backend_rule_is_the_op_tables():
    from deepinfer.kernels.table import BACKEND_SETS
    assert VARIABLES["DEEPINFER_KERNEL_BACKEND"].choices == tuple(BACKEND_SETS)


def test_every_variable_is_in_the_readme():
    from pathlib import Path
    import re
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    listed = set(re.findall(r"^\| `(DEEPINFER_[A-Z0-9_]+)`", readme, flags=re.M))
    assert listed == set(VARIABLES)


# ---- API: generate(...) checks every request before any work ----
GENERATE = [
    ("params-dict", "hi", {"max_tokens": 2}, "sampling_params is a dict; pass SamplingParams"),
    ("params-list-of-dicts", ["a", "b"], [{"n": 1}, SamplingParams()], r"entries 0 \(dict\) are not SamplingParams"),
    ("params-count", ["a", "b"], [SamplingParams()] * 3, "3 SamplingParams for 2 prompt"),
    ("empty-text", "", None, "prompt 0 is empty"),
    ("empty-ids", [[]], None, "prompt 0 is empty"),
    ("too-long", LONG, None, "max_model_len is 512"),
    ("float-id", [[1, 2.5]], None, "prompt 0 is a list"),
    ("out-of-vocab", [(1, 10**7)], None, "outside 0.."),
    ("numpy-2d", np.ones((2, 3), dtype=np.int64), None, "2-D ndarray"),
    ("numpy-float", np.ones(3), None, "1-D ndarray of float64"),
    ("dict-keys", {"prompt": "x"}, None, r"keys \['prompt'\]"),
    ("prompts-empty-list", [], None, "non-empty list"),
    ("lone-surrogate", "ab\ud800", None,
     r"prompt 0 is not valid Unicode text: a lone surrogate U\+D800 at character 2"),
    ("escaped-byte", "caf\udce9", None, r"prompt 0 is not valid Unicode text: a lone surrogate U\+DCE9 at character 3"),
    ("stray-in-ids", [1, "a", 3], None, "prompts mixes token ids with a str at position 1"),
]


@pytest.mark.parametrize("prompts, params, match", [c[1:] for c in GENERATE], ids=[c[0] for c in GENERATE])
def test_generate_refuses(llm, prompts, params, match):
    steps = llm.stats.steps
    refuse_api(lambda: llm.generate(prompts, params, use_tqdm=False), DeepInferError, match)
    assert llm.stats.steps == steps                       # no work was done


def test_text_is_checked_wherever_it_enters(llm, tmp_path):
    """One rule (engine/text.py) for every text input: stop strings, schemas, chat messages."""
    from deepinfer.errors import DeepInferError as E
    refuse_api(lambda: SamplingParams(stop=["ok", "x\udcff"]), E,
               r"stop string 1 is not valid Unicode text: a lone surrogate U\+DCFF at character 1")
    refuse_api(lambda: SamplingParams(so_args={"regex": "a\ud800"}), E,
               r"so_args regex schema is not valid Unicode text: a lone surrogate U\+D800")
    steps = llm.stats.steps
    refuse_api(lambda: llm.chat([{"role": "user", "content": "\udce9t\u00e9"}], use_tqdm=False), E,
               r"chat message 0 \('user'\) content is not valid Unicode text: a lone surrogate U\+DCE9 at character 0")
    assert llm.stats.steps == steps


SPEC_SWITCHES = [
    ("varlen-with-spec-off", {"DEEPINFER_ENABLE_MTP_VARLEN": "1"}, False,
     "speculative=False turns speculative decoding off, but DEEPINFER_ENABLE_MTP_VARLEN=1 ask"),
    ("nextn-with-spec-off", {"DEEPINFER_USE_NEXTN_DECODE": "3"}, False, "but DEEPINFER_USE_NEXTN_DECODE=3 ask"),
    ("varlen-with-fixed", {"DEEPINFER_USE_NEXTN_DECODE": "3", "DEEPINFER_ENABLE_MTP_VARLEN": "1"},
     {"schedule": "fixed"}, "schedule='fixed' verifies every draft, but DEEPINFER_ENABLE_MTP_VARLEN=1"),
    ("nextn-disagrees", {"DEEPINFER_USE_NEXTN_DECODE": "2"}, {"num_speculative_tokens": 3},
     "num_speculative_tokens=3 and DEEPINFER_USE_NEXTN_DECODE=2 disagree"),
]


@pytest.mark.parametrize("env, speculative, match", [c[1:] for c in SPEC_SWITCHES], ids=[c[0] for c in SPEC_SWITCHES])
def test_speculation_switches_are_applied_or_refused(env, speculative, match, monkeypatch):
    """The documented switches never go silently unapplied: an argument that contradicts them is refused."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    refuse_api(lambda: LLM(model="tiny", speculative=speculative), DeepInferError, match)


def test_vllm_arguments_we_lack_and_odd_calls(llm, tiny_checkpoint_dir):
    refuse_api(lambda: llm.generate("hi", lora_request=object()), DeepInferError,
               r"generate\(\) got unsupported arguments \['lora_request'\]")
    refuse_api(lambda: llm.chat([{"role": "user", "content": "x"}], chat_template_kwargs={}), DeepInferError,
               "chat_template_kwargs")
    refuse_api(lambda: llm.chat([{"role": "user", "content": "x", "nme": "a"}]), DeepInferError,
               r"unknown keys \['nme'\]")
    refuse_api(lambda: load_model(tiny_checkpoint_dir, foo=1), DeepInferError, r"unsupported arguments \['foo'\]")
    refuse_api(lambda: load_model(""), DeepInferError, "model='' is empty")


def test_token_id_prompts_in_every_vllm_form(llm):
    """A tuple, a numpy or torch integer array of ids is one prompt (not one prompt per id), as a list is."""
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = [5, 17, 99, 3]
    want = llm.generate([ids], sp, use_tqdm=False)[0].outputs[0].token_ids
    for form in (tuple(ids), np.array(ids, dtype=np.int32), torch.tensor(ids), [np.int64(t) for t in ids],
                 {"prompt_token_ids": np.array(ids)}):
        outs = llm.generate(form, sp, use_tqdm=False)
        assert len(outs) == 1 and outs[0].prompt_token_ids == ids and outs[0].outputs[0].token_ids == want
    assert len(llm.generate((tuple(ids), ids), sp, use_tqdm=False)) == 2


def test_logprobs_are_vllm_logprob_objects(llm):
    out = llm.generate("The cat", SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1,
                                                 ignore_eos=True), use_tqdm=False)[0]
    for tok, entry in zip(out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert all(isinstance(v, Logprob) for v in entry.values())
        assert entry[tok].rank == 1                        # greedy: the chosen token is the most likely
        assert entry[tok].decoded_token == llm.tokenizer.decode([tok], skip_special_tokens=False)
        assert sorted(v.rank for v in entry.values()) == [1, 2]
    assert out.prompt_logprobs[0] is None
    for tok, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert entry[tok].rank >= 1 and entry[tok].logprob <= 0 and isinstance(entry[tok].decoded_token, str)


def test_model_tiny_is_the_embedded_model_everywhere():
    llm = LLM(model="tiny", max_num_seqs=2, max_model_len=128)
    assert llm.model.cfg.model_type == "deepseek_v41" and len(llm.generate("hi", use_tqdm=False)) == 1
    assert load_model("tiny").cfg.model_type == "deepseek_v41"


def test_skip_tokenizer_init(tiny_checkpoint_copy):
    """A checkpoint without tokenizer.json: refused with a line naming skip_tokenizer_init; with it, token-id
    prompts run (text empty, decoded_token None) and text prompts / stop strings are refused in one line."""
    (tiny_checkpoint_copy / "tokenizer.json").unlink()
    refuse_api(lambda: LLM(model=str(tiny_checkpoint_copy)), DeepInferError, "skip_tokenizer_init=True")
    llm = LLM(model=str(tiny_checkpoint_copy), skip_tokenizer_init=True, max_num_seqs=2, max_model_len=128)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, logprobs=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.text == "" and all(
        e[t].decoded_token is None for t, e in zip(out.token_ids, out.logprobs))
    refuse_api(lambda: llm.generate("text", use_tqdm=False), DeepInferError, "prompt 0 is text")
    refuse_api(lambda: llm.generate([[5]], SamplingParams(stop=["x"]), use_tqdm=False), DeepInferError,
               "stop strings need the tokenizer")


# ---- the deepinfer CLI ----
@pytest.fixture
def v4_dir(tiny_checkpoint_dir):
    return str(tiny_checkpoint_dir)


CLI = [
    ("run-empty-prompt", ["run", "--prompt", ""], "prompt 0 is empty"),
    ("run-too-long", ["run", "--prompt", LONG], "prompt 0 has .* tokens; max_model_len is 4096"),
    ("run-arch-mismatch", ["run", "--model", "{v4}", "--arch", "deepseek_v41"], "holds a deepseek_v4 checkpoint"),
    ("run-bad-dtype", ["run", "--dtype", "f32"], "'f32' is not one of 'bfloat16'"),
    ("run-zero-tokens", ["run", "--max-tokens", "0"], "--max-tokens"),
    ("run-model-missing", ["run", "--model", "./no/such"], "neither a local directory nor a hub id"),
    ("run-bad-random", ["run", "--model", "random:x"], "random:ARCH:PRESET:LAYERS"),
    ("run-random-arch", ["run", "--model", "random:deepseek_v4:tiny:2", "--arch", "deepseek_v41"],
     "builds a deepseek_v4 model"),
    ("run-corrupt-tokenizer", ["run", "--model", "{bad_tok}"], "tokenizer.json could not be read as a tokenizer"),
    ("generate-corrupt-tokenizer", ["generate", "--model", "{bad_tok}", "--prompt", "x"], "could not be read"),
    ("generate-bad-top-p", ["generate", "--prompt", "a", "--top-p", "2"], "top_p=2.0"),
    ("generate-empty", ["generate", "--prompt", ""], "prompt 0 is empty"),
    ("generate-two-so", ["generate", "--prompt", "a", "--so-regex", "a", "--so-json", "{tmp}/s.json"],
     "at most one of --so-json, --so-regex, --so-ebnf"),
    ("generate-so-missing", ["generate", "--prompt", "a", "--so-json", "{tmp}/none.json"], "--so-json .*cannot read it"),
    ("generate-so-bad-regex", ["generate", "--prompt", "a", "--so-regex", "(a"],
     "request 0: so_args regex schema does not compile"),
    ("run-non-utf8", ["run", "--prompt", "caf\udce9"], "--prompt is not valid UTF-8: byte 0xe9 at character 3"),
    ("generate-non-utf8", ["generate", "--prompt", "ok", "--prompt", "caf\udce9"],
     "--prompt 2 is not valid UTF-8: byte 0xe9"),
    ("generate-so-json-latin1", ["generate", "--prompt", "a", "--so-json", "{latin1}"],
     r"--so-json .*s\.json is not UTF-8 text: byte 0xe9 at byte 14 \(line 1\); save it as UTF-8"),
    ("make-bad-arch", ["make-checkpoint", "--arch", "v5", "--out", "{tmp}/x"], "'v5' is not one of"),
    ("make-bad-preset", ["make-checkpoint", "--preset", "huge", "--out", "{tmp}/x"], "'huge' is not one of"),
    ("unknown-option", ["run", "--temprature", "1"], "No such option"),
]


@pytest.mark.parametrize("args, match", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_deepinfer_cli_refuses(args, match, tmp_path, v4_dir):
    bad_tok = tmp_path / "bad-tok"
    if "{bad_tok}" in args:
        shutil.copytree(v4_dir, bad_tok)
        (bad_tok / "tokenizer.json").write_text('{"x":')
    latin1 = tmp_path / "latin1" / "s.json"
    if "{latin1}" in args:
        latin1.parent.mkdir()
        latin1.write_bytes(b'{"title": "caf\xe9"}')
    args = [a.format(v4=v4_dir, tmp=tmp_path, bad_tok=bad_tok, latin1=latin1) for a in args]
    refuse_cli(deepinfer_cli, args, match, watch=[tmp_path])


@NO_GPU
@pytest.mark.parametrize("env, args", [({}, ["--device", "cuda"]), ({"DEEPINFER_ACCELERATOR": "cuda"}, [])],
                         ids=["option", "environment"])
def test_run_on_cuda_without_a_gpu(env, args, tmp_path):
    refuse_cli(deepinfer_cli, ["run", *args], "no CUDA GPU is visible", watch=[tmp_path], env=env)


def test_run_and_generate_take_tiny_and_random(capsys):
    from click.testing import CliRunner
    runner = CliRunner()
    for args in (["run", "--model", "tiny", "--arch", "deepseek_v4", "--max-tokens", "2", "--no-progress"],
                 ["run", "--model", "random:deepseek_v4:tiny:2", "--max-tokens", "2", "--no-progress"],
                 ["generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "2"]):
        res = runner.invoke(deepinfer_cli, args)
        assert res.exit_code == 0, (args, res.output)
    assert "loaded deepseek_v4" in runner.invoke(deepinfer_cli, ["run", "--model", "tiny", "--arch", "deepseek_v4",
                                                                 "--max-tokens", "1", "--no-progress"]).output


def test_every_command_has_an_example():
    for group in (deepinfer_cli, bench_cli, eval_cli):
        for name, command in group.commands.items():
            assert command.epilog and "Example" in command.epilog, f"{group.name} {name} has no example"


def test_choices_are_listed_in_help():
    from click.testing import CliRunner
    runner = CliRunner()
    for args, want in ((["run", "--help"], "float32"), (["run", "--help"], "deepseek_v4"),
                       (["make-checkpoint", "--help"], "flash")):
        assert want in runner.invoke(deepinfer_cli, args).output



def test_readme_dspark_switches_finish_on_the_cpu_with_a_progress_line(tmp_path):
    """The README's switches on `deepinfer generate`: the step-rate profile is sized to the command's one request
    (not 256 sequences x 4096 positions, minutes on a CPU) and says what it does before it starts."""
    import os
    import subprocess
    import time

    from tests.helpers import deepinfer_exe
    env = {**os.environ, "DEEPINFER_USE_NEXTN_DECODE": "3", "DEEPINFER_ENABLE_MTP_VARLEN": "1"}
    t0 = time.perf_counter()
    p = subprocess.run([deepinfer_exe(), "generate", "--prompt", "Hi", "--max-tokens", "8", "--json"], env=env,
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    elapsed = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr
    assert "speculative step rate: profiling" in p.stderr and "on up to 1 sequence(s)" in p.stderr
    assert '"finish_reason": "length"' in p.stdout and elapsed < 60, elapsed


def test_examples_take_the_error_path(tmp_path):
    """Every example ends in the CLIs' error path (one line, exit 2), here with a model that does not exist."""
    import ast
    import subprocess
    import sys
    from pathlib import Path
    examples = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.py"))
    for path in examples:
        main_block = [n for n in ast.parse(path.read_text()).body if isinstance(n, ast.If)
                      and "__main__" in ast.unparse(n.test)]
        assert main_block and "run_cli(main)" in ast.unparse(main_block[0]), path.name
    p = subprocess.run([sys.executable, str(examples[0].parent / "structured_output.py"), "--model", "./no/such"],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().startswith("error: ") and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_integer_env_values_are_ascii_digits(monkeypatch, tmp_path):
    for raw in ("--3", "+3", "-0", "1_0"):
        monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_MIN_TOKENS", raw)
        refuse_cli(deepinfer_cli, ["run", "--max-tokens", "1"], "is not an integer; use an integer >= 1",
                   watch=[tmp_path], env={"DEEPINFER_YOCO_PREFILL_MIN_TOKENS": raw})


def test_generate_sizes_its_engine_no_larger_than_the_default(monkeypatch):
    """Many samples of one prompt: up to the engine's default seats at once, the rest queued (not refused)."""
    from click.testing import CliRunner
    res = CliRunner().invoke(deepinfer_cli, ["generate", "--prompt", "a", "--n", "300", "--temperature", "1",
                                             "--max-tokens", "1", "--json"])
    assert res.exit_code == 0, res.output
    assert len(__import__("json").loads(res.output.splitlines()[-1])["outputs"]) == 300
