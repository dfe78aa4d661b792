"""Programmatic dependent launch (PDL) for the Triton kernels: the launch options a kernel call passes.

On sm_90 and later a kernel launched with PDL may start while the kernel before it on the stream is still running:
its blocks are placed as soon as every block of the predecessor has signalled `griddepcontrol.launch_dependents`,
then wait at `griddepcontrol.wait` until the predecessor has finished and its writes are visible. Every Triton kernel
of kernels/ does exactly that as its first statement (kernels/pdl_triton.py `await_inputs`), so nothing is read
early and no result changes; what is gained is the launch latency and the ramp of each block, which at decode
(about 400 kernels a step, most of a few microseconds) is a large share of the step. Inside a CUDA graph the same
edge is captured as a programmatic dependency.

A launch passes `**pdl(tensor.device)`: {"PDL": True, "launch_pdl": True} (the kernel's constexpr and Triton's
launch flag) on a CUDA device of compute capability >= 9.0 while the switch is on, else {"PDL": False}. The
engine sets the switch from DEEPINFER_PDL at every entry point (engine/env.py `check_environment`; kernels/ reads
no engine setting itself). Off by default until tests/test_gpu_pdl.py and the step rows have run on a GPU
(docs/kernels.md). Nothing here imports Triton.
"""

from __future__ import annotations

import os

import torch

_PDL = False                                  # the engine's switch (`set_enabled`; the GPU tests set it too)
_OPTIONS: dict[int, dict] = {}                # CUDA device index -> its launch options
_OFF = {"PDL": False}


def set_enabled(on: bool) -> None:
    """Turn PDL on or off for the launches that follow (Triton's interpreter, which can take CUDA tensors, has no
    griddepcontrol: under it PDL stays off)."""
    global _PDL
    _PDL = bool(on) and os.environ.get("TRITON_INTERPRET", "0") != "1"


def pdl(device) -> dict:
    """The keyword arguments a Triton launch on `device` passes (a CUDA device with sm >= 90: PDL on)."""
    device = torch.device(device)
    if device.type != "cuda" or not _PDL:
        return _OFF
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _OPTIONS:
        on = torch.cuda.get_device_capability(key) >= (9, 0)
        _OPTIONS[key] = {"PDL": True, "launch_pdl": True} if on else _OFF
    return _OPTIONS[key]
