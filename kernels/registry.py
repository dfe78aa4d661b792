"""The op registry: every op's implementations by backend name, and the one call its entry point makes.

Each op module registers its implementations with `@implements(op, backend)`; an op's entry point (e.g.
`kernels.matmul.linear`) calls `call(op)`: whatever the *active* table (kernels/table.py) maps it to, the
`reference` implementation while none is active. A table is built from a backend-set name once, when the engine
is built (`LLM(kernel_backend=...)`), and made active around each forward (`table.use`), so model code calls ops
and never asks which mode it runs in.

Backend sets:
  reference   plain torch, the oracle every other backend is checked against
  invariant   fixed reduction order: every row-mixing op runs on fixed tiles of rows (kernels/tiles.py), so a
              row's bits do not depend on what shares its batch (DEEPINFER_BATCH_INVARIANT=1 selects it)
  triton      Triton GPU kernels (CUDA, sm_90 first): fused, quantized-weight-native, no host sync
  triton_invariant  Triton kernels with one fixed tile configuration whatever the rows (no split that depends
              on M), for batch-invariant mode
An op without an implementation in the chosen set runs the first one it has along the set's FALLBACK chain
(a set lists what it overrides); `KernelTable.backends` records the choice per op, which result rows carry.
"""

from __future__ import annotations

from typing import Callable

_IMPLS: dict[str, dict[str, Callable]] = {}      # op -> backend -> function
BACKEND_SETS = ("reference", "invariant", "triton", "triton_invariant")
FALLBACK = {                     # set -> the sets whose implementations stand in, in order, for ops it lacks
    "reference": (),
    "invariant": ("reference",),
    "triton": ("reference",),
    "triton_invariant": ("invariant", "reference"),
}
INVARIANT_OF = {"reference": "invariant", "invariant": "invariant", "triton": "triton_invariant",
                "triton_invariant": "triton_invariant"}             # a set's batch-invariant partner
DEFAULT_OF = {"reference": "reference", "invariant": "reference", "triton": "triton",
              "triton_invariant": "triton"}                         # and back


def triton_available() -> bool:
    """Whether Triton imports here (the Triton sets' kernels need it; without it they run their fallbacks)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_SM_COUNT: dict[int, int] = {}


def sm_count(device) -> int | None:
    """Streaming multiprocessors of a CUDA device (cached), None for any other device (kernels size grids by it)."""
    import torch
    device = torch.device(device)
    if device.type != "cuda":
        return None
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _SM_COUNT:
        _SM_COUNT[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SM_COUNT[key]


def chunks_first(row_blocks: int, chunks: int, device) -> bool:
    """Whether a kernel reducing a long K should first compute its K chunks on programs of their own, one per
    (row block, chunk), then add them in order: when there is more than one chunk and the row blocks alone leave
    at least half the SMs idle (decode), else each row block walks its chunks (no partial sums in memory). The
    route logits and the mHC projection use it (kernels/routing.py, kernels/mhc_triton.py)."""
    return chunks > 1 and row_blocks * 2 <= (sm_count(device) or 16)


def is_interpreted(kernel) -> bool:
    """Whether triton.jit made `kernel` an interpreted function (TRITON_INTERPRET=1 when its module imported)."""
    return type(kernel).__name__ == "InterpretedFunction"


def on_kernel_device(interpreted: bool, *tensors) -> bool:
    """Whether a Triton kernel can take these tensors: all on CUDA, or all off it when the kernel module was
    imported under Triton's interpreter (TRITON_INTERPRET=1: the CPU tests)."""
    if all(t.is_cuda for t in tensors):
        return True
    return interpreted and not any(t.is_cuda for t in tensors)


def pow2(n: int, least: int = 16) -> int:
    """The smallest power of two >= max(n, least): a Triton block size."""
    p = least
    while p < n:
        p *= 2
    return p


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


_active = None          # the KernelTable in use (kernels/table.py sets it), None: every op's reference


def call(op: str) -> Callable:
    table = _active
    return table.fns[op] if table is not None else _IMPLS[op]["reference"]
