"""The sampler's counter-based noise and its draw, `gumbel_argmax`: one pass over the logits.

Counter-based noise: the uniform of vocabulary id v for the token at absolute position p of a request with seed s
is a pure function of (s, p, v, salt), a SplitMix64 hash turned into a float64 in (0, 1) (engine/sampling/
sampler.py says why). The hash lives here so a kernel can compute it where it reads the logits.

gumbel_argmax(x [B, V] float, noise_rows [B] bool | None, seeds [B], positions [B], salt) -> [B] int64:
    noisy = x.double() + gumbel_noise(seeds, positions, V, salt)      Gumbel(0, 1) = -log(-log(u)), float64
    out   = where(noise_rows, noisy.argmax(-1), x.argmax(-1))        ties to the lowest id; None: x.argmax(-1)
The reference makes the [B, V] noise in about 30 int64 / float64 torch passes (at B = 64 and V = 129280 about
4 GB of traffic a step); the Triton kernel hashes in registers: program (row, chunk of CHUNK ids) keeps the best
(value, lowest id) of its chunk, and the first best chunk (torch's argmax over [B, chunks]) gives the row's
id, the lowest among equal maxima as the reference's. A row's result depends on that row only, so one kernel
serves `triton` and `triton_invariant`. The noise is float64 in both (the kernel's log is libdevice's on the
GPU, numpy's in the interpreter); the drawn ids equal the reference's unless two noisy values tie to within an
ulp of float64. Logits must not be NaN (neither path defines which id a NaN row draws).

Greedy draws (no noise) compare in the logits' own dtype. H200, session 26 (docs/results.md): 15 / 25 / 63 us for
1 / 64 / 256 greedy rows (torch's argmax 38 / 43 / 55 us: one row's 129280 ids went to one block), 34 / 89 / 296 us
with noise (the torch recipe 0.14 / 0.99 / 3.48 ms).

GPU status: `pytest -m gpu tests/test_kernels_sampling.py` passed on an H200 (session 26), so it is in the Triton
sets.
"""

from __future__ import annotations

import torch

from .registry import call, implements, is_interpreted, on_kernel_device

try:
    import triton
    import triton.language as tl
except ImportError:          # CPU-only installs
    triton = None

__all__ = ["counter_uniform", "gumbel_argmax", "gumbel_noise"]

IN_TRITON_SETS = True      # passed `pytest -m gpu` on an H200 (docs/results.md)
CHUNK = 8192                 # ids a program; V = 129280 -> 16 programs a row
BLOCK = 1024

_MASK64 = (1 << 64) - 1


def _i64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return c - (1 << 64) if c >= 1 << 63 else c


GOLDEN, MIX1, MIX2 = _i64(0x9E3779B97F4A7C15), _i64(0xBF58476D1CE4E5B9), _i64(0x94D049BB133111EB)
POS_MUL, ID_MUL, SALT_MUL = _i64(0xD6E8FEB86659FD93), _i64(0xA0761D6478BD642F), _i64(0xE7037ED1A0B428DB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer on int64 tensors (two's-complement wraparound multiplies)."""
    x = x + GOLDEN
    x = (x ^ _shr(x, 30)) * MIX1
    x = (x ^ _shr(x, 27)) * MIX2
    return x ^ _shr(x, 31)


def salted(salt: int) -> int:
    return _i64((salt * SALT_MUL) & _MASK64)


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int, salt: int = 0,
                    token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """seeds [B], positions [B] (int64) -> float64 uniforms in (0, 1), [B, vocab] (or [B, K] for the given
    token_ids [B, K]): a pure function of (seed, position, token id, salt)."""
    dev = seeds.device
    ids = torch.arange(vocab, device=dev).unsqueeze(0) if token_ids is None else token_ids.to(dev)
    row = splitmix64(seeds.long() * GOLDEN + positions.long().to(dev) * POS_MUL + salted(salt))
    bits = splitmix64(row.unsqueeze(1) ^ (ids.long() * ID_MUL))
    return (_shr(bits, 12).double() + 0.5) * 2.0 ** -52          # 52 bits: strictly inside (0, 1)


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int, salt: int = 0) -> torch.Tensor:
    """[B, vocab] float64 Gumbel(0, 1) noise, counter-based."""
    return -torch.log(-torch.log(counter_uniform(seeds, positions, vocab, salt)))


def gumbel_argmax(x: torch.Tensor, noise_rows: torch.Tensor | None, seeds: torch.Tensor, positions: torch.Tensor,
                  salt: int = 0) -> torch.Tensor:
    """x [B, V] -> [B] int64: rows in noise_rows draw argmax(x + Gumbel noise), the others argmax(x) (docstring)."""
    return call("gumbel_argmax")(x, noise_rows, seeds, positions, salt)


@implements("gumbel_argmax", "reference")
def _reference(x, noise_rows, seeds, positions, salt):
    plain = x.argmax(dim=-1)                          # the first (lowest) id among equal maxima
    if noise_rows is None:
        return plain
    drawn = (x.double() + gumbel_noise(seeds, positions, x.shape[-1], salt)).argmax(dim=-1)
    return torch.where(noise_rows, drawn, plain)


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
                     NOISE: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        """Program (r, c): the best (value, lowest id) of row r's ids [c * CHUNK, +CHUNK) -> val / idx [r, c]."""
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
                              BLOCK=BLOCK, num_warps=4)
    return idx.gather(1, val.argmax(dim=1, keepdim=True)).squeeze(1)


def _triton(x, noise_rows, seeds, positions, salt):
    if not supported(x, noise_rows, seeds, positions):
        return _reference(x, noise_rows, seeds, positions, salt)
    return draw_kernel(x, noise_rows, seeds, positions, salt)


if triton is not None and IN_TRITON_SETS:
    implements("gumbel_argmax", "triton")(_triton)
    implements("gumbel_argmax", "triton_invariant")(_triton)
