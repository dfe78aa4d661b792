"""Verification of draft tokens on the device: which drafts a row accepts, and the token that follows them.

A verify row r carries L drafts d_1..d_L (the first lengths[r] = l_r count, the rest are padding) and the
target's distributions at L + 1 slots: slot j is the token at position positions[r] + j, after d_1..d_j.
The row commits its a_r accepted drafts and one more token (the correction at the first rejected slot, or the
bonus at slot l_r when all l_r drafts were accepted): 1..l_r + 1 tokens.

Rules (greedy rows take the target's argmax under every rule, ties to the lowest id):
    "lossless"  standard speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept d_{j+1} iff
                u_j < p_t,j(d_{j+1}) / p_d,j(d_{j+1}); at the first rejection a, draw from the residual
                normalize(max(0, p_t,a - p_d,a)); when all l_r are accepted, draw the bonus from p_t,l_r exactly as
                the plain sampler would. The committed tokens follow the target's distributions whatever p_d.
    "coupled"   the target draws its own sample s_j at each slot with the plain sampler's noise; accept d_{j+1}
                while it equals s_j and commit s_a. This is what non-speculative decoding would draw, whatever
                l_r (batch-invariant mode: the drafter draws with the same noise, so it agrees often).

All noise is counter-based (kernels/sampling.py): a draw at position p is keyed by (seed, p, salt). Everything is
vectorized over rows and slots with fixed shapes and no host sync, so it can be captured in a CUDA graph; the
price is that the residual and target draws are computed at every slot, [R, L + 1, V] float64 each.
"""

from __future__ import annotations

import torch

from deepinfer.kernels.sampling import counter_uniform, gumbel_noise
from ..sampling.sampler import SALT_ACCEPT, SALT_RESAMPLE, SALT_TARGET

__all__ = ["RULES", "SALT_RESAMPLE", "accepted_probability", "verify"]

RULES = ("lossless", "coupled")
MIN_RESIDUAL = 1e-12       # a residual of less mass (p_t ~ p_d) falls back to drawing from p_t


def accepted_probability(p_t: torch.Tensor, p_d: torch.Tensor) -> torch.Tensor:
    """p_t, p_d [..., V] probabilities -> [...]: sum_x min(p_t(x), p_d(x)) = 1 - TV(p_t, p_d), the chance that
    lossless verification accepts a draft drawn from p_d."""
    return torch.minimum(p_t, p_d).sum(-1)


def _slot_keys(seeds: torch.Tensor, positions: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """seeds [R], positions [R] -> ([R * n], [R * n]): the (seed, position) of slots 0..n-1 of each row."""
    slots = torch.arange(n, device=positions.device)
    pos = (positions.long().unsqueeze(1) + slots).reshape(-1)                 # [R * n]
    return seeds.long().unsqueeze(1).expand(-1, n).reshape(-1), pos


def _gumbel_argmax(x: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt: int) -> torch.Tensor:
    """x [R, n, V] float64 log-weights -> [R, n] int64: argmax(x + Gumbel noise keyed by (seed, position + j))."""
    r, n, v = x.shape
    s, p = _slot_keys(seeds, positions, n)
    return (x + gumbel_noise(s, p, v, salt).view(r, n, v)).argmax(-1)


def _lossless(x: torch.Tensor, drafts: torch.Tensor, draft_logits: torch.Tensor, seeds: torch.Tensor,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, L+1, V] float64 target logits, drafts [R, L] (valid ids), draft_logits [R, L, V]
    -> (accept [R, L] bool, correction [R, L] int64: the residual draw at each slot, were it the first rejection)."""
    r, n_drafts, _ = draft_logits.shape
    p_t = torch.softmax(x[:, :n_drafts], dim=-1)                               # [R, L, V]
    p_d = torch.softmax(draft_logits.double(), dim=-1)                         # [R, L, V]
    pt_d = p_t.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)                    # [R, L]
    pd_d = p_d.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)                    # [R, L]
    s, p = _slot_keys(seeds, positions, n_drafts)
    u = counter_uniform(s, p, 1, SALT_ACCEPT, token_ids=torch.zeros_like(p).unsqueeze(1)).view(r, n_drafts)
    accept = u * pd_d < pt_d                   # u < p_t / p_d without dividing (p_d = 0 < p_t accepts)

    residual = (p_t - p_d).clamp(min=0.0)                                      # [R, L, V], unnormalized
    from_residual = _gumbel_argmax(residual.log(), seeds, positions, SALT_RESAMPLE)        # log 0 = -inf
    from_target = _gumbel_argmax(x[:, :n_drafts], seeds, positions, SALT_RESAMPLE)
    correction = torch.where(residual.sum(-1) > MIN_RESIDUAL, from_residual, from_target)
    return accept, correction


def verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor, draft_logits: torch.Tensor | None,
           lengths: torch.Tensor, greedy: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
           rule: str = "lossless") -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the drafts of R rows at once; returns (accepted [R] int64 in [0, l_r], tokens [R, L+1] int64).

    target_logits [R, L+1, V] float: the sampler's processed logits (penalties, temperature, filters: -inf);
        slot j is the target's distribution for the token at positions[r] + j, after d_1..d_j.
    draft_tokens  [R, L] int64: slot j holds d_{j+1}, drawn at positions[r] + j.
    draft_logits  [R, L, V] float | None: the distributions the drafts were drawn from (same temperature).
        rule "lossless" needs them for its sampled rows. Whether a row samples is not looked at (that would be a
        host sync): the rule assumes sampled rows exist, so None raises ValueError; an all-greedy batch passes
        rule "coupled" instead (greedy rows verify the same under every rule). "coupled" ignores them.
    lengths [R] int64 (l_r <= L: drafts verified; later slots are padding, ignored), greedy [R] bool,
    seeds [R] int64, positions [R] int64: the absolute position of slot 0's token.

    Row r commits tokens[r, :accepted[r] + 1]: tokens[r, j] = d_{j+1} for j < accepted[r], then the correction or
    bonus token; later slots hold -1. Probabilities are computed in float64.
    """
    if rule not in RULES:
        raise ValueError(f"unknown verification rule {rule!r}; allowed: {', '.join(RULES)}")
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [R, L+1, V], got shape {tuple(target_logits.shape)}")
    r, n_slots, v = target_logits.shape
    n_drafts = n_slots - 1
    if tuple(draft_tokens.shape) != (r, n_drafts):
        raise ValueError(f"draft_tokens must be [{r}, {n_drafts}], got {tuple(draft_tokens.shape)}")
    if rule == "lossless":
        if draft_logits is None:
            raise ValueError("rule 'lossless' needs draft_logits for its sampled rows "
                             "(an all-greedy batch can use rule 'coupled': greedy rows verify the same)")
        if tuple(draft_logits.shape) != (r, n_drafts, v):
            raise ValueError(f"draft_logits must be [{r}, {n_drafts}, {v}], got {tuple(draft_logits.shape)}")

    dev = target_logits.device
    x = target_logits.double()                                                 # [R, L+1, V]
    drafts = draft_tokens.long().clamp(0, v - 1)          # padding may hold any value; it never counts
    greedy = greedy.bool().to(dev).unsqueeze(1)                                # [R, 1]
    lengths = lengths.long().to(dev).unsqueeze(1)                              # [R, 1]
    slots = torch.arange(n_slots, device=dev)                                  # [L+1]
    argmax = x.argmax(-1)                                                      # [R, L+1], ties to the lowest id
    target_draw = _gumbel_argmax(x, seeds, positions, SALT_TARGET)             # [R, L+1]: the plain sampler's

    if rule == "coupled":
        own = torch.where(greedy, argmax, target_draw)      # [R, L+1]: the target's own token at each slot
        accept = drafts == own[:, :n_drafts]                                   # [R, L]
        final = own
    else:
        sampled_accept, correction = _lossless(x, drafts, draft_logits, seeds, positions)
        # a sampled row's token after its accepts: the residual draw at a rejected slot, the bonus at slot l_r
        correction = torch.cat([correction, target_draw[:, n_drafts:]], dim=1)  # [R, L+1]
        sampled_final = torch.where(slots == lengths, target_draw, correction)
        accept = torch.where(greedy, drafts == argmax[:, :n_drafts], sampled_accept)
        final = torch.where(greedy, argmax, sampled_final)                     # [R, L+1]

    accept = accept & (slots[:n_drafts] < lengths)                             # [R, L]
    accepted = accept.long().cumprod(dim=1).sum(dim=1)                         # [R]: leading accepts
    a = accepted.unsqueeze(1)                                                  # [R, 1]
    padded = torch.cat([draft_tokens.long(), torch.full_like(a, -1)], dim=1)  # [R, L+1]
    after = torch.where(slots == a, final.gather(1, a), torch.full_like(padded, -1))
    return accepted, torch.where(slots < a, padded, after)
