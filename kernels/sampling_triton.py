"""Triton `gumbel_argmax` (the contract and the counter-based noise: kernels/sampling.py), one pass over the
logits for `triton` and `triton_invariant`.

Program (row, chunk of CHUNK ids) hashes the noise in registers and keeps the best (value, lowest id) of its chunk;
the first best chunk (torch's argmax over [B, chunks]) gives the row's id, the lowest among equal maxima as the
reference's. The noise is float64 (the kernel's log is libdevice's on the GPU, numpy's in the interpreter).

Greedy draws (no noise) compare in the logits' own dtype. H200 (docs/results.md): 15 / 25 / 63 us for 1 / 64 / 256
greedy rows (torch's argmax 38 / 43 / 55 us: one row's 129280 ids went to one block), 34 / 89 / 296 us with noise
(the torch recipe 0.14 / 0.99 / 3.48 ms).
"""

from __future__ import annotations

import torch

from .gpu import is_interpreted, on_kernel_device
from .pdl import pdl
from .sampling import GOLDEN, ID_MUL, MIX1, MIX2, POS_MUL, _reference, salted

try:
    import triton
    import triton.language as tl

    from .pdl_triton import await_inputs
except ImportError:          # CPU-only installs
    triton = None

CHUNK = 8192                 # ids a program; V = 129280 -> 16 programs a row
BLOCK = 1024

if triton is not None:
    _GOLDEN, _MIX1, _MIX2 = tl.constexpr(GOLDEN), tl.constexpr(MIX1), tl.constexpr(MIX2)
    _POS_MUL, _ID_MUL = tl.constexpr(POS_MUL), tl.constexpr(ID_MUL)

    @triton.jit
    def _mix(x):
        """splitmix64 on int64 (wraparound multiplies; >> k masked to a logical shift)."""
        x = x + _GOLDEN
        x = (x ^ ((x >> 30) & 0x3FFFFFFFF)) * _MIX1
        x = (x ^ ((x >> 27) & 0x1FFFFFFFFF)) * _MIX2
        return x ^ ((x >> 31) & 0x1FFFFFFFF)

    @triton.jit
    def _draw_kernel(x_ptr, noise_ptr, seed_ptr, pos_ptr, val_ptr, idx_ptr, V, stride_x, salt,
                     NOISE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program (r, c): the best (value, lowest id) of row r's ids [c * CHUNK, +CHUNK) -> val / idx [r, c]."""
        await_inputs(PDL)
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        chunks = tl.num_programs(1)
        best = tl.full((), float("-inf"), val_ptr.dtype.element_ty)      # float64 with noise, else x's dtype
        best_i = tl.full((), V, tl.int64)
        if NOISE:
            noisy = tl.load(noise_ptr + r) != 0
            row = _mix(tl.load(seed_ptr + r) * _GOLDEN + tl.load(pos_ptr + r) * _POS_MUL + salt)
        for i in range(CHUNK // BLOCK):
            ids = c.to(tl.int64) * CHUNK + i * BLOCK + tl.arange(0, BLOCK)
            ok = ids < V
            v = tl.load(x_ptr + r * stride_x + ids, mask=ok, other=float("-inf")).to(val_ptr.dtype.element_ty)
            if NOISE:
                bits = _mix(row ^ (ids * _ID_MUL))
                u = (((bits >> 12) & 0xFFFFFFFFFFFFF).to(tl.float64) + 0.5) * 2.220446049250313e-16   # 2^-52
                v = tl.where(noisy, v - tl.log(-tl.log(u)), v)
            m = tl.max(v, axis=0)
            at = tl.min(tl.where((v == m) & ok, ids, V), axis=0)
            take = (m > best) | ((best_i == V) & (at < V))      # strictly better: an earlier id keeps a tie
            best_i = tl.where(take, at, best_i)
            best = tl.where(take, m, best)
        tl.store(val_ptr + r * chunks + c, best)
        tl.store(idx_ptr + r * chunks + c, best_i)

    INTERPRETED = is_interpreted(_draw_kernel)
else:
    INTERPRETED = False


def supported(x: torch.Tensor, *others) -> bool:
    if triton is None or x.dim() != 2 or x.dtype not in (torch.float32, torch.float64) or x.shape[1] == 0:
        return False
    return on_kernel_device(INTERPRETED, x, *[t for t in others if t is not None])


def draw_kernel(x, noise_rows, seeds, positions, salt):
    """The kernel on `supported` inputs."""
    b, v = x.shape
    if b == 0:
        return torch.empty(0, dtype=torch.long, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    chunks = triton.cdiv(v, CHUNK)
    noise = noise_rows is not None
    val = torch.empty((b, chunks), dtype=torch.float64 if noise else x.dtype, device=x.device)
    idx = torch.empty((b, chunks), dtype=torch.long, device=x.device)
    args = tuple(t.contiguous() for t in (noise_rows.to(torch.int8), seeds.long(), positions.long())) if noise \
        else (x, x, x)                                           # the kernel reads [B] inputs at r: contiguous
    _draw_kernel[(b, chunks)](x, *args, val, idx, v, x.stride(0), salted(salt), NOISE=noise, CHUNK=CHUNK,
                              BLOCK=BLOCK, num_warps=4, **pdl(x.device))
    return idx.gather(1, val.argmax(dim=1, keepdim=True)).squeeze(1)


def _triton(x, noise_rows, seeds, positions, salt):
    if not supported(x, noise_rows, seeds, positions):
        return _reference(x, noise_rows, seeds, positions, salt)
    return draw_kernel(x, noise_rows, seeds, positions, salt)
