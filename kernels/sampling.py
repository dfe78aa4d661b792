"""The sampler's counter-based noise and its draw, `gumbel_argmax`: one pass over the logits.

Counter-based noise: the uniform of vocabulary id v for the token at absolute position p of a request with seed s
is a pure function of (s, p, v, salt), a SplitMix64 hash turned into a float64 in (0, 1) (engine/sampling/
sampler.py says why). The hash lives here so a kernel can compute it where it reads the logits.

gumbel_argmax(x [B, V] float, noise_rows [B] bool | None, seeds [B], positions [B], salt) -> [B] int64:
    noisy = x.double() + gumbel_noise(seeds, positions, V, salt)      Gumbel(0, 1) = -log(-log(u)), float64
    out   = where(noise_rows, noisy.argmax(-1), x.argmax(-1))        ties to the lowest id; None: x.argmax(-1)
The reference makes the [B, V] noise in about 30 int64 / float64 torch passes (at B = 64 and V = 129280 about
4 GB of traffic a step); the Triton kernel (kernels/sampling_triton.py) hashes in registers, one kernel for
`triton` and `triton_invariant` (a row's result depends on that row only). The noise is float64 in both; the drawn
ids equal the reference's unless two noisy values tie to within an ulp of float64. Logits must not be NaN (neither
path defines which id a NaN row draws).
"""

from __future__ import annotations

import torch

from .registry import call

__all__ = ["counter_uniform", "gumbel_argmax", "gumbel_noise"]

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


def _reference(x, noise_rows, seeds, positions, salt):
    plain = x.argmax(dim=-1)                          # the first (lowest) id among equal maxima
    if noise_rows is None:
        return plain
    drawn = (x.double() + gumbel_noise(seeds, positions, x.shape[-1], salt)).argmax(dim=-1)
    return torch.where(noise_rows, drawn, plain)
