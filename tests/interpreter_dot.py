"""An order-fixed `tl.dot` for Triton's CPU interpreter (TRITON_INTERPRET=1), installed by the interpreter runs.

Triton 3.6's interpreter computes `tl.dot(a, b, acc)` as `np.matmul(a, b, dtype=acc.dtype) + acc`
(InterpreterBuilder.create_dot). numpy's matmul hands fp32 to the host BLAS (OpenBLAS in numpy's wheels), whose
summation order over K follows its CPU kernel (AVX2 / AVX-512 / ...), its thread count and the operand shapes: a row
can round differently by its place in the tile, a column by the tile's width. A bitwise claim checked with it (a
row alone = in a batch, split = whole) tests the BLAS, not the kernel: on a 2-core EPYC two such claims failed.

`install()` replaces create_dot with the same arithmetic in an order that this code fixes: products in the
accumulator's dtype, elementwise (IEEE, correctly rounded, whatever the SIMD width), summed over K by a pairwise tree
whose pairing depends on K only (k and k + K/2 added, an odd last row carried), then `+ acc` as the interpreter
does. An output element's bits then depend on its own row of a, its own column of b, K and acc, never on the tile's
other rows or columns, the CPU, numpy's SIMD dispatch or a BLAS, so the claims that the kernels' tile structure
fixes hold on any CPU. The interpreter's dtype handling is kept: fp8 operands (e4m3 / e5m2) to fp16 by its own
converter, then everything in acc's dtype (fp32 for fp16 / fp8 / fp32 inputs, int32 for int8); input_precision
(tf32 / tf32x3 / ieee) and max_num_imprecise_acc are ignored as the interpreter ignores them (products are ieee
fp32). One difference: bf16 operands (which the interpreter stores as uint16 bits and would multiply as integers)
are widened to their fp32 values, exactly.

Installed by tests/interpreted/conftest.py, by tests/test_kernels_routing.py's interpreter run (which goes
without conftest) and by tests/test_kernels_fp8_linear.py's interpreter subprocess. The GPU keeps the MMA:
tests/test_*_triton.py's `-m gpu` tests check the same bitwise claims there (docs/testing.md)."""

from __future__ import annotations

import numpy as np

_MARK = "_deepinfer_order_fixed"


def pairwise_sum(p: np.ndarray, axis: int = -2) -> np.ndarray:
    """Sum over `axis` in a fixed pairwise order: while n > 1, element k gets element k + n // 2 added (k < n // 2)
    and an odd last element is carried. Elementwise adds only: the same bits on any CPU."""
    p = np.moveaxis(p, axis, 0)
    while p.shape[0] > 1:
        half = p.shape[0] // 2
        s = p[:half] + p[half:2 * half]
        p = np.concatenate([s, p[2 * half:]]) if p.shape[0] % 2 else s
    return p[0]


def dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """a [.., M, K] @ b [.., K, N] + acc [.., M, N], products and sums in acc's dtype, the order fixed by K."""
    dtype = acc.dtype
    prod = a.astype(dtype, copy=False)[..., :, :, None] * b.astype(dtype, copy=False)[..., None, :, :]
    return pairwise_sum(prod, axis=-2) + acc


def installed() -> bool:
    from triton.runtime import interpreter
    return getattr(interpreter.InterpreterBuilder.create_dot, _MARK, False)


def install() -> None:
    """Replace the interpreter's create_dot (idempotent). Only under TRITON_INTERPRET=1 do kernels reach it."""
    import triton.language as tl
    from triton.runtime import interpreter

    if installed():
        return

    def operand(h):
        data = h.data
        if h.dtype.is_floating() and h.dtype.primitive_bitwidth == 8:          # as the interpreter: fp8 -> fp16
            return interpreter._convert_float(data, h.dtype, tl.float16, None).view(np.float16)
        if h.dtype == tl.bfloat16 and data.dtype == np.uint16:                 # bf16 bits -> their fp32 values
            return (data.astype(np.uint32) << 16).view(np.float32)
        return data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return interpreter.TensorHandle(dot(operand(a), operand(b), d.data), d.dtype.scalar)

    setattr(create_dot, _MARK, True)
    interpreter.InterpreterBuilder.create_dot = create_dot
