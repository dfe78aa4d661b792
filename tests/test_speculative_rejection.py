"""deepinfer.speculative.rejection: greedy, lossless and coupled verification of draft tokens (CPU)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels.sampling import gumbel_noise
from deepinfer.sampling.sampler import SALT_DRAFT, SALT_TARGET
from deepinfer.speculative.rejection import accepted_probability, verify

try:
    from scipy.stats import chisquare
except ImportError:       # scipy is optional: compare the statistic with a tabulated critical value instead
    chisquare = None

# chi-square critical values at p = 1e-3 for 1..4 degrees of freedom (standard tables)
CHI2_CRITICAL_1E3 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467}


def _assert_follows(tokens: torch.Tensor, p: torch.Tensor) -> None:
    """tokens [n] int64 drawn i.i.d. from p [V]? Chi-square goodness of fit at p-value > 1e-3 over the ids with
    mass; ids without mass must never appear."""
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    support = p > 0
    assert counts[~support].sum() == 0, f"drew ids without target mass: {counts}"
    observed, expected = counts[support], p[support].double() * tokens.numel()
    if chisquare is not None:
        pvalue = chisquare(observed.numpy(), expected.numpy()).pvalue
        assert pvalue > 1e-3, f"chi-square p = {pvalue:.2e}: observed {observed.tolist()}, expected {expected.tolist()}"
    else:
        stat = float(((observed - expected) ** 2 / expected).sum())
        assert stat < CHI2_CRITICAL_1E3[observed.numel() - 1], f"chi-square statistic {stat:.1f}"


def _rows(logits: torch.Tensor, n: int) -> torch.Tensor:
    """[..., V] -> [n, ..., V]: the same logits in every row."""
    return logits.unsqueeze(0).expand(n, *logits.shape).clone()


# (target logits of slots 0, 1, 2 [3, V], draft logits of slots 0, 1 [2, V]) for V = 5
NEG = float("-inf")
CASES = {
    "smooth": ([[1.0, 0.5, 0.0, -0.5, 0.2], [0.0, 1.2, -1.0, 0.3, 0.3], [0.5, 0.5, 0.5, -2.0, 1.0]],
               [[0.0, 1.0, 0.5, 0.5, -1.0], [1.0, 0.0, 0.0, 0.8, -0.5]]),
    # temperature 0.3: sharp distributions on both sides, the draft's mode differs from the target's
    "sharp": ([[v / 0.3 for v in row] for row in [[1.0, 0.6, 0.0, -0.5, 0.2], [0.0, 1.2, -1.0, 0.9, 0.3],
                                                  [0.5, 0.2, 0.1, -2.0, 1.0]]],
              [[v / 0.3 for v in row] for row in [[0.6, 1.0, 0.5, 0.5, -1.0], [1.0, 0.6, 0.0, 1.2, -0.5]]]),
    # the draft has no mass on ids the target likes (ids 0 and 3), the target filtered id 4 the draft likes
    "disjoint": ([[1.0, 0.5, 0.0, 0.3, NEG], [0.0, 1.2, -1.0, 1.0, NEG], [0.5, 0.5, 0.5, -2.0, 1.0]],
                 [[NEG, 1.0, 0.5, NEG, 0.8], [NEG, 0.0, 0.0, NEG, 1.5]]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_lossless_commits_the_target_distributions(case):
    target, draft = (torch.tensor(t) for t in CASES[case])
    n, v = 20000, target.shape[-1]
    seeds, positions = torch.arange(n), 100 + torch.arange(n) % 13
    # drafts as a real drafter draws them: Gumbel-max on p_d at positions p and p + 1, salt SALT_DRAFT
    d1 = (draft[0].double() + gumbel_noise(seeds, positions, v, SALT_DRAFT)).argmax(-1)
    d2 = (draft[1].double() + gumbel_noise(seeds, positions + 1, v, SALT_DRAFT)).argmax(-1)
    accepted, tokens = verify(_rows(target, n), torch.stack([d1, d2], 1), _rows(draft, n),
                              torch.full((n,), 2), torch.zeros(n, dtype=torch.bool), seeds, positions)
    p_t, p_d = torch.softmax(target.double(), -1), torch.softmax(draft.double(), -1)

    _assert_follows(tokens[:, 0], p_t[0])
    first = accepted >= 1                                 # these rows committed a second token, from slot 1
    _assert_follows(tokens[first, 1], p_t[1])
    _assert_follows(tokens[accepted == 2, 2], p_t[2])    # the bonus

    beta = float(accepted_probability(p_t[0], p_d[0]))
    rate = first.double().mean().item()
    assert abs(rate - beta) < 4 * (beta * (1 - beta) / n) ** 0.5, (rate, beta)
    assert torch.equal(tokens[first, 0], d1[first]) and torch.equal(tokens[accepted == 2, 1], d2[accepted == 2])
    assert (tokens[accepted < 2, 2] == -1).all()


def test_lossless_accepts_every_draft_of_the_target_itself():
    target, _, lengths, greedy, seeds, positions = _random_batch(256, 3, 9)
    drafts = _own_draws(target, torch.zeros_like(greedy), seeds, positions)[:, :3]
    accepted, tokens = verify(target, drafts, target[:, :3].clone(), lengths, greedy, seeds, positions)
    sampled = ~greedy
    assert torch.equal(accepted[sampled], lengths[sampled])     # p_t = p_d: the ratio is 1 > u
    bonus = _own_draws(target, greedy, seeds, positions).gather(1, lengths.unsqueeze(1)).squeeze(1)
    assert torch.equal(tokens.gather(1, accepted.unsqueeze(1)).squeeze(1)[sampled], bonus[sampled])


def test_greedy_rows_follow_the_argmax():
    v = 6
    slot_argmax = [2, 4, 1, 5]                             # L = 3: slots 0..3
    logits = torch.full((4, v), -1.0)
    logits[torch.arange(4), torch.tensor(slot_argmax)] = 3.0
    logits[2, 3] = 3.0                                     # a tie at slot 2: the lowest id (1) wins
    rows = [([2, 4, 0], 3, 2), ([2, 4, 1], 3, 3), ([2, 4, 1], 0, 0), ([2, 4, 1], 1, 1), ([2, 0, 1], 3, 1)]
    target = _rows(logits, len(rows))
    drafts = torch.tensor([d for d, _, _ in rows])
    lengths = torch.tensor([ell for _, ell, _ in rows])
    greedy = torch.ones(len(rows), dtype=torch.bool)
    seeds, positions = torch.arange(len(rows)), torch.full((len(rows),), 7)
    for rule, draft_logits in (("lossless", torch.randn(len(rows), 3, v)), ("coupled", None)):
        accepted, tokens = verify(target, drafts, draft_logits, lengths, greedy, seeds, positions, rule=rule)
        assert accepted.tolist() == [a for _, _, a in rows]
        assert tokens.tolist() == [
            [2, 4, 1, -1],            # d_3 mismatches: the argmax of slot 2
            [2, 4, 1, 5],             # all accepted: the bonus argmax of slot 3
            [2, -1, -1, -1],          # l = 0: slot 0's argmax
            [2, 4, -1, -1],           # l = 1: padding drafts that would match are ignored; bonus of slot 1
            [2, 4, -1, -1],           # d_2 mismatches at slot 1
        ]


def _random_batch(r: int, n_drafts: int, v: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(r, n_drafts + 1, v, generator=g) * 2
    target[:, :, -1] = NEG                                 # a filtered id
    draft = target[:, :n_drafts] + 0.7 * torch.randn(r, n_drafts, v, generator=g)
    lengths = torch.randint(0, n_drafts + 1, (r,), generator=g)
    greedy = torch.rand(r, generator=g) < 0.3
    seeds, positions = torch.randint(0, 2**40, (r,), generator=g), torch.randint(0, 4096, (r,), generator=g)
    return target, draft, lengths, greedy, seeds, positions


def _own_draws(target, greedy, seeds, positions):
    """[R, L+1]: what plain one-at-a-time sampling draws at each slot (argmax for greedy rows)."""
    v = target.shape[-1]
    noisy = [(target[:, j].double() + gumbel_noise(seeds, positions + j, v, SALT_TARGET)).argmax(-1)
             for j in range(target.shape[1])]
    return torch.where(greedy.unsqueeze(1), target.argmax(-1), torch.stack(noisy, 1))


def test_coupled_commits_the_plain_draws():
    r, n_drafts, v = 256, 4, 11
    target, _, lengths, greedy, seeds, positions = _random_batch(r, n_drafts, v)
    own = _own_draws(target, greedy, seeds, positions)
    g = torch.Generator().manual_seed(1)
    noise = torch.randint(0, v, (r, n_drafts), generator=g)
    drafts = torch.where(torch.rand(r, n_drafts, generator=g) < 0.8, own[:, :n_drafts], noise)   # agree often
    accepted, tokens = verify(target, drafts, None, lengths, greedy, seeds, positions, rule="coupled")
    for row in range(r):
        a, ell = int(accepted[row]), int(lengths[row])
        expect = 0
        while expect < ell and drafts[row, expect] == own[row, expect]:
            expect += 1
        assert a == expect
        assert tokens[row, :a + 1].tolist() == own[row, :a + 1].tolist()
        assert (tokens[row, a + 1:] == -1).all()
    assert 0 < accepted.double().mean() < n_drafts            # the batch mixes acceptances and rejections


def test_lossless_without_drafts_is_the_plain_sampler():
    r, v = 64, 50
    target, _, _, _, seeds, positions = _random_batch(r, 0, v)
    plain = (target[:, 0].double() + gumbel_noise(seeds, positions, v, SALT_TARGET)).argmax(-1)
    for n_drafts in (0, 3):          # L = 0, and l = 0 with padding slots
        padded = torch.cat([target, torch.randn(r, n_drafts, v)], dim=1)
        accepted, tokens = verify(padded, torch.zeros(r, n_drafts, dtype=torch.long), torch.randn(r, n_drafts, v),
                                  torch.zeros(r, dtype=torch.long), torch.zeros(r, dtype=torch.bool), seeds, positions)
        assert tokens.shape == (r, n_drafts + 1)
        assert (accepted == 0).all() and torch.equal(tokens[:, 0], plain)


def test_outputs_are_reproducible_and_depend_on_the_seed():
    target, draft, lengths, greedy, seeds, positions = _random_batch(512, 3, 9)
    drafts = draft.argmax(-1)
    for rule in ("lossless", "coupled"):
        first = verify(target, drafts, draft, lengths, greedy, seeds, positions, rule=rule)
        again = verify(target.clone(), drafts.clone(), draft.clone(), lengths, greedy, seeds.clone(), positions,
                       rule=rule)
        other = verify(target, drafts, draft, lengths, greedy, seeds + 1, positions, rule=rule)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
        assert not torch.equal(first[1], other[1])
        assert torch.equal(first[1][greedy], other[1][greedy])       # greedy rows ignore the seed


def test_float32_and_float64_logits_agree():
    target, draft, lengths, greedy, seeds, positions = _random_batch(128, 3, 9)
    drafts = draft.argmax(-1)
    out32 = verify(target.float(), drafts, draft.float(), lengths, greedy, seeds, positions)
    out64 = verify(target.double(), drafts, draft.double(), lengths, greedy, seeds, positions)
    assert torch.equal(out32[0], out64[0]) and torch.equal(out32[1], out64[1])


def test_bad_arguments_raise():
    target, draft, lengths, greedy, seeds, positions = _random_batch(4, 2, 7)
    drafts = draft.argmax(-1)
    with pytest.raises(ValueError, match="lossless.*coupled"):
        verify(target, drafts, draft, lengths, greedy, seeds, positions, rule="typical")
    with pytest.raises(ValueError, match="draft_logits"):
        verify(target, drafts, None, lengths, torch.zeros(4, dtype=torch.bool), seeds, positions)
    with pytest.raises(ValueError, match="draft_tokens"):
        verify(target, drafts[:, :1], draft, lengths, greedy, seeds, positions)
