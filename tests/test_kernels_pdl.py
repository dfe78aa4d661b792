"""Programmatic dependent launch (kernels/pdl.py, kernels/pdl_triton.py): every Triton kernel of kernels/ waits for
its predecessor before anything else, and every launch passes the PDL options, so a kernel placed early never reads
an input before it is written. Checked from the source (no GPU), and in the sm_90 PTX."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from deepinfer.kernels import pdl as pdl_module
from deepinfer.kernels.pdl import pdl

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def _jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
            and any("jit" in ast.unparse(d) for d in n.decorator_list)}


def _launches(tree: ast.Module, jit: set[str]) -> list[ast.Call]:
    """kernel[grid](...) calls of a jit function of the module."""
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Subscript)
            and isinstance(n.func.value, ast.Name) and n.func.value.id in jit]


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value,
                                                                                                   str):
        body = body[1:]
    return body[0]


def test_every_launched_kernel_waits_first_and_every_launch_passes_the_options():
    launched, sites = set(), 0
    for path in sorted(KERNELS.glob("*_triton.py")):
        tree = ast.parse(path.read_text())
        jit = _jit_functions(tree)
        for call in _launches(tree, set(jit)):
            name = call.func.value.id
            launched.add((path.name, name))
            sites += 1
            options = [k for k in call.keywords if k.arg is None and isinstance(k.value, ast.Call)
                       and ast.unparse(k.value.func) == "pdl"]
            assert len(options) == 1, f"{path.name}:{call.lineno} launches {name} without **pdl(tensor.device)"
            fn = jit[name]
            assert "PDL" in [a.arg for a in fn.args.args], f"{path.name}: {name} takes no PDL constexpr"
            first = _first_statement(fn)
            assert ast.unparse(first) == "await_inputs(PDL)", f"{path.name}: {name} starts with {ast.unparse(first)}"
    assert len(launched) >= 27 and sites >= 28, (len(launched), sites)     # the census: would shrink if one lost


def test_the_options_are_off_off_cuda_and_when_switched_off(monkeypatch):
    assert pdl("cpu") == {"PDL": False}
    assert pdl(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl_module, "_PDL", False)
    assert pdl("cuda") == {"PDL": False}            # switched off: no CUDA call is made


def test_every_entry_point_sets_the_switch_from_the_environment(monkeypatch):
    """check_environment (run by LLM, load_model and the CLIs) sets the kernels' switch from DEEPINFER_PDL:
    unset and 0 are off, 1 is on, and Triton's interpreter keeps it off."""
    from deepinfer.env import check_environment
    monkeypatch.setattr(pdl_module, "_PDL", False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for value, on in (("", False), ("0", False), ("1", True), ("0", False)):
        monkeypatch.setenv("DEEPINFER_PDL", value)
        check_environment()
        assert pdl_module._PDL is on, value
    monkeypatch.setenv("DEEPINFER_PDL", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_environment()
    assert pdl_module._PDL is False


def test_sm90_ptx_holds_the_wait_only_under_pdl():
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from deepinfer.kernels import norm_triton

    if norm_triton.INTERPRETED or norm_triton.triton is None:
        pytest.skip("needs triton, compiled (not interpreted)")
    runtime = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "rows": "i32", "n": "i32", "eps": "fp32"}
    ptx = {}
    for on in (True, False):
        consts = dict(HAS_W=True, BLOCK_R=1, BLOCK_N=4096, PDL=on)
        signature = {**runtime, **{name: "constexpr" for name in consts}}
        src = ASTSource(norm_triton._rms_norm_kernel, signature, constexprs=consts)
        ptx[on] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert "griddepcontrol.wait" in ptx[True] and "griddepcontrol.launch_dependents" in ptx[True]
    assert "griddepcontrol" not in ptx[False]
    wait, load = ptx[True].index("griddepcontrol.wait"), ptx[True].index("ld.global")
    assert wait < load, "the kernel reads its input before waiting for its predecessor"
