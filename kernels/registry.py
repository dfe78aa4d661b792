"""The op table: one entry point per op, named backends behind it, one backend set chosen per engine.

Each op module registers its implementations with `@implements(op, backend)`; an op's entry point (e.g.
`kernels.matmul.linear`) calls whatever the *active* table maps it to. A table is built from a backend-set
name once, when the engine is built (`LLM(kernel_backend=...)`), and made active around each forward
(`use(table)`), so model code calls ops and never asks which mode it runs in.

Backend sets:
  reference   plain torch, the oracle every other backend is checked against
  invariant   fixed reduction order: every row-mixing op runs on fixed tiles of rows (kernels/tiles.py), so a
              row's bits do not depend on what shares its batch (DEEPINFER_BATCH_INVARIANT=1 selects it)
An op without an implementation in the chosen set runs its `reference` one (a set lists what it overrides);
`KernelTable.backends` records the choice per op, which result rows carry.
"""

from __future__ import annotations

import contextlib
import difflib
from typing import Callable

_IMPLS: dict[str, dict[str, Callable]] = {}      # op -> backend -> function
BACKEND_SETS = ("reference", "invariant")


class KernelBackendError(ValueError):
    """An unknown backend-set name (the engine turns it into one error line)."""


def implements(op: str, backend: str):
    """Register `fn` as op's implementation in `backend`."""
    if backend not in BACKEND_SETS:
        raise KernelBackendError(f"unknown backend {backend!r} for op {op!r}")

    def register(fn: Callable) -> Callable:
        impls = _IMPLS.setdefault(op, {})
        if backend in impls:
            raise KernelBackendError(f"op {op!r} already has a {backend!r} implementation")
        impls[backend] = fn
        return fn
    return register


def _load_ops() -> None:
    """Import every op module so each has registered its backends."""
    from . import attention, compress, experts, indexer, matmul, mhc, norm, rope, rowwise  # noqa: F401


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
        for op, impls in sorted(_IMPLS.items()):
            chosen = name if name in impls else "reference"
            self.fns[op], self.backends[op] = impls[chosen], chosen

    def __repr__(self) -> str:
        return f"KernelTable({self.name!r})"


_active: KernelTable | None = None


def active() -> KernelTable:
    """The table ops dispatch through now (the reference one until an engine says otherwise)."""
    global _active
    if _active is None:
        _active = KernelTable("reference")
    return _active


def call(op: str) -> Callable:
    return active().fns[op]


@contextlib.contextmanager
def use(table: KernelTable | str):
    """Inside: ops dispatch through `table` (a KernelTable or a backend-set name); the previous one after."""
    global _active
    if isinstance(table, str):
        table = KernelTable(table)
    before, _active = active(), table
    try:
        yield table
    finally:
        _active = before
