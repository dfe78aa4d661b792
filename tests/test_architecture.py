"""docs/architecture.md's claims hold: each names the test that enforces it (those tests exist), every path the
page names exists, every room of the engine is on it, and the claims without a home elsewhere are tested here."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
CODE_ROOMS = ("engine", "kernels", "harness", "eval")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 600, 80


def _doc() -> str:
    return DOC.read_text()


def _claims() -> list[tuple[str, str]]:
    """(claim, 'tests/x.py::test_y') of the page's last table."""
    section = _doc().split("## Claims and the tests that enforce them", 1)[1]
    rows = re.findall(r"^\| (.+?) \| `(tests/[\w/]+\.py::\w+)` \|$", section, re.M)
    return rows


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


def test_every_claim_names_an_existing_test():
    claims = _claims()
    assert len(claims) >= 15, claims         # the table parsed (a format change would otherwise pass vacuously)
    missing = [ref for _, ref in claims
               if not (ROOT / ref.split("::")[0]).is_file()
               or ref.split("::")[1] not in _test_names(ROOT / ref.split("::")[0])]
    assert not missing, missing


def test_every_path_on_the_page_exists():
    paths = set(re.findall(r"`((?:engine|kernels|harness|eval|tests|docs)/[\w/.]*)`", _doc()))
    assert len(paths) > 20, paths
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, missing


def test_every_room_is_named():
    """Every package folder and top-level module of engine/ is named on the page, as is every code room."""
    text = _doc()
    rooms = [f"engine/{p.name}/" for p in sorted((ROOT / "engine").iterdir())
             if p.is_dir() and (p / "__init__.py").exists()]
    rooms += [f"engine/{p.name}" for p in sorted((ROOT / "engine").glob("*.py")) if p.name != "__init__.py"]
    rooms += [f"{r}/" for r in CODE_ROOMS if r != "engine"]
    missing = [r for r in rooms if f"`{r}`" not in text]
    assert not missing, missing


def _code_files():
    for room in CODE_ROOMS:
        yield from sorted((ROOT / room).rglob("*.py"))


def test_module_and_function_sizes():
    long_modules, long_functions = [], []
    for f in _code_files():
        text = f.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append(f"{f.relative_to(ROOT)}: {text.count(chr(10))}")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{f.relative_to(ROOT)}:{node.lineno} {node.name}: {n}")
    assert not long_modules, long_modules
    assert not long_functions, long_functions


# ---- the model contract ----
@pytest.mark.parametrize("family", ["deepseek_v4", "deepseek_v41"])
def test_both_families_satisfy_the_model_contract(family):
    from deepinfer.api import resolve_model
    from deepinfer.cache.forward_batch import ForwardBatch
    from deepinfer.models.base import CausalLM, Drafting
    from tests.pooled_helpers import PooledSequences
    model = resolve_model(f"random:{family}:tiny:2", "cpu", "float32")
    assert isinstance(model, CausalLM)
    assert model.drafting is None or isinstance(model.drafting, Drafting)
    seqs = PooledSequences(model, num_slots=1, max_len=64)
    ids = torch.tensor([3, 5, 7, 11, 2])
    with torch.inference_mode():
        hidden = model.forward(ids, ForwardBatch.ragged(seqs.pools, [1], [0], [5], seqs.ctx_blocks(4)))
        assert hidden.shape == (5, model.cfg.hidden_size)
        assert model.logits(hidden[-1:]).shape == (1, model.cfg.vocab_size)


# ---- the step ----
def test_the_plan_is_frozen_and_requests_hold_no_drafts():
    from deepinfer.scheduler.plan import ScheduledRow, StepPlan
    from deepinfer.scheduler.request import Request
    for cls in (StepPlan, ScheduledRow):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, cls
    plan = StepPlan(())
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rows = ()
    fields = {f.name for f in dataclasses.fields(Request)}
    assert not {f for f in fields if "draft" in f or "spec" in f}, fields


def _calls_in(func: ast.FunctionDef) -> list[str]:
    """The calls in func, in source order."""
    calls = sorted((n.lineno, n.col_offset, ast.unparse(n.func)) for n in ast.walk(func) if isinstance(n, ast.Call))
    return [name for _, _, name in calls]


def _function(path: Path, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{path}: no {cls}.{name}")


def test_step_is_plan_run_apply():
    core = ROOT / "engine" / "core.py"
    step = _function(core, "EngineCore", "step")
    calls = [c for c in _calls_in(step) if c in ("self._plan", "self._run", "self._apply")]
    assert calls[calls.index("self._plan"):calls.index("self._plan") + 2] == ["self._plan", "self._run"], calls
    assert "self.speculation.plan" in _calls_in(_function(core, "EngineCore", "_plan"))
    assert "self.speculation.apply" in _calls_in(_function(core, "EngineCore", "_apply"))
    # nobody else calls Speculation's plan / apply
    others = [f for f in (ROOT / "engine").rglob("*.py") if f != core]
    bad = [f"{f.relative_to(ROOT)}" for f in others
           if re.search(r"\bspeculation\.(plan|apply)\(", f.read_text())]
    assert not bad, bad


def _calls_matching(pattern: str, files) -> list[str]:
    rx = re.compile(pattern)
    hits = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and rx.fullmatch(ast.unparse(node.func)):
                hits.append(str(f.relative_to(ROOT)))
    return hits


def test_only_the_runner_builds_a_step():
    files = [f for room in ("engine", "harness", "eval") for f in sorted((ROOT / room).rglob("*.py"))
             if not f.is_relative_to(ROOT / "engine" / "reference")]
    hits = set(_calls_matching(r"ForwardBatch(\.\w+)?", files))
    allowed = {"engine/runner/runner.py",            # execute / run_shape, and the graphs' static step
               "engine/cache/forward_batch.py",      # its own sub-batches (truncated prefill)
               "engine/models/deepseek_v4/mtp.py"}   # the model's draft steps, inside model.draft
    assert "engine/runner/runner.py" in hits, hits   # the scan sees the real builder
    assert hits <= allowed, hits - allowed


def test_one_graph_capture_helper():
    files = [f for room in ("engine",) for f in sorted((ROOT / room).rglob("*.py"))]
    hits = _calls_matching(r"torch\.cuda\.graph", files)
    assert hits == ["engine/runner/graphs.py"], hits


def test_one_row_identity():
    files = [f for room in ("harness", "eval") for f in sorted((ROOT / room).rglob("*.py"))]
    hits = [str(f.relative_to(ROOT)) for f in files if '"schema_version":' in f.read_text()
            or "'schema_version':" in f.read_text()]
    assert hits == ["harness/rows.py"], hits


HISTORY = re.compile(r"\b(session|issue|sessions|issues) \d+", re.IGNORECASE)


def test_no_run_history_in_code():
    """Code comments and docstrings say why, not when: past work periods belong in docs/results.md."""
    hits = [f"{f.relative_to(ROOT)}:{i}" for f in _code_files()
            for i, line in enumerate(f.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not hits, hits
    assert HISTORY.search("# fixed in session 22") and not HISTORY.search("# the session's budget")
