"""FP4 (MXFP4) routed experts through triton_kernels' `matmul_ogs`: the W4A16 path of `grouped_experts` on sm_90.
This module: when that path runs, and the weight layout it reads (torch only; the call and its one kernel are in
kernels/experts_ogs_triton.py).

triton_kernels (the kernel library in Triton's repository, `python/triton_kernels`) reads MXFP4 weights in a Hopper
layout made for its decode: the e2m1 bytes swizzled so each thread's bytes of four MMA tiles sit together and their
bits interleaved for a 14-instruction bf16 decode, the e8m0 scales swizzled by warp. Measured on an H100 it reads
FP4 weights at 93-96% of copy bandwidth where our kernel reaches 53-69% (docs/results.md), so the `triton` sets use
it for FP4 weights in bf16 models on sm_90 when triton_kernels is installed (docs/kernels.md "FP4 experts through
matmul_ogs").

Layout (`Experts.relayout`, kernels/experts.py `weight_layout`): the same bytes, rearranged in place in the model's
own buffers (w*_fp4 [E, N, K/2], w*_scale [E, N, K/32] keep their shapes; memory never doubles), a few experts at
a time. `HOPPER` names that layout, `ROWS` ours. The swizzles need N a multiple of 128 (the scale swizzle of 4
warps) and K a multiple of 128: every released V4 / V4.1 shape is; smaller test models keep ROWS.

The MLP, per call (rows grouped by expert, as the op takes them; kernels/experts_ogs_triton.py):
    gate | up = x [W1; W3]^T            one `matmul_ogs` over the ragged row groups (W1 and W3 joined), bf16 out
    h    = r * swiglu(gate, up, limit)  one small kernel here (clamp, SiLU, routing weight; rounded to bf16)
    y    = h W2^T                       `matmul_ogs`, fp32 out
so the numerics are W4A16 with fp32 accumulation, gate and up rounded to bf16 as the reference's GEMMs output
them, the routing weight before W2 (as DeepSeek); only y stays fp32 (the reference rounds it to bf16 first).
The ragged metadata is built on the device from the offsets (no host sync: the step captures in a CUDA graph).

Tiles: triton_kernels picks BM from the rows per expert (16 at decode, up to 128 at prefill); BN 128 and 4 warps
come from the scale layout, BK 128, not persistent, no split-K (MX weights on Hopper). The batch-invariant set pins
BM to 16 whatever the rows (`RoutingData.expected_tokens_per_expt=1`), so every flag is fixed and a row's bits do
not depend on what shares its batch.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:          # kernels/experts.py imports this module for its layouts
    from .experts import ExpertWeights

ROWS = "rows"                 # our layout: e2m1 bytes [E, N, K/2] row-major, e8m0 scales [E, N, K/32]
HOPPER = "hopper_mx"          # triton_kernels' Hopper MX value / scale layouts, in the same buffers
SCALE_WARPS = 4               # the scale swizzle's warp count = the kernel's warps (BN = 32 x warps = 128)
N_ALIGN = 32 * SCALE_WARPS    # output columns: the scale swizzle's row group
K_ALIGN = 128                 # reduction: the value swizzle pads K/2 bytes to 64
RELAYOUT_EXPERTS = 16         # experts converted at a time (bounds the temporaries to ~16 experts' bytes)
INVARIANT_TOKENS_PER_EXPERT = 1   # pins BM to 16 for the batch-invariant set


def installed() -> bool:
    """Whether triton_kernels can be imported here (found, not imported)."""
    return importlib.util.find_spec("triton_kernels") is not None


def runs_on(device) -> bool:
    """Whether this path can run on `device`: CUDA sm_90 (its Hopper layouts), Triton and triton_kernels present.
    Asked by the op on every call, so answered once per device."""
    return _runs_on(torch.device(device))


@functools.lru_cache(maxsize=None)
def _runs_on(device: torch.device) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available() or not installed():
        return False
    return torch.cuda.get_device_capability(device)[0] == 9


def fits(ew: ExpertWeights) -> bool:
    """Whether these weights can take the Hopper layout and this path: FP4 weights, a bf16 model, bf16 activations
    (W4A8 stays on our kernel: FP8 x MXFP4 is not in this triton_kernels on sm_90), aligned shapes."""
    return (ew.fmt == "fp4" and ew.dtype == torch.bfloat16 and not ew.act_fp8
            and ew.dim % N_ALIGN == 0 and ew.inter % N_ALIGN == 0
            and ew.dim % K_ALIGN == 0 and ew.inter % K_ALIGN == 0)


# ------------------------------------------------------------------------------------------------------ layouts

def layouts(e: int, n: int, k: int):
    """triton_kernels' value and scale layouts for e experts of an [N, K] weight (its logical [E, K, N])."""
    from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout
    return (HopperMXValueLayout([e, k // 2, n], mx_axis=1),
            HopperMXScaleLayout([e, k // 32, n], mx_axis=1, num_warps=SCALE_WARPS))


def swizzled_views(w: torch.Tensor, s: torch.Tensor):
    """Our buffers (w uint8 [E, N, K/2], s uint8 [E, N, K/32], holding Hopper bytes) as the layouts' data tensors:
    value data [E, 4 K/2, N/4] and scale data [E, 32 K/32, N/32], both the transposes of contiguous tensors."""
    e, n, kh = w.shape
    ks = s.shape[2]
    return w.view(e, n // 4, kh * 4).mT, s.view(e, n // 32, ks * 32).mT


def to_hopper(w: torch.Tensor, s: torch.Tensor) -> None:
    """Rearrange one weight's bytes in place from ROWS to HOPPER, RELAYOUT_EXPERTS experts at a time."""
    e, n, kh = w.shape
    for a in range(0, e, RELAYOUT_EXPERTS):
        b = min(e, a + RELAYOUT_EXPERTS)
        value, scale = layouts(b - a, n, kh * 2)
        vd = value.swizzle_data(w[a:b].transpose(1, 2))          # [b-a, 4 K/2, N/4], a transposed contiguous
        sd = scale.swizzle_data(s[a:b].transpose(1, 2))
        wv, sv = swizzled_views(w[a:b], s[a:b])
        wv.copy_(vd)
        sv.copy_(sd)


def to_rows(w: torch.Tensor, s: torch.Tensor) -> None:
    """The inverse of `to_hopper`, in place."""
    e = w.shape[0]
    for a in range(0, e, RELAYOUT_EXPERTS):
        b = min(e, a + RELAYOUT_EXPERTS)
        wr, sr = rows_of(w[a:b], s[a:b])
        w[a:b].copy_(wr)
        s[a:b].copy_(sr)


def hopper_copy(ew: ExpertWeights) -> ExpertWeights:
    """A copy of FP4 weights held in rows, in the Hopper layout, w1 and w3 joined as an engine holds them
    (benchmarks and tests; an engine converts its own buffers: Experts.relayout)."""
    (w1, w3), (s1, s3) = join(ew.w1, ew.w3), join(ew.scales[0], ew.scales[2])
    ws, ss = [w1, ew.w2.clone(), w3], [s1, ew.scales[1].clone(), s3]
    for w, s in zip(ws, ss):
        to_hopper(w, s)
    return dataclasses.replace(ew, w1=ws[0], w2=ws[1], w3=ws[2], scales=tuple(ss), layout=HOPPER)


def rows_of(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts held in HOPPER (w [n, N, K/2], s [n, N, K/32], any n) -> new tensors in ROWS, same shapes."""
    e, n, kh = w.shape
    value, scale = layouts(e, n, kh * 2)
    wv, sv = swizzled_views(w, s)
    wr = value.unswizzle_data(wv).transpose(1, 2)                # [e, N, K/2]
    sr = scale.unswizzle_data(sv)[..., :n].transpose(1, 2)       # scales come back padded along N: crop
    return wr.contiguous(), sr.contiguous()


def halves(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether b [E, I, ...] is the second half, along dim 1, of the buffer whose first half is a. The Hopper
    layouts group columns in blocks of 64 (values) and 128 (scales), outermost within an expert, so for I a
    multiple of 128 the halves of the joint layout are the layouts of each half (tests/test_experts_ogs.py)."""
    return (a.shape == b.shape and a.stride() == b.stride() and a.stride(0) == 2 * a.shape[1] * a.stride(1)
            and b.data_ptr() == a.data_ptr() + a.shape[1] * a.stride(1) * a.element_size())


def join(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a and b [E, I, ...] copied into one [E, 2I, ...] buffer: its two halves (`halves` holds for them)."""
    joint = torch.cat([a, b], dim=1)
    return joint[:, :a.shape[1]], joint[:, a.shape[1]:]


def whole(a: torch.Tensor) -> torch.Tensor:
    """The [E, 2I, ...] buffer whose first half is a."""
    return a.as_strided((a.shape[0], 2 * a.shape[1], *a.shape[2:]), a.stride())


__all__ = ["HOPPER", "ROWS", "fits", "halves", "hopper_copy", "installed", "join", "rows_of", "runs_on",
           "to_hopper", "to_rows", "whole"]
