"""The house's walls: kernels/ imports nothing of the engine; cache/, runner/ and scheduler/ know the model only
through its state spec and forward (no model-type names)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append("." * node.level + (node.module or ""))
    return names


def test_kernels_import_nothing_of_the_engine():
    bad = []
    for f in sorted((ROOT / "kernels").glob("*.py")):
        for name in _imports(f):
            if name.startswith("..") or (name.startswith("deepinfer") and not name.startswith("deepinfer.kernels")):
                bad.append(f"{f.name}: {name}")
    assert not bad, bad


def test_cache_runner_scheduler_name_no_model_type():
    pattern = re.compile(r"deepseek_v4|deepseek_v41|model_type|DeepseekV4|V41|\bv41\b", re.IGNORECASE)
    bad = []
    for room in ("cache", "runner", "scheduler"):
        for f in sorted((ROOT / "engine" / room).glob("*.py")):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                if pattern.search(line):
                    bad.append(f"{room}/{f.name}:{i}: {line.strip()}")
    assert not bad, bad


def test_model_code_has_no_mode_flags():
    """Models call ops; which backend runs them is the engine's choice, never a branch in model code."""
    bad = []
    for f in sorted((ROOT / "engine" / "models").glob("*.py")):
        text = f.read_text()
        for word in ("is_batch_invariant", "row_tiles", "active()", "threading.local", "DEEPINFER_"):
            if word in text:
                bad.append(f"{f.name}: {word}")
    assert not bad, bad
