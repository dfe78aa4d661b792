"""The order-fixed tl.dot these runs install in Triton's interpreter (tests/interpreter_dot.py): no BLAS in it, an
output element's bits the same wherever its row and column sit in the tile, the documented pairwise order, the
accumulator added after the products (as the interpreter's np.matmul(a, b) + acc), fp16 / fp8 / bf16 operands
widened exactly (their dot = the fp32 dot of their values, bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests import interpreter_dot

triton = pytest.importorskip("triton")              # collected (and skipped) outside the interpreter run too
tl = pytest.importorskip("triton.language")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, ACC: tl.constexpr,
                BF16: tl.constexpr):
    rm, rk, rn = tl.arange(0, M), tl.arange(0, K), tl.arange(0, N)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :])
    if BF16:
        a, b = a.to(tl.bfloat16), b.to(tl.bfloat16)
    if ACC:
        c = tl.dot(a, b, tl.load(c_ptr + rm[:, None] * N + rn[None, :]))
    else:
        c = tl.dot(a, b)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], c)


def kernel_dot(a, b, acc=None, bf16=False):
    m, k = a.shape
    n = b.shape[1]
    c = torch.zeros(m, n) if acc is None else acc.clone()
    _dot_kernel[(1,)](a.contiguous(), b.contiguous(), c, m, k, n, acc is not None, bf16)
    return c


def tree_dot(a, b):
    """The documented order, written again in torch: products in fp32, then k + K/2 added to k while K > 1."""
    p = a.float()[:, :, None] * b.float()[None, :, :]
    while p.shape[1] > 1:
        half = p.shape[1] // 2
        s = p[:, :half] + p[:, half:2 * half]
        p = torch.cat([s, p[:, 2 * half:]], dim=1) if p.shape[1] % 2 else s
    return p[:, 0]


def test_installed_and_no_blas(monkeypatch):
    assert interpreter_dot.installed()

    def no_blas(*args, **kwargs):
        raise AssertionError("np.matmul called")

    monkeypatch.setattr(np, "matmul", no_blas)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=g), torch.randn(32, 16, generator=g)
    assert torch.equal(kernel_dot(a, b), tree_dot(a, b))


@pytest.mark.parametrize("m,k,n", [(16, 16, 16), (32, 64, 32), (16, 128, 64)])
def test_the_documented_order_and_fp32_error(m, k, n):
    g = torch.Generator().manual_seed(m + k + n)
    a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    got = kernel_dot(a, b)
    assert torch.equal(got, tree_dot(a, b))
    want = a.double() @ b.double()
    assert float((got - want).abs().max() / (a.double().abs() @ b.double().abs()).max()) < 1e-6


def test_an_element_keeps_its_bits_anywhere_in_the_tile():
    """A row of a at row 0 of a 16-row tile and at row 29 of a 32-row one, a column of b in a 16- and a 64-wide
    tile: the same bits (np.matmul's BLAS need not give them: its kernels treat tile edges differently)."""
    g = torch.Generator().manual_seed(3)
    row, col = torch.randn(64, generator=g), torch.randn(64, generator=g)
    a1, a2 = torch.randn(16, 64, generator=g), torch.randn(32, 64, generator=g)
    b1, b2 = torch.randn(64, 16, generator=g), torch.randn(64, 64, generator=g)
    a1[0], a2[29], b1[:, 5], b2[:, 50] = row, row, col, col
    assert kernel_dot(a1, b1)[0, 5] == kernel_dot(a2, b2)[29, 50]
    assert torch.equal(kernel_dot(a1, b2)[0], kernel_dot(a2, b2)[29])


def test_the_accumulator_is_added_after_the_products():
    """dot(a, b, acc) = dot(a, b) + acc bit for bit: a walking program's running sum (acc = dot(x, w, acc)) and a
    split's parts added afterwards give the same bits (routing's and mhc's split = whole claims)."""
    g = torch.Generator().manual_seed(4)
    a, b, acc = torch.randn(16, 32, generator=g), torch.randn(32, 16, generator=g), torch.randn(16, 16, generator=g)
    assert torch.equal(kernel_dot(a, b, acc), kernel_dot(a, b) + acc)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e4m3fn, "bf16"])
def test_narrow_operands_widen_exactly(dtype):
    """fp16 / e4m3 products are exact in fp32 and bf16's too, so their dot is the fp32 dot of their values."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(16, 32, generator=g), torch.randn(32, 16, generator=g)
    if dtype == "bf16":            # made in the kernel (the interpreter reads no bf16 tensor), whose cast truncates
        got = kernel_dot(a, b, bf16=True)
        a, b = ((t.view(torch.int32) & -65536).view(torch.float32) for t in (a, b))
    else:
        a, b = a.to(dtype), b.to(dtype)
        got = kernel_dot(a, b)
    assert torch.equal(got, tree_dot(a.float(), b.float()))
