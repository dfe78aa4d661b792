"""Eval suites: `eval/suites/*.yaml` -> a validated, frozen `Suite` (schema in docs/eval.md).

    suite = load_suite("offline-smoke")          # a name under eval/suites/, or a path to a YAML file
    suite.tasks                                  # (TaskSpec(name, num_fewshot, overrides), ...)

Every problem is one `SuiteError` line naming the file, the key path and what is allowed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import MappingProxyType
from typing import Any

from deepinfer.errors import DeepInferError
from deepinfer.harness.sweep_config import DTYPES, NAME_RE, Validator, doubling_ladder, read_yaml_file

SUITES_DIR = Path(__file__).resolve().parent / "suites"
TOP_KEYS = ("name", "description", "model", "device", "dtype", "engine_args", "tasks", "limit", "concurrency",
            "seed", "apply_chat_template", "batch_invariant", "thresholds", "agreement")
REQUIRED_KEYS = ("name", "model", "tasks")
CONCURRENCY_WORDS = ("max", "median")
BOUND_KEYS = ("min", "max")
# metrics that are fractions in [0, 1] (lm-eval's names before the filter): a bound on one that every value in
# [0, 1] meets (e.g. acc >= 0) cannot fail, so a suite may not hold one
FRACTION_METRICS = ("acc", "acc_norm", "exact_match", "pass@1", "f1", "agreement", "json_valid", "field_match")


class SuiteError(DeepInferError, ValueError):
    """A suite is missing, malformed or out of range (one line)."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    name: str                          # an offline task (eval/tasks/*.yaml) or any lm-eval task / group
    num_fewshot: int | None = None     # None: the task's own default
    overrides: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))  # task config


@dataclasses.dataclass(frozen=True)
class Bound:
    min: float | None = None
    max: float | None = None

    def holds(self, value: float | None) -> bool:
        if value is None or value != value:           # a missing or NaN metric never passes
            return False
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def __str__(self) -> str:
        return " and ".join(s for s in (f">= {self.min:g}" if self.min is not None else "",
                                        f"<= {self.max:g}" if self.max is not None else "") if s)


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    model: str
    tasks: tuple[TaskSpec, ...]
    description: str = ""
    device: str = "cpu"
    dtype: str = "float32"
    engine_args: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    limit: int | None = None                           # samples per task (None: all)
    concurrency: tuple = ("max",)                      # ints and/or "max" / "median"
    seed: int = 1234
    apply_chat_template: bool = False
    batch_invariant: bool = False
    # task -> {metric: Bound}
    thresholds: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    agreement: Bound | None = None                     # per-sample agreement between concurrencies
    source: str = "<dict>"

    def concurrencies(self, max_num_seqs: int) -> list[int]:
        """The suite's concurrency entries as numbers (duplicates dropped, order kept): max = max_num_seqs,
        median = the middle of the doubling ladder 1, 2, 4, ..., max_num_seqs."""
        ladder = doubling_ladder(1, max_num_seqs)
        out = []
        for c in self.concurrency:
            n = max_num_seqs if c == "max" else ladder[len(ladder) // 2] if c == "median" else c
            if n > max_num_seqs:
                raise SuiteError(f"{self.source}: concurrency {n} exceeds engine max_num_seqs ({max_num_seqs})")
            if n not in out:
                out.append(n)
        return out

    def to_dict(self) -> dict:
        return {"name": self.name, "description": self.description, "model": self.model, "device": self.device,
                "dtype": self.dtype, "engine_args": dict(self.engine_args),
                "tasks": [{"task": t.name, **({"num_fewshot": t.num_fewshot} if t.num_fewshot is not None else {}),
                           **dict(t.overrides)} for t in self.tasks],
                "limit": self.limit, "concurrency": list(self.concurrency), "seed": self.seed,
                "apply_chat_template": self.apply_chat_template, "batch_invariant": self.batch_invariant,
                "thresholds": {t: {m: _bound_dict(b) for m, b in ms.items()} for t, ms in self.thresholds.items()},
                "agreement": None if self.agreement is None else _bound_dict(self.agreement)}


def _bound_dict(b: Bound) -> dict:
    return {k: v for k, v in (("min", b.min), ("max", b.max)) if v is not None}


def suite_names() -> list[str]:
    return sorted(p.stem for p in SUITES_DIR.glob("*.yaml"))


def load_suite(name_or_path: str | Path) -> Suite:
    """A suite by name (eval/suites/NAME.yaml) or by path."""
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = SUITES_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise SuiteError(f"unknown suite {str(name_or_path)!r}; suites: {', '.join(suite_names())} "
                             f"(or pass a path to a suite YAML file)")
    data = read_yaml_file(path, "suite", SuiteError, f"suites: {', '.join(suite_names())}")
    return parse_suite(data, str(path))


def parse_suite(data: Any, source: str = "<dict>") -> Suite:
    v = Validator(source, SuiteError)
    if not isinstance(data, dict):
        raise v.error(None, f"a suite is a mapping of keys ({', '.join(TOP_KEYS)})")
    v.keys(data, None, TOP_KEYS, REQUIRED_KEYS)
    name = v.string(data["name"], "name")
    if not NAME_RE.match(name):
        raise v.error("name", f"got {name!r}; allowed: letters, digits, '.', '_', '-'")
    tasks = _tasks(v, data["tasks"])
    known = {t.name for t in tasks}
    limit = data.get("limit")
    return Suite(
        name=name, model=v.model(data["model"], "model"), tasks=tasks,
        description=str(data.get("description", "")),
        device=v.device(data.get("device", "cpu"), "device"),
        dtype=v.choice(data.get("dtype", "float32"), "dtype", DTYPES),
        engine_args=MappingProxyType(v.engine_args(data.get("engine_args", {}), "engine_args")),
        limit=None if limit is None else v.integer(limit, "limit", 1),
        concurrency=_concurrency(v, data.get("concurrency", ["max"])),
        seed=v.integer(data.get("seed", 1234), "seed", 0),
        apply_chat_template=_bool(v, data.get("apply_chat_template", False), "apply_chat_template"),
        batch_invariant=_bool(v, data.get("batch_invariant", False), "batch_invariant"),
        thresholds=MappingProxyType(_thresholds(v, data.get("thresholds", {}), known)),
        agreement=None if data.get("agreement") is None else _fraction_bound(v, data["agreement"], "agreement",
                                                                               "agreement"),
        source=source)


def _bool(v: Validator, x: Any, path: str) -> bool:
    if not isinstance(x, bool):
        raise v.error(path, f"must be true or false, got {x!r}")
    return x


def _tasks(v: Validator, x: Any) -> tuple[TaskSpec, ...]:
    if not isinstance(x, list) or not x:
        raise v.error("tasks", "must be a non-empty list of task names or {task: NAME, num_fewshot: K, ...} mappings")
    out: list[TaskSpec] = []
    for i, item in enumerate(x):
        p = f"tasks[{i}]"
        if isinstance(item, str):
            item = {"task": item}
        if not isinstance(item, dict) or not isinstance(item.get("task"), str) or not item["task"].strip():
            raise v.error(p, "must be a task name or a mapping with a 'task' name (other keys: num_fewshot, and "
                             "lm-eval task config overrides such as filter_list or generation_kwargs)")
        fewshot = item.get("num_fewshot")
        if fewshot is not None:
            v.integer(fewshot, f"{p}.num_fewshot", 0)
        overrides = {k: val for k, val in item.items() if k not in ("task", "num_fewshot")}
        spec = TaskSpec(item["task"], fewshot, MappingProxyType(overrides))
        if any(t.name == spec.name for t in out):
            raise v.error(p, f"task {spec.name!r} is listed twice")
        out.append(spec)
    return tuple(out)


def _concurrency(v: Validator, x: Any) -> tuple:
    items = x if isinstance(x, list) else [x]
    if not items:
        raise v.error("concurrency", "empty; give integers >= 1 and/or 'max', 'median'")
    out = []
    for i, c in enumerate(items):
        if isinstance(c, str):
            out.append(v.choice(c, f"concurrency[{i}]", CONCURRENCY_WORDS))
        else:
            out.append(v.integer(c, f"concurrency[{i}]", 1))
        if out[-1] in out[:-1]:
            raise v.error(f"concurrency[{i}]", f"{out[-1]!r} is listed twice; give each concurrency once")
    return tuple(out)


def _bound(v: Validator, x: Any, path: str) -> Bound:
    d = v.mapping(x, path, "min and/or max")
    v.keys(d, path, BOUND_KEYS)
    if not d:
        raise v.error(path, "give min and/or max")
    for k, val in d.items():
        if isinstance(val, bool) or not isinstance(val, (int, float)) or val != val:
            raise v.error(f"{path}.{k}", f"must be a number, got {val!r}")
    if "min" in d and "max" in d and d["min"] > d["max"]:
        raise v.error(path, f"min {d['min']:g} > max {d['max']:g}: no value can hold; swap or fix them")
    return Bound(d.get("min"), d.get("max"))


def _fraction_bound(v: Validator, x: Any, path: str, metric: str) -> Bound:
    """A bound; on a fraction metric (FRACTION_METRICS) it must be one that some value in [0, 1] misses."""
    bound = _bound(v, x, path)
    if metric.split(",")[0] in FRACTION_METRICS and (bound.min is None or bound.min <= 0) and \
            (bound.max is None or bound.max >= 1):
        raise v.error(path, f"{bound} holds for every value of {metric} (0..1), so it can never fail; tighten it "
                            f"or drop it")
    if metric.split(",")[0] in FRACTION_METRICS and ((bound.min is not None and bound.min > 1) or
                                                     (bound.max is not None and bound.max < 0)):
        raise v.error(path, f"{bound} holds for no value of {metric} (0..1), so it always fails; fix it")
    return bound


def _thresholds(v: Validator, x: Any, known: set[str]) -> dict:
    d = v.mapping(x, "thresholds", "task -> {metric: {min, max}}")
    out = {}
    for task, metrics in d.items():
        p = f"thresholds.{task}"
        if task not in known:
            raise v.error(p, f"not one of the suite's tasks ({', '.join(sorted(known))})")
        ms = v.mapping(metrics, p, "metric -> {min, max}; metric as lm-eval names it, e.g. 'acc' or "
                                   "'exact_match,strict-match'")
        out[task] = MappingProxyType({metric_key(m): _fraction_bound(v, b, f"{p}.{m}", m) for m, b in ms.items()})
    return out


def metric_key(name: str) -> str:
    """lm-eval's result key: 'metric,filter' ('acc' -> 'acc,none')."""
    return name if "," in name else f"{name},none"
