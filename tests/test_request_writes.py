"""Only the scheduler (planning state) and the output processor (outputs, finish) write a Request: every other
module of the engine reads the frozen step plan or asks one of those two. Checked on the source: no assignment,
augmented assignment, deletion or in-place list / dict call on an attribute named like a Request field (through
any object but the module's own `self`) outside engine/scheduler/ and engine/output_processor.py."""

import ast
import dataclasses
from pathlib import Path

from deepinfer.scheduler.request import Request

ROOT = Path(__file__).resolve().parents[1]
WRITERS = ("engine/scheduler/", "engine/output_processor.py")
MUTATORS = ("append", "extend", "insert", "pop", "clear", "remove", "update", "setdefault", "sort", "reverse")
FIELDS = frozenset(f.name for f in dataclasses.fields(Request))


def _chain(node) -> tuple[str, list[str]]:
    """`s.request.metrics.x[0]` -> ("s", ["request", "metrics", "x"])."""
    attrs = []
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
        node = node.func if isinstance(node, ast.Call) else node.value
    return (node.id if isinstance(node, ast.Name) else type(node).__name__), attrs[::-1]


def _written(node) -> list:
    """The expressions `node` writes to."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
        targets = [node.func.value]
    else:
        return []
    flat = []
    for t in targets:
        flat += t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
    return [t for t in flat if isinstance(t, (ast.Attribute, ast.Subscript))]


def request_writes(source: str, name: str = "<snippet>") -> list[str]:
    """Writes to a Request field in `source`: `r.x = ...`, `req.x += ...`, `r.metrics.y = ...`, `del r.x[k:]`,
    `r.x.append(...)`; `self.x = ...` (an object's own attribute) is not one, `self.request.x = ...` is."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for target in _written(node):
            root, attrs = _chain(target)
            if root in ("self", "cls") and (not attrs or attrs[0] not in ("req", "request")):
                continue
            if any(a in FIELDS for a in attrs):
                found.append((node.lineno, f"{name}:{node.lineno}: {root}.{'.'.join(attrs)}"))
    return [line for _, line in sorted(found)]


def test_the_scan_finds_request_writes():
    snippet = """
r.num_computed = 0
req.output_ids += [1]
s.request.metrics.first_token_time = now
del r.output_ids[3:]
row.request.output_ids.append(7)
r.status, x = None, 1
self.request.finish_reason = "stop"
self.status = "mine"
out.tokens = tokens
rows = [s for s in plan]
"""
    assert [line.split(": ")[1] for line in request_writes(snippet)] == [
        "r.num_computed", "req.output_ids", "s.request.metrics.first_token_time", "r.output_ids",
        "row.request.output_ids", "r.status", "self.request.finish_reason"]


def test_only_the_scheduler_and_the_output_processor_write_a_request():
    bad = []
    for f in sorted((ROOT / "engine").rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if not rel.startswith(WRITERS):
            bad += request_writes(f.read_text(), rel)
    assert not bad, bad
