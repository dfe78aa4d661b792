"""Triton lightning-indexer ops for both Triton sets: `sparse_index_scores` with each
row's candidate keys read by index straight from the key store, no gathered [rows, K, dI] copy and no per-head
[rows, h, K] score tensor.

Contract (kernels/indexer.py): q [N, h, dI], weights [N, h], store [M, dI], index [N, K] rows of the store (-1: no
candidate) -> [N, K] fp32, sum_h w_h * scale * ReLU(q_h . k), -inf where the index is -1.

Program (n, j): row n, candidates [j*BLOCK_K, +BLOCK_K): keys [BLOCK_K, dI] gathered by index, q [h, dI] times
keys^T on tensor cores (fp32 accumulate; fp32 inputs at ieee precision), ReLU, the scale, the head-weighted sum
over h in fp32. A score depends only on its row's q and its key, whatever the tiling or the batch, so the kernel is
batch-invariant as it is and serves both Triton sets.

Top-k (`top_k_indices`): program n maps its scores to an ordered 32-bit key (-inf -> 0), finds the
k-th best key t by a radix select (4 passes from the top byte, each a 256-bin histogram of the keys that share the
bits chosen so far), takes every key > t and the first k - count(> t) keys == t in index order (a running cumsum),
and sorts the k taken (key, -position) pairs: exactly the stable sort's selection and order (integer outputs; equal
to the reference in the interpreter on FP4-like tied scores and signed zeros). A row of up to TOPK_BLOCK keys is
kept in registers for the select's passes; a row with at most k finite keys takes them all without the select. On
the H200 the bisection it replaced (34 counting passes) took 217 us for 2048 of 32768 keys of one row,
torch's stable sort 56 us.

Numerics: the head sum runs in a different order than the reference's, so scores differ in the last bits; near
ties can then select differently (GPU tests compare scores, not selections). Interpreter, fp32: <= 1e-6 of the
row's max |score| (tests/interpreted/test_indexer_triton.py).
"""

from __future__ import annotations

import torch

from .indexer import _sparse_index_scores, _sparse_index_scores_tiles, _top_k_indices
from .kv_formats import PackedStore, raw
from .kv_formats_triton import readable, record_args
from .gpu import is_interpreted, on_kernel_device, pow2
from .pdl import pdl

try:
    import triton
    import triton.language as tl

    from .kv_formats_triton import load_records
    from .pdl_triton import await_inputs
except ImportError:          # CPU-only installs
    triton = None

BLOCK_K = 64                 # candidates per program
WARPS = 4


def supported(q: torch.Tensor, weights: torch.Tensor, store: torch.Tensor, index: torch.Tensor) -> bool:
    """Keys plain in q's dtype, or packed records (kernels/kv_formats.py) the kernel decodes in registers."""
    if triton is None or q.dim() != 3 or store.dim() != 2 or q.shape[1] > 128 or q.shape[2] > 256:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or store.dtype != q.dtype:
        return False
    if isinstance(store, PackedStore) and not readable(store, q.shape[2]):
        return False
    return on_kernel_device(INTERPRETED, q, weights, raw(store), index)


if triton is not None:

    @triton.jit
    def _index_scores_kernel(q_ptr, w_ptr, s_ptr, s16_ptr, i_ptr, o_ptr, H, DI, K, stride_qn, stride_qh, stride_wn,
                             stride_s, stride_in, stride_on, scale,
                             BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, F32: tl.constexpr,
                             P: tl.constexpr, PQ: tl.constexpr, PO: tl.constexpr, PB: tl.constexpr,
                             PE: tl.constexpr, PDL: tl.constexpr):
        await_inputs(PDL)
        n = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_ok, d_ok, j_ok = h < H, d < DI, j < K
        q = tl.load(q_ptr + n * stride_qn + h[:, None] * stride_qh + d[None, :], mask=h_ok[:, None] & d_ok[None, :],
                    other=0.0)                                                   # [BLOCK_H, BLOCK_D]
        w = tl.load(w_ptr + n * stride_wn + h, mask=h_ok, other=0.0).to(tl.float32)
        idx = tl.load(i_ptr + n * stride_in + j, mask=j_ok, other=-1)
        ok = idx >= 0
        if P == 0:
            keys = tl.load(s_ptr + idx[:, None] * stride_s + d[None, :], mask=ok[:, None] & d_ok[None, :],
                           other=0.0)
        else:                                                                    # packed records (P > 0)
            keys = load_records(s_ptr, s16_ptr, idx * stride_s, d, ok, DI, P, PQ, PO, PB, PE, q_ptr.dtype.element_ty)
        if F32:
            s = tl.dot(q, tl.trans(keys), input_precision="ieee")               # [BLOCK_H, BLOCK_K] fp32
        else:
            s = tl.dot(q, tl.trans(keys))
        s = tl.maximum(s, 0.0) * scale
        score = tl.sum(s * w[:, None], axis=0)                                   # [BLOCK_K]
        score = tl.where(ok, score, float("-inf"))
        tl.store(o_ptr + n * stride_on + j, score, mask=j_ok)

    @triton.jit
    def _ordered_key(score):
        """fp32 -> int64 key in [0, 2^32) ordered as the scores; -inf (no candidate) -> 0, below every finite; -0.0
        keys as +0.0 (the sort ties them: a query whose heads all ReLU to 0 under negative weights scores -0.0)."""
        score = tl.where(score == 0.0, 0.0, score)
        bits = score.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        key = tl.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits + 0x80000000)
        return tl.where(score == float("-inf"), 0, key)

    @triton.jit
    def _row_keys(s_ptr, row, K, j):
        """The ordered keys of the row's scores at positions j (-inf, key 0, past K)."""
        return _ordered_key(tl.load(s_ptr + row + j, mask=j < K, other=float("-inf")))

    @triton.jit
    def _count_at_least(s_ptr, row, K, t, resident, BLOCK: tl.constexpr, TILES: tl.constexpr):
        """How many of the row's keys are >= t: from `resident` (the row's keys, one tile) or tile by tile."""
        if TILES == 1:
            c = tl.sum((resident >= t).to(tl.int32), axis=0)
        else:
            c = 0
            for i in range(TILES):
                j = i * BLOCK + tl.arange(0, BLOCK)
                key = _row_keys(s_ptr, row, K, j)
                c += tl.sum((key >= t).to(tl.int32), axis=0)
        return c

    @triton.jit
    def _digit_histogram(s_ptr, row, K, resident, prefix, shift, BLOCK: tl.constexpr, TILES: tl.constexpr):
        """[512] int32: how many of the row's keys whose bits above `shift + 8` equal `prefix` have each value of
        bits shift .. shift + 7 (bins 0..255); every other key counts into bin 256. No mask into the histogram
        (kernels/routing.py says why a masked tl.histogram miscounts on the GPU)."""
        if TILES == 1:
            hist = tl.histogram(_digit(resident, prefix, shift), 512)
        else:
            hist = tl.zeros((512,), dtype=tl.int32)
            for i in range(TILES):
                j = i * BLOCK + tl.arange(0, BLOCK)
                key = _row_keys(s_ptr, row, K, j)
                hist += tl.histogram(_digit(key, prefix, shift), 512)
        return hist

    @triton.jit
    def _digit(key, prefix, shift):
        return tl.where((key >> (shift + 8)) == prefix, (key >> shift) & 255, 256).to(tl.int32)

    @triton.jit
    def _top_k_kernel(s_ptr, o_ptr, tmp_ptr, K, k, stride_s, stride_o, stride_t,
                      BLOCK: tl.constexpr, TILES: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr):
        """Program n: row n's k best finite scores (best first, ties to the lower position), exactly the stable
        sort's selection. A radix select over the 32-bit ordered key, 8 bits a pass from the top, finds the
        threshold t (the k-th best key); one pass in index order takes every key > t and the first
        k - count(> t) keys == t; a sort of the k taken (key, -position) pairs orders them. -1 fills a row with
        fewer than k finite scores. A row of one tile stays in registers for every pass; a row with at most k
        finite keys takes them all (no select: a decode row's few hundred entries under the indexer's top-k)."""
        await_inputs(PDL)
        n = tl.program_id(0).to(tl.int64)
        row = n * stride_s
        j0 = tl.arange(0, BLOCK)
        resident = _row_keys(s_ptr, row, K, j0)
        finite = _count_at_least(s_ptr, row, K, 1, resident, BLOCK, TILES)
        want = tl.minimum(finite, k)
        prefix = tl.full((), 1, tl.int64)       # at most k finite: t = 1, below every finite key (-inf is 0)
        if finite > k:
            prefix = tl.full((), 0, tl.int64)
            remaining = want                    # keys still to take among those under prefix
            bins = tl.arange(0, 512)
            for p in tl.static_range(4):
                hist = _digit_histogram(s_ptr, row, K, resident, prefix, 24 - 8 * p, BLOCK, TILES)
                hist = tl.where(bins < 256, hist, 0)
                ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist          # keys with digit >= bin
                b = tl.max(tl.where((ge >= remaining) & (bins < 256), bins, -1), axis=0)
                remaining -= tl.sum(tl.where(bins > b, hist, 0), axis=0)
                prefix = prefix * 256 + b
        t = tl.where(want > 0, prefix, 0xFFFFFFFF + 1)
        ties = want - _count_at_least(s_ptr, row, K, t + 1, resident, BLOCK, TILES)     # keys == t to take
        taken = 0
        seen_eq = 0
        for i in range(TILES):
            j = i * BLOCK + tl.arange(0, BLOCK)
            key = _row_keys(s_ptr, row, K, j)
            eq = (key == t) & (j < K)
            eq_rank = seen_eq + tl.cumsum(eq.to(tl.int32), axis=0) - eq.to(tl.int32)
            take = ((key > t) | (eq & (eq_rank < ties))) & (j < K)
            pos = taken + tl.cumsum(take.to(tl.int32), axis=0) - take.to(tl.int32)
            composite = (key - 0x80000000) * 0x100000000 + (0xFFFFFFFF - j.to(tl.int64))
            tl.store(tmp_ptr + n * stride_t + pos, composite, mask=take)
            taken += tl.sum(take.to(tl.int32), axis=0)
            seen_eq += tl.sum(eq.to(tl.int32), axis=0)
        tl.debug_barrier()
        p = tl.arange(0, K_PAD)
        got = tl.load(tmp_ptr + n * stride_t + p, mask=p < want, other=-0x7FFFFFFFFFFFFFFF - 1)
        ordered = tl.sort(got, descending=True)
        position = 0xFFFFFFFF - (ordered & 0xFFFFFFFF)
        tl.store(o_ptr + n * stride_o + p, tl.where(p < want, position, -1), mask=p < k)

    INTERPRETED = is_interpreted(_index_scores_kernel)
else:
    INTERPRETED = False


def index_scores_kernel(q, weights, store, index, scale) -> torch.Tensor:
    """The kernel on `supported` inputs (callers check)."""
    n, h, di = q.shape
    k = index.shape[1]
    out = torch.empty((n, k), dtype=torch.float32, device=q.device)
    if n == 0 or k == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    keys = record_args(store)
    weights = weights.contiguous()
    index = index if index.stride(-1) == 1 else index.contiguous()
    _index_scores_kernel[(n, triton.cdiv(k, BLOCK_K))](
        q, weights, keys.p8, keys.p16, index, out, h, di, k, q.stride(0), q.stride(1), weights.stride(0),
        keys.stride, index.stride(0), out.stride(0), float(scale), BLOCK_H=pow2(h), BLOCK_D=pow2(di),
        BLOCK_K=BLOCK_K, F32=q.dtype == torch.float32, num_warps=WARPS,
        **dict(zip(("P", "PQ", "PO", "PB", "PE"), keys.constexprs)), **pdl(q.device))
    return out


TOPK_BLOCK = 4096          # keys a tile at most; a row of one tile stays in registers


def top_k_supported(scores: torch.Tensor, k: int) -> bool:
    if triton is None or scores.dim() != 2 or scores.dtype != torch.float32 or not 1 <= k <= 2048:
        return False
    return on_kernel_device(INTERPRETED, scores)


def top_k_kernel(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The kernel on `top_k_supported` inputs: [N, K] fp32 -> [N, min(k, K)] int64."""
    n, width = scores.shape
    k = min(k, width)
    out = torch.empty((n, k), dtype=torch.long, device=scores.device)
    if n == 0 or k == 0:
        return out
    scores = scores if scores.stride(-1) == 1 else scores.contiguous()
    k_pad = pow2(k)
    tmp = torch.empty((n, k_pad), dtype=torch.long, device=scores.device)
    block = max(128, min(pow2(width), TOPK_BLOCK))
    _top_k_kernel[(n,)](scores, out, tmp, width, k, scores.stride(0), out.stride(0), tmp.stride(0),
                        BLOCK=block, TILES=triton.cdiv(width, block), K_PAD=k_pad, num_warps=4 if block <= 1024 else 8,
                        **pdl(scores.device))
    return out


SORT_ROWS = 16                 # fewer rows than this, each wider than SORT_WIDTH keys: torch's stable sort instead
SORT_WIDTH = 2 * TOPK_BLOCK


def sort_is_faster(scores: torch.Tensor) -> bool:
    """Few long rows: one program a row walks a wide row tile by tile, a latency chain the GPU cannot spread; the
    stable sort spreads it. H200: one row of 32768 took 217 us in the bisection kernel (about 168 us a
    call in the radix select, the 32k decode step's trace) against the sort's 56 us; 8192 keys 52 against 56; 64 rows
    of 16384 97 against 141. Both give the same integers, so the choice never changes a result."""
    return scores.shape[0] < SORT_ROWS and scores.shape[1] > SORT_WIDTH


def top_k_indices_triton(scores, k):
    if not top_k_supported(scores, k) or sort_is_faster(scores):
        return _top_k_indices(scores, k)
    return top_k_kernel(scores, k)          # integer outputs of a row's own scores: invariant as it is


def sparse_index_scores_triton(q, weights, store, index, scale):
    if not supported(q, weights, store, index):
        return _sparse_index_scores(q, weights, store, index, scale)
    return index_scores_kernel(q, weights, store, index, scale)


def sparse_index_scores_triton_invariant(q, weights, store, index, scale):
    if not supported(q, weights, store, index):
        return _sparse_index_scores_tiles(q, weights, store, index, scale)
    return index_scores_kernel(q, weights, store, index, scale)      # row-independent: invariant as it is
