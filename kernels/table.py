"""Kernel tables: the functions of one backend set, op by op, and which table is in use.

    table = KernelTable("invariant")      # every op's invariant implementation, else its reference one
    with use(table):                      # ops dispatch through it inside
        model.forward(...)
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Callable

from . import registry
from .registry import BACKEND_SETS, KernelBackendError

__all__ = ["BACKEND_SETS", "KernelBackendError", "KernelTable", "active", "use"]


def _load_ops() -> None:
    """Import every op module so each has registered its backends."""
    from . import (attention, attention_triton, compress, experts, experts_triton, fp8_linear,  # noqa: F401
                   fake_quant, indexer, indexer_triton, kv_formats, matmul, mhc, mhc_rows_triton, mhc_triton,
                   matmul_triton, moe_combine, norm, norm_triton, quant_triton, rope, rope_triton, routing, rowwise,
                   sampling)


class KernelTable:
    """The functions of one backend set, op by op."""

    def __init__(self, name: str = "reference"):
        if name not in BACKEND_SETS:
            near = difflib.get_close_matches(str(name), BACKEND_SETS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise KernelBackendError(f"kernel backend {name!r} is not known{hint}; use one of {list(BACKEND_SETS)}")
        _load_ops()
        self.name = name
        self.fns: dict[str, Callable] = {}
        self.backends: dict[str, str] = {}
        for op, impls in sorted(registry._IMPLS.items()):
            chosen = next(b for b in (name,) + registry.FALLBACK[name] if b in impls)
            self.fns[op], self.backends[op] = impls[chosen], chosen

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
