"""Task specs -> what lm-eval's `simple_evaluate(tasks=...)` takes, with one clear error per bad task.

Offline tasks live here as lm-eval task YAMLs (`deepinfer_*.yaml`) over data the project owns (`data/*.jsonl`,
written by make_data.py); their `data_files` are relative to this directory and resolved to absolute paths.
Any other name goes to lm-eval's own task index (which needs its dataset from the hub, or the datasets cache).
"""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path

from deepinfer.errors import DeepInferError, did_you_mean

TASKS_DIR = Path(__file__).resolve().parent


class TaskError(DeepInferError, ValueError):
    """An unknown task, a missing local data file, a dataset that cannot be loaded (one line)."""


def offline_tasks() -> dict[str, dict]:
    """name -> task config (data paths absolute; `process_results: NAME` bound to eval/tasks/metrics.py's
    function, with the schema of the task's so_args) of every offline task."""
    import yaml
    out = {}
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        files = cfg.get("dataset_kwargs", {}).get("data_files", {})
        cfg.setdefault("dataset_kwargs", {})["data_files"] = {k: str(TASKS_DIR / v) for k, v in files.items()}
        out[cfg["task"]] = bind_metric(cfg, str(path))
    return out


def bind_metric(cfg: dict, where: str) -> dict:
    """cfg with `process_results: NAME` (a name, or a function bound earlier) bound to metrics.NAME and the
    schema of cfg's generation_kwargs.so_args. A suite override that sets so_args is scored against its own
    schema; one that drops the grammar keeps the task's (what the replies should have been). A schema metric
    in a task YAML without so_args is a TaskError."""
    from .metrics import METRICS
    fn = cfg.get("process_results")
    if fn is None:
        return cfg
    name = fn if isinstance(fn, str) else fn.func.__name__
    if name not in METRICS:
        raise TaskError(f"{where}: process_results {name!r} is not in eval/tasks/metrics.py ({', '.join(METRICS)})")
    schema = ((cfg.get("generation_kwargs") or {}).get("so_args") or {}).get("schema")
    if schema is None:
        if not isinstance(fn, str):
            return cfg                                          # the task's own schema, bound at load
        raise TaskError(f"{where}: process_results {name} scores against the schema of generation_kwargs.so_args, "
                        f"which the task does not set; give so_args (schema_type json) or another metric")
    if isinstance(schema, str):
        schema = json.loads(schema)
    cfg["process_results"] = functools.partial(METRICS[name], schema=schema)
    return cfg


def task_configs(specs, task_manager_factory, unsafe_code: bool = False) -> list:
    """TaskSpecs -> lm-eval task entries (offline: full config dicts; others: {task: name, ...overrides}), each
    checked by loading it once, so a bad task fails before the model runs. `task_manager_factory(with_defaults)`
    gives the lm-eval TaskManager (the full index only when a non-offline task needs it). A task that executes
    model-written code needs `unsafe_code` (and HF_ALLOW_CODE_EVAL=1, lm-eval's code_eval switch)."""
    local = offline_tasks()
    entries, manager = [], None
    for spec in specs:
        if spec.name in local:
            cfg = copy.deepcopy(local[spec.name])
            for split, path in cfg["dataset_kwargs"]["data_files"].items():
                if not Path(path).is_file():
                    raise TaskError(f"task {spec.name}: data file {path} is missing; regenerate it with "
                                    f"`python -m deepinfer.evals.tasks.make_data`")
        else:
            manager = manager or task_manager_factory(True)
            if spec.name not in manager.all_tasks:
                hint = did_you_mean(spec.name, list(local) + list(manager.all_tasks), n=3)
                hint = f"{hint} " if hint else ""
                raise TaskError(f"unknown task {spec.name!r}: {hint}offline tasks: {', '.join(local)}; lm-eval's "
                                f"tasks: `lm-eval ls tasks`")
            cfg = {"task": spec.name}
        cfg.update(copy.deepcopy(dict(spec.overrides)))
        if spec.name in local:
            cfg = bind_metric(cfg, f"task {spec.name}")
        if spec.num_fewshot is not None:
            cfg["num_fewshot"] = spec.num_fewshot
        entry = cfg if spec.name in local or len(cfg) > 1 else spec.name
        loaded = _check_loads(spec.name, entry, manager or task_manager_factory(False))
        if any(getattr(t, "UNSAFE_CODE", False) for t in _leaves(loaded)):
            if not unsafe_code:
                raise TaskError(f"task {spec.name} executes model-written code: run it in a sandbox with "
                                f"--confirm-run-unsafe-code and HF_ALLOW_CODE_EVAL=1")
            if os.environ.get("HF_ALLOW_CODE_EVAL") != "1":
                raise TaskError(f"task {spec.name} executes model-written code: set HF_ALLOW_CODE_EVAL=1 (lm-eval's "
                                f"code_eval refuses otherwise, after all the generation)")
        entries.append(entry)
    return entries


def _leaves(task_dict):
    """The Task objects of a (possibly nested, for groups) lm-eval task dict."""
    for value in task_dict.values():
        if isinstance(value, dict):
            yield from _leaves(value)
        else:
            yield value


def _check_loads(name: str, entry, manager) -> dict:
    from lm_eval.tasks import get_task_dict
    try:
        return get_task_dict([entry], manager)
    except DeepInferError:
        raise
    except Exception as e:                       # noqa: BLE001  datasets / hub errors come in many types
        msg = " ".join(str(e).split())[:300]
        offline = any(w in msg.lower() for w in ("offline", "connection", "resolve", "network", "couldn't reach",
                                                 "not found on the hub", "cannot find"))
        fix = ("it needs its dataset from the Hugging Face hub: run once where the hub is reachable (the datasets "
               "cache keeps it, HF_DATASETS_CACHE), or choose an offline suite such as --suite offline-smoke") \
            if offline else "check the task's config and data"
        raise TaskError(f"task {name}: cannot load it ({type(e).__name__}: {msg}); {fix}") from None
