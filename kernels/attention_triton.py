"""Triton sparse sink attention: `sparse_sink_attention` for both Triton sets, with every row's keys read by index
straight from the key stores, no gathered key tensor, no score tensor in memory.

Contract (kernels/attention.py): q [N, H, d]; one or two sources (store [M_i, d], index [N, K_i] int64, -1 = no
key); row n attends to the rows its indices name, in source order, and to the per-head sink (a logit in the
denominator only); K = V (one shared latent, MQA). Returns [N, H, d] in q's dtype.

One program per (row, key split, block of block_h heads; H <= 64) streams BLOCK_N keys at a time (each key tile
serves the block's heads: MQA): scores q.k^T [H, BLOCK_N] in fp32, an online softmax in base 2
(scale * log2 e folded into the scores), P cast to the key dtype for the P.V product (FlashAttention's rounding;
fp32 keys keep fp32), fp32 accumulator [block_h, d].

  one pass  (ONE_PASS): the running max starts at the sink (m = sink * log2 e, l = 1), so the sink joins the
            softmax without a key and a row with no key ends at 0, as the reference.
  split-KV  (SPLIT keys per program, cdiv(K, SPLIT) programs per row and head block): each split writes its
            unnormalized (m, l, acc) in fp32, a second kernel (one program per row and COMBINE_HEADS heads)
            merges the splits in ascending order with the sink:
                M = max(sink2, m_s),  out = sum_s 2^(m_s - M) acc_s / (2^(sink2 - M) + sum_s 2^(m_s - M) l_s)
            an empty split has m = -inf, l = 0, acc = 0 and adds nothing (M is finite: the sink is).
A row's result depends on its own keys only, whatever the batch, in both modes; the `triton` choice (split_plan:
one pass when the rows' head blocks fill the SMs, else the split size that gives about two programs per SM, a
decode row's keys spread over the GPU) depends on N, so `triton_invariant` always splits at the fixed
tiles.split (a row of one split too: its arithmetic is the split path's whatever the batch). Trip counts are runtime values
on a GPU (a new keys-per-row compiles nothing), compile-time ones under the interpreter.

Numerics against the fp32 reference (`_sparse_sink_attention`): fp32 inputs in the interpreter <= 2e-6 of max |out|
(tests/interpreted/test_attention_triton.py); bf16 on an H200 at released widths, P rounded to bf16: 2.5e-3 to
6.5e-3 of max |out| (kernel bench rows, swa / csa / hca at 1-64 rows; the GPU test's bound is 1e-2).
Speed against the reference: docs/results.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import SplitStore, _sparse_sink_attention, _sparse_sink_attention_tiles
from .kv_formats import PackedStore, raw
from .kv_formats_triton import readable, record_args
from .gpu import is_interpreted, on_kernel_device, pow2, sm_count
from .pdl import pdl

try:
    import triton
    import triton.language as tl

    from .kv_formats_triton import load_records
    from .pdl_triton import await_inputs
except ImportError:          # CPU-only installs
    triton = None

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnTiles:
    block_n: int        # keys per inner step
    split: int          # keys per program in split-KV mode: `triton_invariant`'s fixed split, `triton`'s largest
    warps: int          # (a power-of-two multiple of block_n)
    stages: int
    block_h: int = 64   # heads per program (a power of two; fewer: more programs, each key read once per block)


# Chosen on an H200 (harness/attention_tiles.py, docs/results.md): 42 tile / split / head-block variants at the
# released widths (64 heads x 512) for swa / csa / hca rows at 1, 16 and 64 tokens. 32 heads a program with
# 32-key steps and 4 warps was within 1.2x of the best variant at every shape and the best at 4 of 9; 16 heads
# was best at one token (up to 1.2x faster there) and 1.1-1.5x slower at 64; the old 64 heads x 16 keys x 8
# warps was 1.0-1.5x slower than the best.
DECODE = AttnTiles(block_n=32, split=128, warps=4, stages=2, block_h=32)
INVARIANT = DECODE                      # the same tiles, always split at 128 keys
COMBINE_HEADS = 4                       # heads per combine program: a decode row's merge spread over 16 SMs


def supported(q: torch.Tensor, sources) -> bool:
    """What the kernel runs: 1-2 sources, heads and dims a program can hold, float16/bfloat16/float32, and
    (outside the interpreter) CUDA tensors."""
    if triton is None or not 1 <= len(sources) <= 2 or q.dim() != 3:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or q.shape[1] > 64 or q.shape[2] > 512:
        return False
    parts = [p for store, _ in sources for p in _parts(store)]
    plain = [p for p in parts if not isinstance(p, PackedStore)]
    packed_ok = all(readable(p, q.shape[2]) for p in parts if isinstance(p, PackedStore))
    return packed_ok and on_kernel_device(INTERPRETED, q, *(raw(p) for p in parts),
                                          *(i for _, i in sources)) and all(
        p.dtype == q.dtype and p.dim() == 2 and p.shape[-1] == q.shape[2] for p in plain)


def _parts(store) -> tuple:
    """(first part, second part) of a store: a SplitStore's ring and new rows; a plain store twice. Only a first
    part may be packed (a SplitStore's new rows are this step's latents)."""
    return (store.ring, store.new) if isinstance(store, SplitStore) else (store, store)


def _pointers(store, q: torch.Tensor):
    """The kernel's view of a store: (first part's RecordArgs, the rows from R as a plain tensor, R). A packed store
    on its own has no second part: q stands in (never read: every index is below R)."""
    a, b = _parts(store)
    b = q if isinstance(b, PackedStore) else (b if b.stride(-1) == 1 else b.contiguous())
    return record_args(a), b, a.shape[0]          # a plain store: every valid index is below its row count


if triton is not None:

    @triton.jit
    def _source_keys(s_ptr, s16_ptr, n_ptr, idx, R, stride_s, stride_n, d, d_ok, D,
                     KIND: tl.constexpr, Q: tl.constexpr, SOFF: tl.constexpr, BLK: tl.constexpr,
                     E4M3: tl.constexpr):
        """Keys [BLOCK_N, BLOCK_D] of one source, in the second part's dtype: index i < R reads the first part (a
        plain store, or packed records decoded in registers: kernels/kv_formats_triton.py), else new row i - R."""
        ok = idx >= 0
        if KIND == 0:
            row = tl.where(idx < R, s_ptr + idx * stride_s, n_ptr + (idx - R) * stride_n)
            k = tl.load(row[:, None] + d[None, :], mask=ok[:, None] & d_ok[None, :], other=0.0)
        else:
            first = idx < R
            kb = tl.load(n_ptr + ((idx - R) * stride_n)[:, None] + d[None, :],
                         mask=(ok & ~first)[:, None] & d_ok[None, :], other=0.0)
            ka = load_records(s_ptr, s16_ptr, idx * stride_s, d, ok & first, D, KIND, Q, SOFF, BLK, E4M3,
                              n_ptr.dtype.element_ty)
            k = tl.where(first[:, None], ka, kb)
        return k

    @triton.jit
    def _attend_tile(q, m, l, acc, it, n, start, stop, s1_ptr, s1_16, n1_ptr, i1_ptr, s2_ptr, s2_16, n2_ptr, i2_ptr,
                     K1, R1, R2, stride_s1, stride_n1, stride_i1, stride_s2, stride_n2, stride_i2, qk_scale, d, d_ok,
                     D, BLOCK_N: tl.constexpr, TWO: tl.constexpr, F32: tl.constexpr,
                     P1: tl.constexpr, Q1: tl.constexpr, O1: tl.constexpr, B1: tl.constexpr, E1: tl.constexpr,
                     P2: tl.constexpr, Q2: tl.constexpr, O2: tl.constexpr, B2: tl.constexpr, E2: tl.constexpr):
        """One step of BLOCK_N keys (positions start + it*BLOCK_N ..) of row n: the online softmax update."""
        t = start + it * BLOCK_N + tl.arange(0, BLOCK_N)
        in_range = t < stop
        i1 = tl.load(i1_ptr + n * stride_i1 + t, mask=in_range & (t < K1), other=-1)
        ok = i1 >= 0
        k = _source_keys(s1_ptr, s1_16, n1_ptr, i1, R1, stride_s1, stride_n1, d, d_ok, D, P1, Q1, O1, B1, E1)
        if TWO:
            i2 = tl.load(i2_ptr + n * stride_i2 + (t - K1), mask=in_range & (t >= K1), other=-1)
            k += _source_keys(s2_ptr, s2_16, n2_ptr, i2, R2, stride_s2, stride_n2, d, d_ok, D, P2, Q2, O2, B2, E2)
            ok = ok | (i2 >= 0)
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
    def _sparse_attn_kernel(q_ptr, s1_ptr, s1_16, n1_ptr, i1_ptr, s2_ptr, s2_16, n2_ptr, i2_ptr, sink_ptr, o_ptr,
                            ml_ptr, H, D, K1, K2, R1, R2, nsplit, iters, stride_qn, stride_qh, stride_s1, stride_n1,
                            stride_i1, stride_s2, stride_n2, stride_i2, stride_on, stride_oh, stride_os, qk_scale,
                            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                            SPLIT: tl.constexpr, ONE_PASS: tl.constexpr, ITERS: tl.constexpr, TWO: tl.constexpr,
                            F32: tl.constexpr,
                            P1: tl.constexpr, Q1: tl.constexpr, O1: tl.constexpr, B1: tl.constexpr, E1: tl.constexpr,
                            P2: tl.constexpr, Q2: tl.constexpr, O2: tl.constexpr, B2: tl.constexpr, E2: tl.constexpr,
                            PDL: tl.constexpr):
        """Program (n, s, b): row n, heads [b*BLOCK_H, (b+1)*BLOCK_H), keys [s*SPLIT, (s+1)*SPLIT) of its
        concatenated list (ONE_PASS: all of them),
        `iters` steps of BLOCK_N keys (ITERS > 0: that many, a compile-time trip count, for the interpreter,
        which cannot loop to a runtime bound; on a GPU the count is a runtime value, so a new keys-per-row
        does not compile the kernel again).
        A source's store is in two parts (kernels.attention.SplitStore): index i < R_i reads s_i[i], else
        n_i[i - R_i] (a plain store passes itself twice with R_i = its rows). P_i > 0: s_i holds packed records
        (kernels/kv_formats.py; s_i16 their bf16 view, Q/O/B/E_i the format's constants), decoded in registers.
        ONE_PASS writes the normalized output o [N, H, D] (q's dtype); else o is [N, nsplit, H, D] fp32
        (stride_os per split) of unnormalized accumulators and ml [N, nsplit, H, 2] their (m, l)."""
        await_inputs(PDL)
        n = tl.program_id(0).to(tl.int64)
        s = tl.program_id(1)
        h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)                # this program's block of heads
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
                m, l, acc = _attend_tile(q, m, l, acc, it, n, start, stop, s1_ptr, s1_16, n1_ptr, i1_ptr, s2_ptr,
                                         s2_16, n2_ptr, i2_ptr, K1, R1, R2, stride_s1, stride_n1, stride_i1,
                                         stride_s2, stride_n2, stride_i2, qk_scale, d, d_ok, D, BLOCK_N, TWO, F32,
                                         P1, Q1, O1, B1, E1, P2, Q2, O2, B2, E2)
        else:
            for it in range(iters):
                m, l, acc = _attend_tile(q, m, l, acc, it, n, start, stop, s1_ptr, s1_16, n1_ptr, i1_ptr, s2_ptr,
                                         s2_16, n2_ptr, i2_ptr, K1, R1, R2, stride_s1, stride_n1, stride_i1,
                                         stride_s2, stride_n2, stride_i2, qk_scale, d, d_ok, D, BLOCK_N, TWO, F32,
                                         P1, Q1, O1, B1, E1, P2, Q2, O2, B2, E2)
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
                        NSPLIT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        """Program (n, b): merge row n's nsplit partial (m, l, acc) of heads [b*BLOCK_H, (b+1)*BLOCK_H) with the
        sink, splits in ascending order (NSPLIT > 0: a compile-time count, for the interpreter)."""
        await_inputs(PDL)
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
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


def split_plan(n: int, heads: int, k: int, tiles: AttnTiles, device: torch.device, invariant: bool) -> tuple[int, int]:
    """(splits per row, keys per split): (0, K) is one pass; else cdiv(K, split) programs per row and head block,
    then the combine. `invariant` always splits at the fixed tiles.split, even a row of one split, so a row's
    arithmetic never depends on the batch. Otherwise one pass when the rows' head blocks fill the SMs, else the
    smallest power-of-two multiple of block_n (at most tiles.split) that gives about two programs per SM:
    a decode row's few hundred keys spread over the GPU instead of one SM walking them all."""
    if invariant:
        return max(1, -(-k // tiles.split)), tiles.split
    programs = n * -(-heads // tiles.block_h)
    sms = sm_count(device) or 16
    if programs >= sms or k <= tiles.block_n:
        return 0, k
    want = -(-2 * sms // programs)                          # splits per row for ~2 programs per SM
    split = tiles.block_n
    while split < tiles.split and split * want < k:
        split *= 2
    return -(-k // split), split


def sparse_attention(q: torch.Tensor, sources, sink: torch.Tensor, scale: float, tiles: AttnTiles = DECODE,
                     invariant: bool = False, splits: int | None = None) -> torch.Tensor:
    """The kernels on `supported` inputs (callers check). `splits` (tests, tuning) forces one pass (0) or split-KV
    at tiles.split keys a program (any other value); None: split_plan's choice."""
    n, h, dim = q.shape
    (st1, i1), (st2, i2) = sources[0], (sources[1] if len(sources) == 2 else (sources[0][0], sources[0][1][:, :0]))
    k1, k2 = i1.shape[1], (i2.shape[1] if len(sources) == 2 else 0)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)         # contiguous, whatever q's strides
    if n == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    (a1, n1, r1), (a2, n2, r2) = _pointers(st1, q), _pointers(st2, q)
    i1, i2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (i1, i2))
    sink = sink.to(torch.float32).contiguous()
    if splits is None:
        nsplit, split = split_plan(n, h, k1 + k2, tiles, q.device, invariant)
    else:
        split = tiles.split if splits else k1 + k2
        nsplit = max(1, -(-(k1 + k2) // split)) if splits else 0
    block_h, block_d = min(pow2(h), tiles.block_h), pow2(dim)
    hblocks = -(-h // block_h)
    iters = -(-split // tiles.block_n)                                  # steps per program
    common = dict(BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_N=tiles.block_n, SPLIT=split if nsplit else 1,
                  ONE_PASS=not nsplit, ITERS=iters if INTERPRETED else 0, TWO=len(sources) == 2,
                  F32=q.dtype == torch.float32, num_warps=tiles.warps, num_stages=tiles.stages,
                  **dict(zip(("P1", "Q1", "O1", "B1", "E1"), a1.constexprs)),
                  **dict(zip(("P2", "Q2", "O2", "B2", "E2"), a2.constexprs)))
    args = (a1.p8, a1.p16, n1, i1, a2.p8, a2.p16, n2, i2, sink)
    sizes = (h, dim, k1, k2, r1, r2, max(nsplit, 1), iters, q.stride(0), q.stride(1), a1.stride, n1.stride(0),
             i1.stride(0), a2.stride, n2.stride(0), max(i2.stride(0), 1) if i2.numel() else 1)
    if not nsplit:
        _sparse_attn_kernel[(n, 1, hblocks)](q, *args, out, out, *sizes, out.stride(0), out.stride(1), 0,
                                             scale * LOG2E, **common, **pdl(q.device))
        return out
    part = torch.empty((n, nsplit, h, dim), dtype=torch.float32, device=q.device)
    ml = torch.empty((n, nsplit, h, 2), dtype=torch.float32, device=q.device)
    _sparse_attn_kernel[(n, nsplit, hblocks)](q, *args, part, ml, *sizes, part.stride(0), part.stride(2),
                                              part.stride(1), scale * LOG2E, **common, **pdl(q.device))
    combine_h = min(pow2(h), COMBINE_HEADS)
    _combine_kernel[(n, -(-h // combine_h))](part, ml, sink, out, h, dim, nsplit, part.stride(0), part.stride(1),
                                             part.stride(2), out.stride(0), out.stride(1),
                                             NSPLIT=nsplit if INTERPRETED else 0, BLOCK_H=combine_h,
                                             BLOCK_D=block_d, num_warps=4, **pdl(part.device))
    return out


def sparse_sink_attention_triton(q, sources, sink, scale):
    if not supported(q, sources):
        return _sparse_sink_attention(q, sources, sink, scale)
    return sparse_attention(q, sources, sink, scale, DECODE, invariant=False)


def sparse_sink_attention_triton_invariant(q, sources, sink, scale):
    if not supported(q, sources):
        return _sparse_sink_attention_tiles(q, sources, sink, scale)
    return sparse_attention(q, sources, sink, scale, INVARIANT, invariant=True)
