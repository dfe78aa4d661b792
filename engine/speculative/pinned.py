"""A pinned acceptance model, for speculative-decoding benchmarks on random weights (which accept almost nothing):
acceptance follows given per-position survival rates while the real kernels run the real shapes (as vLLM's
"synthetic" rejection sampler and SGLang's SGLANG_SIMULATE_ACC_LEN pin it for throughput studies).

survival s_1 >= s_2 >= ... : the chance that drafts 1..k are all accepted (a 5-token accepted length, bonus
included, is 1 + s_1 + ... + s_5). Draft k's conditional rate is a_k = s_k / s_{k-1} (s_0 = 1). Each draft gets
its own acceptance odds pi, drawn so that E[pi] = a_k:
    pi = w * u^c + (1 - w) * a_k,   u ~ U(0, 1) from the counter hash,  c = (1 - a_k) / a_k   (E[u^c] = a_k)
w = `spread` in [0, 1]: 0 makes every draft alike (confidences carry no information), 1 spreads them over (0, 1).
The drafter reports pi as its confidence (perfectly calibrated), and verification accepts draft k iff an
independent counter uniform v < pi. Both are keyed by (seed, the position of the row's first draft, k), so a
seeded run is reproducible and a draft's fate does not depend on its batch."""

from __future__ import annotations

from functools import lru_cache

import torch

from deepinfer.kernels.sampling import counter_uniform

from ..sampling.sampler import SALT_ACCEPT, SALT_PINNED


def conditional_rates(survival: tuple[float, ...]) -> list[float]:
    """s_1..s_n -> a_1..a_n (a_k = s_k / s_{k-1}; 0 once the survival is 0)."""
    rates, before = [], 1.0
    for s in survival:
        rates.append(s / before if before > 0 else 0.0)
        before = s
    return rates


def pinned_confidence(survival: tuple[float, ...], spread: float, seeds: torch.Tensor, first: torch.Tensor,
                      gamma: int) -> torch.Tensor:
    """seeds [R], first [R] (the position of each row's first draft) -> acceptance odds pi [R, gamma] float32."""
    a = _rates(survival, gamma, seeds.device)
    u = counter_uniform(seeds, first, gamma, SALT_PINNED)                              # [R, gamma] float64
    c = torch.where(a > 0, (1 - a) / a.clamp(min=1e-12), 0.0)
    pi = spread * torch.where(a > 0, u ** c, 0.0) + (1 - spread) * a
    return pi.float()


@lru_cache(maxsize=64)
def _rates(survival: tuple[float, ...], gamma: int, device: torch.device) -> torch.Tensor:
    """a_1..a_gamma [gamma] float64 on `device`, made once (a CUDA graph of the draft block reads this tensor: no
    host copy while capturing)."""
    return torch.tensor(conditional_rates(survival)[:gamma], dtype=torch.float64, device=device)


def pinned_accepts(survival: tuple[float, ...], spread: float, seeds: torch.Tensor, first: torch.Tensor,
                   lengths: torch.Tensor, width: int) -> torch.Tensor:
    """How many leading drafts of each row are accepted [R] int64: draft k (< lengths[r]) passes when its
    uniform v < pi. width: the widest row's draft count (static shape)."""
    if width == 0:
        return torch.zeros_like(lengths)
    pi = pinned_confidence(survival, spread, seeds, first, width).double()
    v = counter_uniform(seeds, first, width, SALT_ACCEPT)
    live = torch.arange(width, device=seeds.device).unsqueeze(0) < lengths.unsqueeze(1)
    return ((v < pi) & live).long().cumprod(dim=1).sum(dim=1)
