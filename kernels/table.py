"""Kernel tables: the functions of one backend set, op by op, and which table is in use.

    table = KernelTable("invariant")      # every op's invariant implementation, else its reference one
    with use(table):                      # ops dispatch through it inside
        model.forward(...)

Building a table only chooses a path per op (kernels/registry.py OPS); each function is imported when the op is
first called through the table.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Callable

from . import registry
from .registry import BACKEND_SETS, KernelBackendError

__all__ = ["BACKEND_SETS", "KernelBackendError", "KernelTable", "active", "use"]


class _LazyFunctions(dict):
    """op -> function, each loaded from its path on first lookup, then a plain dict entry."""

    def __init__(self, paths: dict[str, str]):
        super().__init__()
        self.paths = paths

    def __missing__(self, op: str) -> Callable:
        fn = self[op] = registry.load(self.paths[op])
        return fn


class KernelTable:
    """The functions of one backend set, op by op."""

    def __init__(self, name: str = "reference"):
        if name not in BACKEND_SETS:
            near = difflib.get_close_matches(str(name), BACKEND_SETS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise KernelBackendError(f"kernel backend {name!r} is not known{hint}; use one of {list(BACKEND_SETS)}")
        self.name = name
        self.backends: dict[str, str] = {}       # op -> the backend set whose implementation it runs
        paths: dict[str, str] = {}
        for op in sorted(registry.OPS):
            impls = registry.implemented(op)
            chosen = next(b for b in (name,) + registry.FALLBACK[name] if b in impls)
            paths[op], self.backends[op] = impls[chosen], chosen
        self.fns: dict[str, Callable] = _LazyFunctions(paths)

    @property
    def invariant(self) -> bool:
        """Whether this set is a batch-invariant one (the engine then also fixes decode shapes and chunk grids)."""
        return registry.INVARIANT_OF[self.name] == self.name

    def __repr__(self) -> str:
        return f"KernelTable({self.name!r})"


_REFERENCE: KernelTable | None = None


def active() -> KernelTable:
    """The table ops dispatch through now (the reference one while no engine has set one)."""
    global _REFERENCE
    if registry._active is not None:
        return registry._active
    if _REFERENCE is None:
        _REFERENCE = KernelTable("reference")
    return _REFERENCE


@contextlib.contextmanager
def use(table: KernelTable | str):
    """Inside: ops dispatch through `table` (a KernelTable or a backend-set name); the previous one after."""
    if isinstance(table, str):
        table = KernelTable(table)
    before, registry._active = registry._active, table
    try:
        yield table
    finally:
        registry._active = before
