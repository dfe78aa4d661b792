"""The batched sampler: counter-based seeded noise, filters, penalties, greedy ties."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.kernels.sampling import counter_uniform
from deepinfer.sampling.sampler import (SALT_DRAFT, SALT_TARGET, SamplingTensors, apply_filters, apply_penalties,
                                        logprobs, sample)


def tensors(b: int, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, seeds=None, positions=None, **kw):
    full = lambda v, dt: torch.full((b,), v, dtype=dt)  # noqa: E731
    return SamplingTensors(temperature=full(temperature, torch.float32), top_k=full(top_k, torch.long),
                           top_p=full(top_p, torch.float32), min_p=full(min_p, torch.float32),
                           seeds=torch.arange(b) if seeds is None else seeds,
                           positions=torch.zeros(b, dtype=torch.long) if positions is None else positions, **kw)


def test_noise_is_a_pure_function_of_seed_position_and_id():
    seeds, pos = torch.tensor([7, 7, 9]), torch.tensor([3, 4, 3])
    u = counter_uniform(seeds, pos, 50)
    assert u.dtype == torch.float64 and (u > 0).all() and (u < 1).all()
    again = counter_uniform(seeds.flip(0), pos.flip(0), 50).flip(0)
    assert torch.equal(u, again)
    assert torch.equal(counter_uniform(seeds, pos, 50, token_ids=torch.tensor([[5, 6]] * 3)), u[:, 5:7])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert not torch.equal(u, counter_uniform(seeds, pos, 50, salt=SALT_DRAFT))
    big = counter_uniform(torch.tensor([1]), torch.tensor([0]), 200_000)[0]
    assert abs(big.mean().item() - 0.5) < 0.005 and abs(big.var().item() - 1 / 12) < 0.002


def test_seeded_draw_does_not_depend_on_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 64)
    t = tensors(4, temperature=0.9, top_p=0.9, seeds=torch.tensor([11, 12, 13, 14]), positions=torch.tensor([5, 9, 2, 7]))
    together = sample(logits, t)
    for i in range(4):
        alone = tensors(1, temperature=0.9, top_p=0.9, seeds=t.seeds[i:i + 1], positions=t.positions[i:i + 1])
        assert sample(logits[i:i + 1], alone).item() == together[i].item()
    other = tensors(4, temperature=0.9, top_p=0.9, seeds=torch.tensor([21, 22, 23, 24]), positions=t.positions)
    draws = torch.stack([sample(logits, tensors(4, temperature=0.9, seeds=t.seeds, positions=t.positions + k))
                         for k in range(20)])
    draws_other = torch.stack([sample(logits, tensors(4, temperature=0.9, seeds=other.seeds, positions=t.positions + k))
                               for k in range(20)])
    assert not torch.equal(draws, draws_other)


CHI2_DF7_P001 = 24.32   # chi-square critical value, 7 degrees of freedom, p = 0.001


@pytest.mark.parametrize("temperature, top_k", [(1.0, -1), (0.7, -1), (1.3, 4)])
def test_draws_follow_the_target_distribution(temperature, top_k):
    """20000 seeded draws (one per position) over 8 ids: chi-square against softmax(logits / T), renormalized
    over the top-k ids; ids outside the top-k never drawn."""
    logits = torch.tensor([[1.5, 0.2, -0.3, 0.9, -1.0, 0.0, 0.4, -0.6]])
    n = 20000
    t = tensors(n, temperature=temperature, top_k=top_k, seeds=torch.full((n,), 1234), positions=torch.arange(n))
    got = torch.bincount(sample(logits.expand(n, -1), t), minlength=8).double()
    p = torch.softmax(logits[0].double() / temperature, dim=-1)
    if top_k > 0:
        keep = p >= p.topk(top_k).values[-1]
        assert got[~keep].sum() == 0
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum()
    expected = p * n
    mask = expected > 0
    chi2 = (((got - expected) ** 2)[mask] / expected[mask]).sum().item()
    assert chi2 < CHI2_DF7_P001, (chi2, got.tolist(), expected.tolist())


def test_greedy_ties_go_to_the_lowest_id_and_greedy_rows_ignore_noise():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, -1.0, 0.0]])
    t = tensors(2, temperature=0.0)
    assert sample(logits, t).tolist() == [1, 0]
    mixed = tensors(2, temperature=1.0)
    mixed.temperature[0] = 0.0
    assert sample(logits, mixed)[0].item() == 1


def test_filters_never_move_a_greedy_rows_argmax():
    """A greedy row beside sampled rows draws from the filtered logits (the draw is one op for the whole batch): its
    tied maxima survive the tightest top-k / top-p / min-p, so it still takes the lowest of them."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    logits[0, [9, 5, 30]] = 7.0
    t = tensors(3, temperature=0.9, top_k=1, top_p=0.1, min_p=1.0)
    t.temperature[0] = 0.0
    t.host_flags = {"greedy": False, "min_p": True, "top_k": True, "top_p": True}
    assert sample(logits, t)[0].item() == 5
    assert sample(logits, t)[1:].tolist() == logits[1:].argmax(dim=-1).tolist()     # top-k 1: the mode


def test_penalties_match_a_plain_loop():
    torch.manual_seed(1)
    logits = torch.randn(2, 10)
    prompt = torch.zeros(2, 10, dtype=torch.bool)
    prompt[0, [1, 2]] = True
    counts = torch.zeros(2, 10, dtype=torch.long)
    counts[0, 2], counts[0, 5], counts[1, 7] = 2, 1, 3
    t = tensors(2, prompt_mask=prompt, output_counts=counts, repetition_penalty=torch.tensor([1.3, 0.8]),
                presence_penalty=torch.tensor([0.5, -0.2]), frequency_penalty=torch.tensor([0.25, 0.1]))
    got = apply_penalties(logits, t)
    want = logits.clone()
    for b in range(2):
        for v in range(10):
            x = want[b, v].item()
            if prompt[b, v] or counts[b, v] > 0:
                rep = t.repetition_penalty[b].item()
                x = x / rep if x > 0 else x * rep
            x -= t.frequency_penalty[b].item() * counts[b, v].item()
            x -= t.presence_penalty[b].item() * float(counts[b, v] > 0)
            want[b, v] = x
    assert torch.allclose(got, want, atol=1e-6)


def test_filters_keep_exactly_what_the_definitions_say():
    logits = torch.log(torch.tensor([[0.4, 0.25, 0.2, 0.1, 0.05]]))
    kept = lambda **kw: (apply_filters(logits, tensors(1, **kw)) > float("-inf"))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, True, False, False, False]
    assert kept(top_p=0.6) == [True, True, False, False, False]      # 0.4 < 0.6, 0.4 + 0.25 >= 0.6
    assert kept(top_p=0.64) == [True, True, False, False, False]
    assert kept(top_p=0.66) == [True, True, True, False, False]
    assert kept(min_p=0.45) == [True, True, True, False, False]      # p >= 0.45 * 0.4
    assert kept(top_p=0.01) == [True, False, False, False, False]    # the best id always stays


def test_banned_ids_are_never_drawn():
    n = 500
    banned = torch.zeros(n, 4, dtype=torch.bool)
    banned[:, 0] = True
    t = tensors(n, seeds=torch.full((n,), 5), positions=torch.arange(n), banned=banned)
    assert (sample(torch.tensor([[5.0, 0.0, 0.0, 0.0]]).expand(n, -1), t) != 0).all()


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    chosen, rank, ids, values = logprobs(logits, torch.tensor([1]), k=2)
    ref = torch.log_softmax(logits, -1)
    assert math.isclose(chosen.item(), ref[0, 1].item(), rel_tol=1e-6)
    assert rank.tolist() == [2]
    tied = logprobs(torch.tensor([[3.0, 1.0, 3.0]]), torch.tensor([2]))
    assert tied[1].tolist() == [1] and tied[2] is None       # a tie with the best token is rank 1
    assert ids.tolist() == [[2, 1]] and torch.allclose(values, ref[:, [2, 1]])
    assert SALT_TARGET != SALT_DRAFT


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_noise_and_draws_are_the_same_on_the_gpu():
    seeds, pos = torch.tensor([3, 2**40 + 5, -7]), torch.tensor([0, 123456, 2**31])
    assert torch.equal(counter_uniform(seeds, pos, 1000), counter_uniform(seeds.cuda(), pos.cuda(), 1000).cpu())
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    t = tensors(3, temperature=0.8, top_p=0.95, seeds=seeds, positions=pos)
    t_gpu = SamplingTensors(**{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in vars(t).items()})
    assert torch.equal(sample(logits, t), sample(logits.cuda(), t_gpu).cpu())


def test_tensors_built_from_sampling_params():
    from deepinfer.sampling import SamplingParams, build_sampling_tensors
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, seed=3, min_tokens=2,
                                                              stop_token_ids=[4]),
              SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5)]
    t = build_sampling_tensors(params, seeds=[10, 3, 12], positions=[4, 9, 6], vocab=8, device="cpu",
                               prompt_ids=[[1], [2], [3, 3]], output_ids=[[], [6], [5, 5]], eos_token_id=1)
    assert t.temperature.tolist() == pytest.approx([0.0, 0.7, 1.0]) and t.top_k.tolist() == [-1, 5, -1]
    assert t.seeds.tolist() == [10, 3, 12] and t.positions.tolist() == [4, 9, 6]
    assert t.prompt_mask[2].nonzero().flatten().tolist() == [3] and t.output_counts[2, 5].item() == 2
    assert t.banned[1].nonzero().flatten().tolist() == [1, 4] and not t.banned[0].any()   # min_tokens: no EOS/stop yet
    assert sample(torch.zeros(3, 8), t)[0].item() == 0


def test_penalty_tensors_equal_a_per_row_build_with_ops_independent_of_the_batch():
    """prompt_mask / output_counts / banned equal the plain per-row construction (empty rows, repeated ids, ids past
    the vocabulary), and building them runs the same number of tensor ops at 4 rows as at 64: one copy and one
    scatter for all rows, not a tensor and a bincount per row (each a launch on a GPU)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from deepinfer.sampling import SamplingParams, build_sampling_tensors

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    vocab, gen = 50, torch.Generator().manual_seed(0)

    def build(b):
        params = [SamplingParams(repetition_penalty=1.1, frequency_penalty=0.3, min_tokens=5, stop_token_ids=[7, 60])
                  for _ in range(b)]
        rand = lambda n: torch.randint(0, vocab + 5, (n,), generator=gen).tolist()   # noqa: E731: some >= vocab
        prompts = [rand(int(torch.randint(0, 30, (1,), generator=gen))) for _ in range(b)]
        outs = [rand(int(torch.randint(0, 12, (1,), generator=gen))) for _ in range(b)]
        ops = Ops()
        with ops:
            t = build_sampling_tensors(params, list(range(b)), [0] * b, vocab, "cpu", prompts, outs, eos_token_id=2)
        return t, prompts, outs, ops.n

    t, prompts, outs, n_small = build(4)
    _, _, _, n_large = build(64)
    assert n_small == n_large
    edge = build_sampling_tensors([SamplingParams(frequency_penalty=0.5, min_tokens=3, ignore_eos=True),
                                   SamplingParams(repetition_penalty=1.2, min_tokens=3, stop_token_ids=[4])],
                                  [0, 1], [0, 0], vocab, "cpu", None, [[-1, 3], [3, 3]], eos_token_id=None)
    assert edge.output_counts[0].nonzero().flatten().tolist() == [3]     # a negative id counts nowhere
    assert edge.output_counts[1, 3].item() == 2 and not edge.prompt_mask.any()      # no prompt ids given
    assert edge.banned[0].nonzero().numel() == 0 and edge.banned[1].nonzero().flatten().tolist() == [4]
    with pytest.raises(ValueError, match="output_ids has 1 rows for 2"):
        build_sampling_tensors([SamplingParams(), SamplingParams()], [0, 1], [0, 0], vocab, "cpu", None, [[1]])
    for i, (p, o) in enumerate(zip(prompts, outs)):
        want = torch.bincount(torch.tensor(o, dtype=torch.long), minlength=vocab + 5)[:vocab]
        assert torch.equal(t.output_counts[i].long(), want)
        assert t.prompt_mask[i].nonzero().flatten().tolist() == sorted({j for j in p if j < vocab})
        banned = [7, 2] if len(o) < 5 else []
        assert t.banned[i].nonzero().flatten().tolist() == sorted(banned)


def test_top_p_one_is_off_next_to_other_rows():
    """A top_p = 1 row keeps the whole vocabulary even when another row of the batch filters (float rounding
    of the cumulative mass must not drop its tail)."""
    logits = torch.randn(2, 129280, generator=torch.Generator().manual_seed(0)) * 3
    t = tensors(2, top_p=1.0)
    t.top_p[1] = 0.5
    kept = apply_filters(logits, t) > float("-inf")
    assert kept[0].all() and kept[1].sum() < 129280


def test_tiny_temperature_is_finite_and_picks_the_mode():
    t = tensors(1, temperature=1e-38)
    assert sample(torch.tensor([[4.0, 10.0, -1.0]]), t).item() == 1


def test_tokens_in_flight_count_as_if_appended_on_the_host():
    """build_sampling_tensors(in_flight=(rows, tokens)): each listed row's device token counts into its output
    counts exactly as the same token appended to its host list (an id outside the vocabulary counts nowhere)."""
    from deepinfer.sampling import SamplingParams, build_sampling_tensors

    vocab = 16
    params = [SamplingParams(frequency_penalty=0.5), SamplingParams(repetition_penalty=1.2),
              SamplingParams(presence_penalty=1.0), SamplingParams()]
    outs = [[1, 2], [], [5, 5], [9]]
    toks = torch.tensor([2, 7, 99])                                # rows 0, 1, 2; 99 is outside the vocabulary
    got = build_sampling_tensors(params, [0] * 4, [0] * 4, vocab, "cpu", [[3]] * 4, outs,
                                 in_flight=([0, 1, 2], toks))
    appended = [o + [int(t)] for o, t in zip(outs, toks)] + outs[3:]
    want = build_sampling_tensors(params, [0] * 4, [0] * 4, vocab, "cpu", [[3]] * 4, appended)
    assert torch.equal(got.output_counts, want.output_counts)
    assert got.output_counts[0, 2].item() == 2 and got.output_counts[1, 7].item() == 1
