"""The house's walls: kernels/ imports nothing of the engine; the runtime (cache/, runner/, scheduler/, parallel/,
speculative/, the engine core, the API) and the entry points' checks (validate.py) know the model only through its
contract (models/base.py: state spec, forward, logits, declared drafting; no model-type or drafter names, no
attribute probing of a model); the oracle (engine/reference/) is imported only by the checkpoint tools among the
package's modules; the package has no import cycle; and the harness and eval never branch on a model type."""

import ast
import re
import tomllib
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


def _lines(paths, pattern):
    for f in paths:
        where = f.relative_to(ROOT) if f.is_relative_to(ROOT) else f
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if pattern.search(line):
                yield f"{where}:{i}: {line.strip()}"


MODEL_NAMES = re.compile(r"deepseek_v4|deepseek_v41|model_type|DeepseekV4|V41|\bv41\b|\bdspark|\bmtp\b|\bengram|\bcsa",
                         re.IGNORECASE)
RUNTIME_ROOMS = ("cache", "runner", "scheduler", "parallel", "speculative")
RUNTIME_FILES = ("core.py", "llm.py", "output_processor.py", "stats.py", "validate.py")


def test_runtime_names_no_model_type():
    engine = ROOT / "engine"
    files = [f for room in RUNTIME_ROOMS for f in sorted((engine / room).glob("*.py"))]
    files += [engine / name for name in RUNTIME_FILES]
    bad = list(_lines(files, MODEL_NAMES))
    assert not bad, bad


def test_model_names_scan_can_fail(tmp_path):
    """Every family's, drafter's and attention kind's name trips the scan above; a neutral line does not."""
    sample = tmp_path / "room.py"
    for line in ("x = 'deepseek_v41'", "if method == 'dspark':", "n = 1  # the MTP layer", "engram_ids = 1",
                 "kind = 'CSA'", "cfg.model_type", "class DeepseekV4Config:"):
        sample.write_text(line + "\n")
        assert len(list(_lines([sample], MODEL_NAMES))) == 1, line
    sample.write_text("drafting = model.drafting  # DEEPINFER_ENABLE_MTP_VARLEN\n")
    assert not list(_lines([sample], MODEL_NAMES))


def test_harness_never_branches_on_a_model_type():
    """Model names appear as data (random:deepseek_v4:..., sweep files); what differs per family is the config's or
    the model's to say (e.g. DeepseekV4Config.attention_layout). eval's transformers cross-check is V4-only: the
    one reference transformers ships."""
    pattern = re.compile(r"model_type\s*(==|!=|\bin\b)")
    files = sorted((ROOT / "harness").glob("*.py")) + sorted((ROOT / "eval").glob("*.py"))
    allowed = "eval/run.py"          # the --reference transformers check: it refuses a V4.1 checkpoint
    bad = [line for line in _lines(files, pattern) if not line.startswith(allowed)]
    assert not bad, bad


def test_model_code_has_no_mode_flags():
    """Models call ops; which backend runs them is the engine's choice, never a branch in model code."""
    bad = []
    for f in sorted((ROOT / "engine" / "models").rglob("*.py")):
        text = f.read_text()
        for word in ("is_batch_invariant", "row_tiles", "active()", "threading.local", "DEEPINFER_"):
            if word in text:
                bad.append(f"{f.relative_to(ROOT)}: {word}")
    assert not bad, bad


# ---- no attribute probing of a model ----
PROBE = re.compile(r"\b(getattr|hasattr)\(\s*[\w.]*\bmodel\b")


def _python_files(*rooms: str) -> list[Path]:
    return [f for room in rooms for f in sorted((ROOT / room).rglob("*.py"))]


def test_nothing_probes_a_model_outside_models():
    """What a model has is declared (models/base.py: `drafting`, `checkpoint_dir`, ...), never found out by
    getattr / hasattr on it."""
    files = [f for f in _python_files("engine", "harness", "eval") if not f.is_relative_to(ROOT / "engine" / "models")]
    bad = list(_lines(files, PROBE))
    assert not bad, bad


def test_probe_scan_can_fail(tmp_path):
    sample = tmp_path / "x.py"
    for line in ('n = getattr(self.model, "draft_block_size", None)', 'if hasattr(model, "mtp"):',
                 'd = getattr(llm.model.cfg, "torch_dtype", None)'):
        sample.write_text(line + "\n")
        assert len(list(_lines([sample], PROBE))) == 1, line
    sample.write_text('s = getattr(runner, "graphs", None)\n')
    assert not list(_lines([sample], PROBE))


# ---- the oracle stays out of the product ----
def test_reference_is_imported_only_by_checkpoint_tools():
    """engine/reference/ (the per-sequence oracle) is for tests and tools: among the package's modules only
    checkpoint/routers.py (router calibration of random models) imports it."""
    modules = _package_modules()
    graph = import_graph(modules)
    allowed = {"deepinfer.checkpoint.routers"}
    bad = sorted(m for m, targets in graph.items() if not m.startswith("deepinfer.reference")
                 and m not in allowed and any(t.startswith("deepinfer.reference") for t in targets))
    assert not bad, bad


# ---- no import cycles (AST only: nothing is imported) ----
def _package_modules() -> dict[str, Path]:
    """deepinfer's module names -> files, from pyproject's package-dir (deepinfer -> engine/, ...)."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return modules_under({pkg: ROOT / d for pkg, d in dirs.items()})


def modules_under(package_dirs: dict[str, Path]) -> dict[str, Path]:
    """{package name: its directory} -> {module name: file} for every .py below (a package is its __init__.py).
    A directory mapped to a package of its own (deepinfer.kernels) is named by that mapping, not by its parent's."""
    modules = {}
    owned = {d.resolve(): pkg for pkg, d in package_dirs.items()}
    for pkg, d in package_dirs.items():
        for f in sorted(d.rglob("*.py")):
            parts = f.relative_to(d).with_suffix("").parts
            if any(p.startswith(".") for p in parts) or any((d / Path(*parts[:i])).resolve() in owned and i
                                                             for i in range(1, len(parts))):
                continue
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            modules[".".join((pkg,) + parts)] = f
    return modules


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, (ast.Name, ast.Attribute)) and "TYPE_CHECKING" in ast.unparse(node.test)


def _import_nodes(tree: ast.AST):
    """Every import statement, at module level or inside a function (a deferred import is still an edge), except
    those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of `modules` it imports. `from p import x` is an edge to p.x when that is a module,
    else to p; importing a.b.c is an edge to a.b.c (the parents' __init__ run too, but are not its dependency)."""
    graph = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        package = name if is_pkg else name.rpartition(".")[0]
        targets = set()
        for node in _import_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
                continue
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = (f"{base}.{node.module}" if node.level and node.module else base) if node.level else node.module
            for a in node.names:
                targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_package_has_no_import_cycle():
    found = cycles(import_graph(_package_modules()))
    assert not found, found


def test_cycle_finder_finds_a_cycle_in_a_synthetic_package(tmp_path):
    """A deferred import closes a cycle as surely as a top-level one; a TYPE_CHECKING import does not."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import B\n")
    (pkg / "a.py").write_text("from .sub import b\n\ndef f():\n    return b.B\n")
    (pkg / "sub" / "b.py").write_text("class B:\n    def g(self):\n        from ..a import f\n        return f\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import f\n")
    (pkg / "d.py").write_text("import pkg.c\n")
    graph = import_graph(modules_under({"pkg": pkg}))
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.c"] == set() and graph["pkg.d"] == {"pkg.c"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b"]]
    (pkg / "sub" / "b.py").write_text("class B:\n    pass\n")
    assert cycles(import_graph(modules_under({"pkg": pkg}))) == []


def test_every_family_declares_a_known_draft_method():
    """`speculative=` names a drafter from models/base.py's DRAFT_METHODS: each family's config says its own, and
    every name there belongs to a family (the runtime reads the tuple, never a family's name)."""
    from deepinfer.config import CONFIG_CLASSES
    from deepinfer.models.base import DRAFT_METHODS
    declared = {cls.DRAFT_METHOD for cls in CONFIG_CLASSES.values()}
    assert declared == set(DRAFT_METHODS), (declared, DRAFT_METHODS)
