"""The op table's layout and laziness (kernels/registry.py, kernels/table.py).

1. Importing the package, the op table and every torch op module, and building a table of every backend set,
   imports no Triton and no `*_triton` module (a fresh process: other tests import them); the first call of an op
   through a Triton set imports that op's Triton module only.
2. Every path in the table names a function; each `*_triton` module pairs with a torch module of its name, no
   torch op module imports a Triton one, and the modules that are not ops are the few shared ones.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.kernels import registry
from deepinfer.kernels.table import BACKEND_SETS, KernelTable

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "kernels"
SHARED = {"__init__", "registry", "table", "gpu", "tiles", "precision", "quant", "quant_triton",   # not ops
          "experts_ogs", "experts_ogs_triton",        # grouped_experts' matmul_ogs path (its Triton set)
          "pdl", "pdl_triton"}                        # every Triton kernel's launch options and first statement

LAZY_CHECK = """
import sys
import deepinfer.kernels, deepinfer.kernels.registry as registry, deepinfer.kernels.table as table
import importlib
torch_modules = sorted({p.partition(":")[0] for impls in registry.OPS.values() for p in impls.values()
                        if not p.partition(":")[0].endswith("_triton")})
for name in torch_modules:
    importlib.import_module("deepinfer.kernels." + name)
for name in table.BACKEND_SETS:
    assert table.KernelTable(name).backends

def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] == "triton" or m.endswith("_triton"))

assert loaded() == [], loaded()
if registry.triton_installed():
    import torch
    from deepinfer.kernels.norm import rms_norm
    with table.use("triton"):
        rms_norm(torch.ones(2, 8), None, 1e-6)
    ours = [m for m in loaded() if m.startswith("deepinfer.")]
    assert ours == ["deepinfer.kernels.norm_triton", "deepinfer.kernels.pdl_triton"], ours   # + its first statement
print("ok")
"""


def test_importing_the_op_table_imports_no_triton():
    run = subprocess.run([sys.executable, "-c", LAZY_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-3000:]


def test_every_path_names_a_function():
    pytest.importorskip("triton")
    for op, impls in registry.OPS.items():
        assert set(impls) <= set(BACKEND_SETS), op
        for backend, path in impls.items():
            assert callable(registry.load(path)), (op, backend, path)
    assert all("reference" in impls for impls in registry.OPS.values())


def test_triton_invariant_runs_the_dense_gemms_on_the_expert_kernel():
    """kernels/matmul_triton.py passed its GPU gate (docs/results.md): the invariant set's Triton partner takes `linear`
    and `grouped_linear` from it; the plain `invariant` set keeps its cuBLAS row tiles."""
    pytest.importorskip("triton")
    triton_inv, inv = KernelTable("triton_invariant"), KernelTable("invariant")
    for op in ("linear", "grouped_linear"):
        assert triton_inv.backends[op] == "triton_invariant" and triton_inv.fns.paths[op].startswith("matmul_triton:")
        assert inv.backends[op] == "invariant"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names |= {node.module} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deepinfer.kernels."):
            names.add(node.module.rpartition(".")[2])
        elif isinstance(node, ast.Import):
            names |= {a.name.rpartition(".")[2] for a in node.names if a.name.startswith("deepinfer.kernels.")}
    return names


def _imports_triton(path: Path) -> bool:
    """Whether the module imports triton when it is imported (a function may, when it is called)."""
    todo, found = list(ast.parse(path.read_text()).body), False
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        found |= isinstance(node, ast.Import) and any(a.name.split(".")[0] == "triton" for a in node.names)
        found |= isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("triton")
        todo.extend(ast.iter_child_nodes(node))
    return found


def test_one_pairing_rule():
    modules = {p.stem for p in KERNELS.glob("*.py")}
    op_modules = {p.partition(":")[0] for impls in registry.OPS.values() for p in impls.values()}
    assert modules == op_modules | SHARED, sorted(modules ^ (op_modules | SHARED))
    for name in modules:
        if name.endswith("_triton"):
            assert name.removesuffix("_triton") in modules, name
            continue
        triton_imports = {m for m in _imports(KERNELS / f"{name}.py") if m.endswith("_triton")}
        assert not triton_imports, (name, triton_imports)
        assert not _imports_triton(KERNELS / f"{name}.py"), name
    for impls in registry.OPS.values():
        for backend, path in impls.items():
            if backend in ("reference", "invariant"):
                assert not path.partition(":")[0].endswith("_triton"), path
