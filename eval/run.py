"""Run an eval suite on the engine through lm-eval and write `reports/eval/<run_id>/`.

    run = run_suite(load_suite("offline-smoke"), "reports/eval")
    run.failures        # threshold rows that did not hold (the CLI exits non-zero on any)

Per concurrency c of the suite (max, median, ...): lm-eval's full result dict (`results_c{c}.json`) and its
per-sample log (`samples_c{c}.jsonl`). Rows (`rows.jsonl`, the harness row store) carry one metric each, with
model, engine config, seeds, environment and git state, and the suite's bound on it; `agreement` rows compare
the per-sample predictions of every concurrency with the first one's; with `--reference transformers` the same
tasks also run through lm-eval's HF backend on the same checkpoint (`*_reference.*`), with agreement rows.
The run directory is made once the device, the tasks and the model have loaded, and removed again when the run
fails before its first row. lm-eval's results carry our checkout's commit as `git_hash` (never a `git describe`
of the working directory, which prints to the terminal outside a checkout).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from deepinfer.errors import DeepInferError
from deepinfer.harness.bench import RunFolder
from deepinfer.harness.rows import (RowStore, atomic_write_text, environment, kernel_fields, run_dir_guard, run_id_for,
                                   utc_now)
from deepinfer.harness.rows import identity as row_identity
from deepinfer.validate import check_device

from .suite import Bound, Suite

log = logging.getLogger("deepinfer")
EVAL_METHOD_VERSION = "2"   # 2: score-only samples agree by loglik (1 compared nothing for them); summary row
REFERENCES = ("transformers",)
LOGLIK_TOL = 1e-3        # score-only samples agree when their logliks match this closely (fp32 noise across backends)


@dataclass
class EvalRun:
    run_dir: Path
    rows: list[dict] = field(default_factory=list)

    @property
    def failures(self) -> list[dict]:
        return [r for r in self.rows if r.get("passed") is False]


def run_suite(suite: Suite, out_root: str | Path = "reports/eval", run_id: str | None = None,
              reference: str | None = None, progress: bool = True, unsafe_code: bool = False) -> EvalRun:
    from lm_eval.tasks import TaskManager

    from .backend import DeepInferLM, build_engine
    from .tasks import task_configs
    if reference is not None and reference not in REFERENCES:
        raise DeepInferError(f"--reference {reference!r}: allowed: {', '.join(REFERENCES)}")
    check_device(suite.device)
    run_id = run_id_for(run_id, suite.name)
    folder = RunFolder(Path(out_root) / run_id, "suite.yaml", resumable=False)
    folder.check()
    run_dir = folder.path
    managers: dict[bool, TaskManager] = {}         # lm-eval's task index is slow to build: once per run

    def manager(with_defaults: bool = True) -> TaskManager:
        if with_defaults not in managers:
            managers[with_defaults] = TaskManager(include_defaults=with_defaults)
        return managers[with_defaults]
    entries = task_configs(suite.tasks, manager, unsafe_code)
    task_manager = managers.get(True) or manager(False)   # the full index only if a non-offline task needed it
    if reference is not None:
        _check_reference_model(suite.model)
        constrained = [t.name for t, e in zip(suite.tasks, entries) if isinstance(e, dict) and
                       (e.get("generation_kwargs") or {}).get("so_args") is not None]
        if constrained:
            raise DeepInferError(f"--reference transformers: task {', '.join(constrained)} constrains its replies "
                                 f"with so_args, which lm-eval's HF backend cannot apply; run it without --reference")
    llm = build_engine(suite.model, suite.device, suite.dtype, suite.seed, qat_fake_quant=reference is None,
                       engine_args=dict(suite.engine_args))
    # the suite's mode is the engine's kernel backend (an engine of its own): nothing process-wide to restore
    lm = DeepInferLM(llm=llm, pretrained=suite.model, seed=suite.seed, batch_invariant=suite.batch_invariant,
                     progress=progress)
    with run_dir_guard(run_dir):         # made now that everything has loaded; removed if no row gets written
        env = environment()
        store = folder.open(yaml.safe_dump(suite.to_dict(), sort_keys=False), env)
        return _run(suite, lm, entries, task_manager, store, env, run_id, reference, progress, unsafe_code)


def _run(suite: Suite, lm, entries, task_manager, store: RowStore, env: dict, run_id: str,
         reference: str | None, progress: bool, unsafe_code: bool) -> EvalRun:
    llm, run_dir = lm.llm, store.dir
    identity = row_identity(env, EVAL_METHOD_VERSION, kind="eval", run_id=run_id, suite=suite.name,
                            model=suite.model, model_type=llm.model.cfg.model_type,
                            config_hash=llm.model.cfg.config_hash(), precision=suite.dtype, device=suite.device,
                            engine="deepinfer", engine_args=dict(suite.engine_args), seed=suite.seed,
                            batch_invariant=llm.batch_invariant, **kernel_fields(llm),
                            qat_fake_quant=reference is None, limit=suite.limit)
    run = EvalRun(run_dir)
    samples_by_c = {}
    for c in suite.concurrencies(llm.engine.max_num_seqs):
        lm.concurrency = c
        log.info(f"eval {suite.name}: concurrency {c}")
        result = _evaluate(lm, entries, suite, task_manager, progress, unsafe_code, env["git"]["sha"])
        samples_by_c[c] = _write_result(run_dir, f"c{c}", result)
        rows = metric_rows(result, suite, {**identity, "concurrency": c})
        _append(store, run, rows)
    first, *others = list(samples_by_c)
    for c in others:
        _append(store, run, agreement_rows(samples_by_c[first], samples_by_c[c], suite.agreement,
                                           {**identity, "kind": "agreement", "concurrency": c, "versus": f"c{first}"}))
    if reference is not None:
        ref_lm = _reference_lm(llm, suite)
        result = _evaluate(ref_lm, entries, suite, task_manager, progress, unsafe_code, env["git"]["sha"])
        ref_samples = _write_result(run_dir, "reference", result)
        _append(store, run, metric_rows(result, suite, {**identity, "engine": "transformers", "concurrency": None},
                                        check=False))
        _append(store, run, agreement_rows(samples_by_c[first], ref_samples, None,
                                           {**identity, "kind": "reference_agreement", "concurrency": first,
                                            "versus": "transformers"}))
    # the last row says the run is whole (an interrupted run has none; the index shows it as incomplete)
    store.append({**identity, "kind": "summary", "key": "summary", "status": "ok", "complete": True,
                  "concurrencies": list(samples_by_c), "thresholds_missed": len(run.failures), "time": utc_now()})
    return run


def _append(store: RowStore, run: EvalRun, rows: list[dict]) -> None:
    for r in rows:
        who = r["versus"] if r["kind"] == "reference_agreement" else \
            r["engine"] if r["concurrency"] is None else f"c{r['concurrency']}"
        r.update(key=f"{r['kind']}/{who}/{r['task']}/{r['metric']}", status="ok")
        store.append(r)
        run.rows.append(r)


def _evaluate(lm, entries, suite: Suite, task_manager, progress: bool, unsafe_code: bool, git_sha: str | None) -> dict:
    import copy

    import lm_eval
    with _git_hash_of_this_checkout(git_sha):
        return lm_eval.simple_evaluate(
            model=lm, tasks=copy.deepcopy(entries), limit=suite.limit, task_manager=task_manager, log_samples=True,
            apply_chat_template=suite.apply_chat_template, random_seed=suite.seed, numpy_random_seed=suite.seed,
            torch_random_seed=suite.seed, fewshot_random_seed=suite.seed, confirm_run_unsafe_code=unsafe_code,
            verbosity="WARNING" if not progress else None)


@contextlib.contextmanager
def _git_hash_of_this_checkout(sha: str | None):
    """lm-eval's results["git_hash"] is `git describe` of the working directory, run without capturing stderr
    (`fatal: not a git repository` outside a checkout); for the call, it is the deepinfer checkout's commit."""
    import lm_eval.evaluator as evaluator
    before = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = lambda: sha
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = before


def _write_result(run_dir: Path, tag: str, result: dict) -> dict:
    """results_TAG.json (lm-eval's dict without samples) and samples_TAG.jsonl; returns the samples."""
    from lm_eval.utils import handle_non_serializable
    samples = result.pop("samples", {})
    atomic_write_text(run_dir / f"results_{tag}.json",
                      json.dumps(result, indent=1, default=handle_non_serializable, sort_keys=True) + "\n")
    lines = [json.dumps({"task": task, **s}, default=handle_non_serializable, sort_keys=True)
             for task, per in samples.items() for s in per]
    atomic_write_text(run_dir / f"samples_{tag}.jsonl", "".join(line + "\n" for line in lines))
    result["samples"] = samples
    return samples


SKIP_KEYS = ("alias", "name", "sample_len", "sample_count")


def metric_rows(result: dict, suite: Suite, identity: dict, check: bool = True) -> list[dict]:
    """One row per (task, metric) of lm-eval's results, with the suite's bound and whether it holds."""
    rows = []
    n_samples = result.get("n-samples", {})
    for task, metrics in result["results"].items():
        bounds = suite.thresholds.get(task, {})
        for key, value in metrics.items():
            if key in SKIP_KEYS or "_stderr," in key or not isinstance(value, (int, float)):
                continue
            value = float(value)
            stderr = metrics.get(key.replace(",", "_stderr,", 1))
            bound: Bound | None = bounds.get(key) if check else None
            rows.append({**identity, "task": task, "metric": key, "value": value,
                         "stderr": float(stderr) if isinstance(stderr, (int, float)) else None,
                         "n_samples": n_samples.get(task, {}).get("effective"),
                         "bound": None if bound is None else str(bound),
                         "passed": None if bound is None else bound.holds(value), "time": utc_now()})
        reported = sorted(k for k in metrics if k not in SKIP_KEYS and "_stderr," not in k)
        for key in sorted(set(bounds) - set(metrics)) if check else ():   # a threshold on nothing never holds
            rows.append({**identity, "task": task, "metric": key, "value": float("nan"), "stderr": None,
                         "n_samples": n_samples.get(task, {}).get("effective"),
                         "bound": f"{bounds[key]}, but {task} reports no {key} (it reports {', '.join(reported)})",
                         "passed": False, "time": utc_now()})
    return rows


def agreement_rows(a: dict, b: dict, bound: Bound | None, identity: dict) -> list[dict]:
    """Per task: the fraction of samples that agree between runs a and b (`_agree`) and the largest absolute
    loglikelihood difference."""
    rows = []
    for task in a:
        if task not in b:
            continue
        by_doc = {s["doc_id"]: s for s in b[task]}
        same = total = 0
        diff = 0.0
        for s in a[task]:
            t = by_doc.get(s["doc_id"])
            if t is None:
                continue
            total += 1
            same += _agree(s, t)
            for x, y in zip(_logliks(s), _logliks(t)):
                diff = max(diff, abs(x - y))
        value = same / total if total else float("nan")
        rows.append({**identity, "task": task, "metric": "agreement", "value": value, "n_samples": total,
                     "max_abs_loglik_diff": diff, "bound": None if bound is None else str(bound),
                     "passed": None if bound is None else bound.holds(value), "time": utc_now()})
    return rows


def _agree(a: dict, b: dict) -> bool:
    """One sample in two runs: the same chosen option (multiple choice), the same filtered reply (generation),
    or for scores alone (perplexity, single continuations) logliks within LOGLIK_TOL and the same greedy flags."""
    la, lb = _logliks(a), _logliks(b)
    resps_a = a.get("filtered_resps", a.get("resps"))
    if la and len(la) == len(lb) and len(la) == len(resps_a) and len(la) > 1:          # multiple choice
        return max(range(len(la)), key=la.__getitem__) == max(range(len(lb)), key=lb.__getitem__)
    if la:
        return len(la) == len(lb) and all(abs(x - y) <= LOGLIK_TOL for x, y in zip(la, lb)) and \
            _greedy_flags(a) == _greedy_flags(b)
    return json.dumps(resps_a, default=str) == json.dumps(b.get("filtered_resps", b.get("resps")), default=str)


def _greedy_flags(sample: dict) -> list:
    return [r[0][1] for r in sample.get("resps", []) if isinstance(r, (list, tuple)) and r
            and isinstance(r[0], (list, tuple)) and len(r[0]) > 1]


def _logliks(sample: dict) -> list[float]:
    out = []
    for r in sample.get("resps", []):
        x = r[0] if isinstance(r, (list, tuple)) and r else r
        if isinstance(x, (list, tuple)) and x and isinstance(x[0], (int, float)):
            out.append(float(x[0]))
        elif isinstance(x, (int, float)) and not isinstance(x, bool):
            out.append(float(x))
    return out


def _check_reference_model(model: str) -> None:
    path = Path(model)
    cfg = path / "config.json"
    if model == "tiny" or model.startswith("random:") or not cfg.is_file():
        raise DeepInferError(f"--reference transformers needs a V4 checkpoint directory in Hugging Face layout (got "
                             f"{model!r}); make one with `deepinfer make-checkpoint --arch deepseek_v4 --format hf`")
    model_type = json.loads(cfg.read_text()).get("model_type")
    if model_type != "deepseek_v4":
        raise DeepInferError(f"--reference transformers runs deepseek_v4 checkpoints (transformers 5.23 has "
                             f"DeepseekV4ForCausalLM); {model} is {model_type!r}")


def _reference_lm(llm, suite: Suite):
    try:
        from lm_eval.models.huggingface import HFLM
        return HFLM(pretrained=str(llm.model.checkpoint_dir), dtype=suite.dtype, device=suite.device,
                    batch_size=llm.engine.max_num_seqs, max_length=llm.max_model_len - 2)
    except ImportError as e:
        raise DeepInferError(f"--reference transformers needs transformers==5.23.0, accelerate and peft ({e}); "
                             f"pip install 'deepinfer[reference]'") from None


