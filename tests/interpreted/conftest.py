"""Tests of Triton kernels run by Triton's CPU interpreter: collected only when TRITON_INTERPRET=1 is set before
Triton is imported (tests/test_triton_interpreted.py runs this folder in a subprocess that way)."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="Triton interpreter tests: run by tests/test_triton_interpreted.py")
    for item in items:
        if "/interpreted/" in str(item.fspath):
            item.add_marker(skip)
