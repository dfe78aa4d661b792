"""Tests of Triton kernels run by Triton's CPU interpreter: collected only when TRITON_INTERPRET=1 is set before
Triton is imported (tests/test_triton_interpreted.py runs this folder in a subprocess that way). There the
interpreter's tl.dot is replaced by an order-fixed one (tests/interpreter_dot.py), so the bitwise claims below check
the kernels' tile structure and not the host BLAS."""

import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.interpreter_dot import install as _install_order_fixed_dot

    _install_order_fixed_dot()


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="Triton interpreter tests: run by tests/test_triton_interpreted.py")
    for item in items:
        if "/interpreted/" in str(item.fspath):
            item.add_marker(skip)
