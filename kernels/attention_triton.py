"""Triton sparse sink attention (issue 15, step 1-2 of docs/attention-plan.md): `sparse_sink_attention` with every
row's keys read by index straight from the key stores, no gathered key tensor, no score tensor in memory.

Contract (kernels/attention.py): q [N, H, d]; one or two sources (store [M_i, d], index [N, K_i] int64, -1 = no
key); row n attends to the rows its indices name, in source order, and to the per-head sink (a logit in the
denominator only); K = V (one shared latent, MQA). Returns [N, H, d] in q's dtype.

One program per (row, key split) holds all of the row's heads (H <= 64: the MMA's M dimension, FlashMLA's Hopper
layout) and streams BLOCK_N keys at a time: scores q.k^T [H, BLOCK_N] in fp32, an online softmax in base 2
(scale * log2 e folded into the scores), P cast to the key dtype for the P.V product (FlashAttention's rounding;
fp32 keys keep fp32), fp32 accumulator [H, d].

  one pass  (ONE_PASS): the running max starts at the sink (m = sink * log2 e, l = 1), so the sink joins the
            softmax without a key and a row with no key ends at 0, as the reference.
  split-KV  (a fixed SPLIT keys per program, cdiv(K, SPLIT) programs per row): each split writes its unnormalized (m, l, acc) in fp32,
            a second kernel merges the splits in ascending order with the sink:
                M = max(sink2, m_s),  out = sum_s 2^(m_s - M) acc_s / (2^(sink2 - M) + sum_s 2^(m_s - M) l_s)
            an empty split has m = -inf, l = 0, acc = 0 and adds nothing (M is finite: the sink is).
A row's result depends on its own keys only, whatever the batch, in both modes; the `triton` choice between them
(split when the rows alone leave SMs idle) depends on N, so `triton_invariant` always splits with SPLIT fixed
(a row of one split too: its arithmetic is the split path's whatever the batch). Trip counts are runtime values
on a GPU (a new keys-per-row compiles nothing), compile-time ones under the interpreter.

Numerics against the fp32 reference (`_sparse_sink_attention`): fp32 inputs in the interpreter <= 2e-6 of max |out|
(tests/interpreted/test_attention_triton.py); bf16 on a GPU: P rounded to bf16 (2^-9 relative), not yet measured.

GPU status: written, checked in Triton's interpreter and compiled for sm_90 on CPU; not yet run on a GPU, so it is
not in the Triton backend sets (IN_TRITON_SETS) until `pytest -m gpu tests/test_kernels_attention_triton.py`
passes. The functions are importable for the tests either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import SplitStore
from .registry import implements, is_interpreted, on_kernel_device, pow2, sm_count

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs
    triton = None

IN_TRITON_SETS = False       # flips once the GPU test passes (see the module docstring)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnTiles:
    block_n: int        # keys per inner step
    split: int          # keys per program in split-KV mode (a multiple of block_n)
    warps: int
    stages: int


# 64 heads x 512 dims: the fp32 accumulator alone is 128 registers a thread at 8 warps. ptxas for sm_90 (compiled
# on CPU, tests/test_kernels_compile_sm90.py) spills 60 bytes at BLOCK_N 16 / 8 warps / 2 stages (148 in split
# mode; 100 / 180 with the two-part stores' pointer select), 852 at BLOCK_N 32, 3.6 KB at 4 warps, 1.6 KB at
# 16 warps (128 registers each). Untimed: the GPU picks among them next.
DECODE = AttnTiles(block_n=16, split=128, warps=8, stages=2)
INVARIANT = DECODE                      # the same tiles, always split


def supported(q: torch.Tensor, sources) -> bool:
    """What the kernel runs: 1-2 sources, heads and dims a program can hold, float16/bfloat16/float32, and
    (outside the interpreter) CUDA tensors."""
    if triton is None or not 1 <= len(sources) <= 2 or q.dim() != 3:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or q.shape[1] > 64 or q.shape[2] > 512:
        return False
    parts = [p for store, _ in sources for p in _parts(store)]
    return on_kernel_device(INTERPRETED, q, *parts, *(i for _, i in sources)) and all(
        p.dtype == q.dtype and p.dim() == 2 and p.shape[-1] == q.shape[2] for p in parts)


def _parts(store) -> tuple[torch.Tensor, torch.Tensor]:
    """(first part, second part) of a store: a SplitStore's ring and new rows; a plain store twice."""
    return (store.ring, store.new) if isinstance(store, SplitStore) else (store, store)


def _pointers(store) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The kernel's view of a store: (rows before R, rows from R, R), each part with unit stride along d."""
    a, b = (t if t.stride(-1) == 1 else t.contiguous() for t in _parts(store))
    return a, b, a.shape[0]             # a plain store: every valid index is below its row count


if triton is not None:

    @triton.jit
    def _attend_tile(q, m, l, acc, it, n, start, stop, s1_ptr, n1_ptr, i1_ptr, s2_ptr, n2_ptr, i2_ptr, K1, R1, R2,
                     stride_s1, stride_n1, stride_i1, stride_s2, stride_n2, stride_i2, qk_scale, d, d_ok,
                     BLOCK_N: tl.constexpr, TWO: tl.constexpr, F32: tl.constexpr):
        """One step of BLOCK_N keys (positions start + it*BLOCK_N ..) of row n: the online softmax update."""
        t = start + it * BLOCK_N + tl.arange(0, BLOCK_N)
        in_range = t < stop
        i1 = tl.load(i1_ptr + n * stride_i1 + t, mask=in_range & (t < K1), other=-1)
        ok1 = i1 >= 0
        row1 = tl.where(i1 < R1, s1_ptr + i1 * stride_s1, n1_ptr + (i1 - R1) * stride_n1)
        k = tl.load(row1[:, None] + d[None, :], mask=ok1[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D]
        ok = ok1
        if TWO:
            i2 = tl.load(i2_ptr + n * stride_i2 + (t - K1), mask=in_range & (t >= K1), other=-1)
            ok2 = i2 >= 0
            row2 = tl.where(i2 < R2, s2_ptr + i2 * stride_s2, n2_ptr + (i2 - R2) * stride_n2)
            k += tl.load(row2[:, None] + d[None, :], mask=ok2[:, None] & d_ok[None, :], other=0.0)
            ok = ok1 | ok2
        if F32:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))                                     # [BLOCK_H, BLOCK_N] fp32
        scores = tl.where(ok[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                   # an all-empty start (split mode)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if F32:
            acc = acc * alpha[:, None] + tl.dot(p, k, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k)
        return m_new, l, acc

    @triton.jit
    def _sparse_attn_kernel(q_ptr, s1_ptr, n1_ptr, i1_ptr, s2_ptr, n2_ptr, i2_ptr, sink_ptr, o_ptr, ml_ptr,
                            H, D, K1, K2, R1, R2, nsplit, iters, stride_qn, stride_qh, stride_s1, stride_n1,
                            stride_i1, stride_s2, stride_n2, stride_i2, stride_on, stride_oh, stride_os, qk_scale,
                            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                            SPLIT: tl.constexpr, ONE_PASS: tl.constexpr, ITERS: tl.constexpr, TWO: tl.constexpr,
                            F32: tl.constexpr):
        """Program (n, s): row n, keys [s*SPLIT, (s+1)*SPLIT) of its concatenated list (ONE_PASS: all of them),
        `iters` steps of BLOCK_N keys (ITERS > 0: that many, a compile-time trip count, for the interpreter,
        which cannot loop to a runtime bound; on a GPU the count is a runtime value, so a new keys-per-row
        does not compile the kernel again).
        A source's store is in two parts (kernels.attention.SplitStore): index i < R_i reads s_i[i], else
        n_i[i - R_i] (a plain store passes itself twice with R_i = its rows).
        ONE_PASS writes the normalized output o [N, H, D] (q's dtype); else o is [N, nsplit, H, D] fp32
        (stride_os per split) of unnormalized accumulators and ml [N, nsplit, H, 2] their (m, l)."""
        n = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_ok, d_ok = h < H, d < D
        q = tl.load(q_ptr + n * stride_qn + h[:, None] * stride_qh + d[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)              # [BLOCK_H, BLOCK_D]
        if ONE_PASS:
            m = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            l = tl.full((BLOCK_H,), 1.0, tl.float32)
            start = 0
            stop = K1 + K2
        else:
            m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
            l = tl.zeros((BLOCK_H,), tl.float32)
            start = s * SPLIT
            stop = tl.minimum(start + SPLIT, K1 + K2)
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        if ITERS > 0:
            for it in range(ITERS):
                m, l, acc = _attend_tile(q, m, l, acc, it, n, start, stop, s1_ptr, n1_ptr, i1_ptr, s2_ptr, n2_ptr,
                                         i2_ptr, K1, R1, R2, stride_s1, stride_n1, stride_i1, stride_s2, stride_n2,
                                         stride_i2, qk_scale, d, d_ok, BLOCK_N, TWO, F32)
        else:
            for it in range(iters):
                m, l, acc = _attend_tile(q, m, l, acc, it, n, start, stop, s1_ptr, n1_ptr, i1_ptr, s2_ptr, n2_ptr,
                                         i2_ptr, K1, R1, R2, stride_s1, stride_n1, stride_i1, stride_s2, stride_n2,
                                         stride_i2, qk_scale, d, d_ok, BLOCK_N, TWO, F32)
        if ONE_PASS:
            out = acc / l[:, None]
            tl.store(o_ptr + n * stride_on + h[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                     mask=h_ok[:, None] & d_ok[None, :])
        else:
            base = n * stride_on + s.to(tl.int64) * stride_os
            tl.store(o_ptr + base + h[:, None] * stride_oh + d[None, :], acc, mask=h_ok[:, None] & d_ok[None, :])
            ml = ml_ptr + ((n * nsplit + s) * H + h) * 2
            tl.store(ml, m, mask=h_ok)
            tl.store(ml + 1, l, mask=h_ok)

    @triton.jit
    def _combine_split(acc, denom, big, part_ptr, ml_ptr, n, s, nsplit, H, h, h_ok, d, d_ok, stride_pn, stride_ps,
                       stride_ph):
        ml = ml_ptr + ((n * nsplit + s) * H + h) * 2
        w = tl.exp2(tl.load(ml, mask=h_ok, other=float("-inf")) - big)
        part = tl.load(part_ptr + n * stride_pn + s * stride_ps + h[:, None] * stride_ph + d[None, :],
                       mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        return acc + w[:, None] * part, denom + w * tl.load(ml + 1, mask=h_ok, other=0.0)

    @triton.jit
    def _combine_kernel(part_ptr, ml_ptr, sink_ptr, o_ptr, H, D, nsplit, stride_pn, stride_ps, stride_ph,
                        stride_on, stride_oh,
                        NSPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program n: merge row n's nsplit partial (m, l, acc) with the sink, splits in ascending order
        (NSPLIT > 0: a compile-time count, for the interpreter)."""
        n = tl.program_id(0).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_ok, d_ok = h < H, d < D
        sink2 = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        big = sink2
        if NSPLIT > 0:
            for s in range(NSPLIT):
                big = tl.maximum(big, tl.load(ml_ptr + ((n * nsplit + s) * H + h) * 2, mask=h_ok, other=0.0))
        else:
            for s in range(nsplit):
                big = tl.maximum(big, tl.load(ml_ptr + ((n * nsplit + s) * H + h) * 2, mask=h_ok, other=0.0))
        denom = tl.exp2(sink2 - big)
        acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
        if NSPLIT > 0:
            for s in range(NSPLIT):
                acc, denom = _combine_split(acc, denom, big, part_ptr, ml_ptr, n, s, nsplit, H, h, h_ok, d, d_ok,
                                            stride_pn, stride_ps, stride_ph)
        else:
            for s in range(nsplit):
                acc, denom = _combine_split(acc, denom, big, part_ptr, ml_ptr, n, s, nsplit, H, h, h_ok, d, d_ok,
                                            stride_pn, stride_ps, stride_ph)
        tl.store(o_ptr + n * stride_on + h[:, None] * stride_oh + d[None, :],
                 (acc / denom[:, None]).to(o_ptr.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])

    INTERPRETED = is_interpreted(_sparse_attn_kernel)
else:
    INTERPRETED = False


def num_splits(n: int, k: int, tiles: AttnTiles, device: torch.device, invariant: bool) -> int:
    """Programs per row: 0 (one pass) or cdiv(K, tiles.split) (split-KV, a fixed split size, then the combine).
    `invariant` always splits, even a row of one split, so a row's arithmetic never depends on the batch's K;
    otherwise split only when the rows alone leave SMs idle (N < SMs)."""
    most = max(1, -(-k // tiles.split))
    if invariant:
        return most
    return most if n < (sm_count(device) or 16) else 0


def sparse_attention(q: torch.Tensor, sources, sink: torch.Tensor, scale: float, tiles: AttnTiles = DECODE,
                     invariant: bool = False, splits: int | None = None) -> torch.Tensor:
    """The kernels on `supported` inputs (callers check). `splits` (tests) forces one pass (0) or split-KV (any
    other value: cdiv(K, tiles.split) programs per row, then the combine)."""
    n, h, dim = q.shape
    (st1, i1), (st2, i2) = sources[0], (sources[1] if len(sources) == 2 else (sources[0][0], sources[0][1][:, :0]))
    k1, k2 = i1.shape[1], (i2.shape[1] if len(sources) == 2 else 0)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)         # contiguous, whatever q's strides
    if n == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    (s1, n1, r1), (s2, n2, r2) = _pointers(st1), _pointers(st2)
    i1, i2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (i1, i2))
    sink = sink.to(torch.float32).contiguous()
    nsplit = num_splits(n, k1 + k2, tiles, q.device, invariant) if splits is None else splits
    if nsplit:
        nsplit = max(1, -(-(k1 + k2) // tiles.split))
    block_h, block_d = pow2(h), pow2(dim)
    iters = -(-(k1 + k2 if not nsplit else tiles.split) // tiles.block_n)       # steps per program
    common = dict(BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=tiles.block_n, SPLIT=tiles.split, ONE_PASS=not nsplit,
                  ITERS=iters if INTERPRETED else 0, TWO=len(sources) == 2, F32=q.dtype == torch.float32,
                  num_warps=tiles.warps, num_stages=tiles.stages)
    args = (s1, n1, i1, s2, n2, i2, sink)
    sizes = (h, dim, k1, k2, r1, r2, max(nsplit, 1), iters, q.stride(0), q.stride(1), s1.stride(0), n1.stride(0),
             i1.stride(0), s2.stride(0), n2.stride(0), max(i2.stride(0), 1) if i2.numel() else 1)
    if not nsplit:
        _sparse_attn_kernel[(n, 1)](q, *args, out, out, *sizes, out.stride(0), out.stride(1), 0,
                                    scale * LOG2E, **common)
        return out
    part = torch.empty((n, nsplit, h, dim), dtype=torch.float32, device=q.device)
    ml = torch.empty((n, nsplit, h, 2), dtype=torch.float32, device=q.device)
    _sparse_attn_kernel[(n, nsplit)](q, *args, part, ml, *sizes, part.stride(0), part.stride(2), part.stride(1),
                                     scale * LOG2E, **common)
    _combine_kernel[(n,)](part, ml, sink, out, h, dim, nsplit, part.stride(0), part.stride(1), part.stride(2),
                          out.stride(0), out.stride(1), NSPLIT=nsplit if INTERPRETED else 0, BLOCK_H=block_h,
                          BLOCK_D=block_d, num_warps=4)
    return out


def _fallback(invariant: bool):
    from . import attention
    return attention._sparse_sink_attention_tiles if invariant else attention._sparse_sink_attention


def sparse_sink_attention_triton(q, sources, sink, scale):
    if not supported(q, sources):
        return _fallback(False)(q, sources, sink, scale)
    return sparse_attention(q, sources, sink, scale, DECODE, invariant=False)


def sparse_sink_attention_triton_invariant(q, sources, sink, scale):
    if not supported(q, sources):
        return _fallback(True)(q, sources, sink, scale)
    return sparse_attention(q, sources, sink, scale, INVARIANT, invariant=True)


if triton is not None and IN_TRITON_SETS:
    implements("sparse_sink_attention", "triton")(sparse_sink_attention_triton)
    implements("sparse_sink_attention", "triton_invariant")(sparse_sink_attention_triton_invariant)
