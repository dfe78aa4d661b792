"""GPU and Triton helpers shared by the Triton kernel modules and the engine's backend default: whether Triton
imports, a device's SM count, the chunked-reduction grid choice, interpreter checks and block sizes. Nothing here
imports Triton at module import."""

from __future__ import annotations

import torch


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
    route logits and the mHC projection use it (kernels/routing_triton.py, kernels/mhc_triton.py)."""
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
    """The smallest power of two >= max(n, least) (least a power of two): a Triton block size."""
    p = least
    while p < n:
        p *= 2
    return p
