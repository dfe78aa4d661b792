"""The matmul_ogs call of FP4 experts held in triton_kernels' Hopper layout (kernels/experts_ogs.py says what the
layout is, why and when), and the one kernel of its own: the gated activation between the GEMMs (also the `swiglu`
op's kernel)."""

from __future__ import annotations

import torch

from .experts import ExpertWeights
from .experts_ogs import INVARIANT_TOKENS_PER_EXPERT, halves, layouts, swizzled_views, whole
from .gpu import pow2
from .pdl import pdl

try:
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:       # CPU machines without Triton: nothing here runs (kernels/experts_triton.py checks)
    triton = None


# ---------------------------------------------------------------------------------------------------- the call

def _weights(w: torch.Tensor, s: torch.Tensor):
    """triton_kernels Tensors over one weight's buffers (host objects only; built per call, a few us)."""
    from triton_kernels.tensor import FP4, Storage, Tensor
    e, n, kh = w.shape
    value, scale = layouts(e, n, kh * 2)
    wv, sv = swizzled_views(w, s)
    return (Tensor(Storage(wv, value), dtype=FP4, shape=[e, kh * 2, n]),
            Tensor(Storage(sv, scale), dtype=torch.uint8, shape=[e, kh * 2 // 32, n]))


def run(x: torch.Tensor, offsets: torch.Tensor, route_weights: torch.Tensor, ew: ExpertWeights,
        invariant: bool) -> torch.Tensor:
    """x [M, D] bf16 grouped by expert (offsets [E+1] on the device), route_weights [M] -> [M, D] fp32."""
    from triton_kernels.matmul_ogs import PrecisionConfig, RoutingData, matmul_ogs
    from triton_kernels.tensor import make_ragged_tensor_metadata
    m = x.shape[0]
    counts = (offsets[1:] - offsets[:-1]).to(torch.int32)
    meta = make_ragged_tensor_metadata(counts, m)
    routing = RoutingData(None, meta.slice_sizes, ew.n_experts, 1, meta,
                          expected_tokens_per_expt=INVARIANT_TOKENS_PER_EXPERT if invariant else None)
    x = x.contiguous()
    (s1, s2, s3), i = ew.scales, ew.inter
    if halves(ew.w1, ew.w3) and halves(s1, s3):      # one GEMM over [W1; W3] (Experts.relayout joins them)
        w13, s13 = _weights(whole(ew.w1), whole(s1))
        gate_up = matmul_ogs(x, w13, None, routing,
                             precision_config=PrecisionConfig(weight_scale=s13, out_dtype=ew.dtype))
        gate, up = gate_up[:, :i], gate_up[:, i:]
    else:
        (w1, s1), (w3, s3) = _weights(ew.w1, s1), _weights(ew.w3, s3)
        gate = matmul_ogs(x, w1, None, routing, precision_config=PrecisionConfig(weight_scale=s1, out_dtype=ew.dtype))
        up = matmul_ogs(x, w3, None, routing, precision_config=PrecisionConfig(weight_scale=s3, out_dtype=ew.dtype))
    w2, s2 = _weights(ew.w2, s2)
    h = gated_activation(gate, up, route_weights, ew.limit)
    return matmul_ogs(h, w2, None, routing, precision_config=PrecisionConfig(weight_scale=s2, out_dtype=torch.float32))



def gated_activation(gate: torch.Tensor, up: torch.Tensor, r: torch.Tensor | None, limit: float,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """h = r * swiglu(gate, up, limit) in fp32 (r None: no product), stored in out_dtype (None: gate's dtype):
    gate, up [M, I] (columns contiguous), r [M] -> [M, I] (kernels/experts.py swiglu: gate clamped above at limit,
    up to +-limit; limit <= 0: no clamp). The experts' activation between matmul_ogs's GEMMs, and the `swiglu`
    op's (kernels/experts_triton.py `swiglu_triton`: fp32 out, no r)."""
    m, n = gate.shape
    h = torch.empty(m, n, dtype=out_dtype or gate.dtype, device=gate.device)
    if m == 0 or n == 0:
        return h
    block = min(1024, pow2(n))
    _gated_activation[(m, triton.cdiv(n, block))](gate, up, gate if r is None else r, h, n, gate.stride(0),
                                                  up.stride(0), h.stride(0), float(limit), HAS_R=r is not None,
                                                  BLOCK=block, num_warps=4, **pdl(gate.device))
    return h


if triton is not None:

    @triton.jit
    def _gated_activation(gate_ptr, up_ptr, r_ptr, h_ptr, N, sg, su, sh, limit, HAS_R: tl.constexpr,
                          BLOCK: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < N
        g = tl.load(gate_ptr + row * sg + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * su + cols, mask=mask, other=0.0).to(tl.float32)
        if limit > 0:
            g = tl.minimum(g, limit)
            u = tl.clamp(u, -limit, limit)
        h = g / (1.0 + tl.exp(-g)) * u
        if HAS_R:
            h = h * tl.load(r_ptr + row).to(tl.float32)
        tl.store(h_ptr + row * sh + cols, h.to(h_ptr.dtype.element_ty), mask=mask)


__all__ = ["gated_activation", "run"]
