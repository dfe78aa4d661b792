"""kernels/sampling_triton.py's draw kernel in Triton's interpreter against the reference on fresh random logits: the
same ids for greedy rows (argmax, ties to the lowest id, across chunk and block boundaries) and for noisy rows
(argmax of logits + counter-based Gumbel noise), mixed rows, -inf ids, all -inf rows, vocabularies that are not a
multiple of the chunk, float64 logits; the in-kernel hash equals the torch one."""

from __future__ import annotations

import pytest
import torch

from deepinfer.kernels import sampling_triton as ks
from deepinfer.kernels.sampling import gumbel_noise


def _logits(b, v, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(b, v, generator=g) * 3).to(dtype)
    x[torch.rand(b, v, generator=g) < 0.1] = float("-inf")
    return x


@pytest.mark.parametrize("b,v", [(1, 129280), (5, 9000), (3, 1000), (2, 8192)])
def test_draw_equals_reference(b, v):
    x = _logits(b, v, b * 7 + v)
    seeds, pos = torch.arange(b) * 1000003 + 17, torch.arange(b) * 31 + 5
    noisy = torch.arange(b) % 2 == 0
    assert ks.supported(x, noisy, seeds, pos)
    for rows in (None, noisy, torch.ones(b, dtype=torch.bool)):
        for salt in (0, 2):
            got = ks.draw_kernel(x, rows, seeds, pos, salt)
            assert torch.equal(got, ks._reference(x, rows, seeds, pos, salt)), (rows, salt)


def test_ties_go_to_the_lowest_id_across_chunks():
    """Equal maxima in two chunks and inside one block: the lowest id, as torch.argmax."""
    v = 3 * ks.CHUNK + 100
    x = torch.zeros(4, v)
    x[0, [ks.CHUNK + 5, 2 * ks.CHUNK + 1]] = 2.0
    x[1, [70, 3]] = 1.0
    x[2] = float("-inf")                                       # every id banned: id 0, as torch
    x[3, v - 1] = 5.0
    want = x.argmax(dim=-1)
    assert torch.equal(ks.draw_kernel(x, None, torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), 0),
                       want)
    assert want.tolist() == [ks.CHUNK + 5, 3, 0, v - 1]


def test_noise_is_the_counter_hash():
    """Flat logits: each noisy row draws the argmax of its own Gumbel noise, so the kernel's in-register hash must
    be the torch one; a different seed, position or salt draws another id."""
    b, v = 6, 20000
    x = torch.zeros(b, v, dtype=torch.float64)
    seeds, pos = torch.tensor([1, 1, 2, 3, 4, 5]), torch.tensor([0, 1, 0, 9, 9, 9])
    rows = torch.ones(b, dtype=torch.bool)
    got = ks.draw_kernel(x, rows, seeds, pos, 1)
    want = gumbel_noise(seeds, pos, v, 1).argmax(dim=-1)
    assert torch.equal(got, want)
    assert len(set(got.tolist())) == b
    assert not torch.equal(ks.draw_kernel(x, rows, seeds, pos, 0), got)


def test_strided_row_inputs():
    """Seeds, positions and noise flags taken as strided views draw as their contiguous copies."""
    x = _logits(4, 3000, 5)
    table = torch.arange(12).view(4, 3) * 977 + 3
    seeds, pos, rows = table[:, 1], table[:, 2], torch.tensor([[True, False]] * 4)[:, 0]
    assert not seeds.is_contiguous()
    assert torch.equal(ks.draw_kernel(x, rows, seeds, pos, 0), ks._reference(x, rows, seeds, pos, 0))


def test_unsupported_takes_the_reference():
    x = _logits(2, 50, 0).to(torch.bfloat16)
    assert not ks.supported(x)
    seeds = pos = torch.zeros(2, dtype=torch.long)
    assert torch.equal(ks._triton(x, None, seeds, pos, 0), x.argmax(dim=-1))
