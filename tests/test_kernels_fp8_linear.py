"""kernels/fp8_linear.py: the FP8 block-scaled GEMM (DeepSeek's W8A8 recipe) and its activation quantizer.

* act quant: the reference equals quant.fake_quant_fp8 (round_scale=True) bit for bit, ragged K included, and an
  independent float64 quantizer; the Triton kernel equals the reference bit for bit (interpreter; GPU test).
* fp8_linear: the reference against the formula computed independently in float64, the kernels against the
  reference, error measured elementwise as |y - y_want| / (|x_deq| @ |W_deq|^T) (the scale of an fp32 dot's
  rounding), out_dtype float32:
    reference (one fp32 matmul)            measured <= 6.6e-8 (e8m0 weight scales), <= 5.3e-7 (float32 ones),
                                           K <= 4096;                       bound REF_BOUND = 1e-6
    Triton kernels (interpreter) vs ref    measured <= 5.5e-7;              bound KERNEL_BOUND = 1e-6
    Triton kernels on an H200 vs ref       not measured here;               bound GPU_BOUND = 2e-3 (fp8 MMA
                                           accumulation inside a 128-block keeps fewer bits than fp32)
* the invariant backends: a row's bits do not depend on the batch.

The Triton checks run in one subprocess with TRITON_INTERPRET=1 (triton.jit reads it when a kernel is decorated,
so it must be set before the module is imported; this process keeps compiled-mode triton for other test files).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.kernels import fp8_linear as fl
from deepinfer.kernels import fp8_linear_triton as flt
from deepinfer.kernels import registry
from deepinfer.kernels.quant import dequantize_fp8_blocks, fake_quant_fp8, quantize_fp8_blocks
from deepinfer.kernels.table import KernelTable, use

ROOT = Path(__file__).resolve().parents[1]
REF_BOUND = 1e-6
KERNEL_BOUND = 1e-6
GPU_BOUND = 2e-3
SCALE_FMTS = ("e8m0", "uint8", "fp32")
SHAPES = [(m, n, k) for m in (1, 5, 16, 70) for n in (128, 200) for k in (128, 384, 300)] + [(3, 200, 600)]


def acts(m, k, seed=0, dtype=torch.float32):
    """Rows of varying magnitude (1e-6 .. 1e3), outliers, an all-zero 128-block and a block of tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-6, 3, m).view(m, 1)
    x[:, ::37] *= 50.0
    if k >= 256:
        x[0, 128:256] = 0.0
        x[-1, :128] *= 1e-30
    return (x * 1e-2 if dtype == torch.float16 else x).to(dtype)          # float16: stay below its 65504


def weights(n, k, fmt, seed=1, block=128):
    """float8 W [n, k] and its block x block scales in `fmt`: e8m0 (float8_e8m0fnu), uint8 (e8m0 bytes) or fp32."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n).view(n, 1) * 0.05
    q, s = quantize_fp8_blocks(w, (block, block), scale_fmt="float32" if fmt == "fp32" else "ue8m0")
    return q, (s.view(torch.uint8) if fmt == "uint8" else s)


def formula64(x, w8, ws, block=128):
    """The recipe in float64, independently of the module: sum_b (x8 . w8)_b * sx_b * sw_b; and the error norm
    |x_deq| @ |W_deq|^T. Returns (y64 [M, N], norm [M, N], x8 [M, K] float64, sx [M, nb] float64)."""
    M, K = x.shape
    N, nb = w8.shape[0], -(-K // block)
    xb = torch.nn.functional.pad(x.double(), (0, nb * block - K)).view(M, nb, block)
    amax = xb.abs().amax(-1).float()                                       # exact in fp32 (x is fp32 or narrower)
    sx = torch.tensor([[2.0 ** math.ceil(math.log2(max(a, 1e-4) / 448.0)) for a in row] for row in amax.tolist()],
                      dtype=torch.float64)
    x8 = (xb / sx[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).double().view(M, nb * block)[:, :K]
    if ws.dtype in (torch.uint8, torch.float8_e8m0fnu):
        sw = torch.exp2(ws.view(torch.uint8).double() - 127)
    else:
        sw = ws.double()
    y = torch.zeros(M, N, dtype=torch.float64)
    norm = torch.zeros(M, N, dtype=torch.float64)
    for b in range(nb):
        ks = slice(b * block, min(K, b * block + block))
        swb = sw[:, b].repeat_interleave(block)[:N]                         # [N]
        y += (x8[:, ks] @ w8[:, ks].double().T) * sx[:, b:b + 1] * swb
        norm += (x8[:, ks].abs() @ w8[:, ks].double().abs().T) * sx[:, b:b + 1] * swb
    return y, norm, x8, sx


def rel_err(got, want, norm) -> float:
    return float(((got.double() - want.double()).abs() / norm.clamp_min(1e-300)).max())


# --------------------------------------------------------------------------------------------- act quant

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_act_quant_reference_is_fake_quant_bitwise(dtype):
    x = acts(9, 512, dtype=dtype)
    q, s = fl._act_quant_ref(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (9, 4)
    deq = (q.float() * s.repeat_interleave(128, dim=-1)).to(dtype)
    assert torch.equal(deq, fake_quant_fp8(x, 128, round_scale=True))
    assert torch.equal(s, torch.exp2(torch.log2(s)))                      # powers of two
    q3, s3 = fl._act_quant_ref(x.view(3, 3, 512))                          # leading dims kept
    assert torch.equal(q3.view(9, 512).view(torch.uint8), q.view(torch.uint8)) and s3.shape == (3, 3, 4)


def test_act_quant_ragged_k_uses_the_real_values_only():
    x = acts(6, 300)
    q, s = fl._act_quant_ref(x)
    pad = torch.nn.functional.pad(x, (0, 84))
    qp, sp = fl._act_quant_ref(pad)
    assert torch.equal(q.view(torch.uint8), qp[:, :300].view(torch.uint8)) and torch.equal(s, sp)
    assert torch.equal(q.float() * s.repeat_interleave(128, -1)[:, :300], fake_quant_fp8(pad, 128)[:, :300])


def test_act_quant_reference_matches_an_independent_quantizer():
    x = acts(12, 300)
    q, s = fl._act_quant_ref(x)
    _, _, x8, sx = formula64(x, *weights(128, 300, "e8m0"))
    assert torch.equal(s.double(), sx) and torch.equal(q.double(), x8)


# -------------------------------------------------------------------------------------- GEMM, torch

@pytest.mark.parametrize("fmt", SCALE_FMTS)
@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (7, 200, 300), (33, 256, 384), (5, 130, 1000), (64, 512, 4096)])
def test_reference_matches_float64_formula(m, n, k, fmt):
    x, (w8, ws) = acts(m, k), weights(n, k, fmt)
    want, norm, _, _ = formula64(x, w8, ws)
    got = fl._fp8_linear_ref(x, w8, ws)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert rel_err(got, want, norm) <= REF_BOUND
    with use("reference"):
        bf = fl.fp8_linear(x.bfloat16(), w8, ws)
    assert bf.dtype == torch.bfloat16
    assert torch.equal(bf, fl._fp8_linear_ref(x.bfloat16(), w8, ws, torch.float32).bfloat16())


@pytest.mark.parametrize("fmt", SCALE_FMTS)
@pytest.mark.parametrize("m,n,k", [(1, 32, 32), (7, 200, 300), (33, 96, 160), (5, 130, 1000)])
def test_reference_block32_matches_float64_formula(m, n, k, fmt):
    """V4.1's recipe: 32x32 weight blocks, activations per 1x32."""
    x, (w8, ws) = acts(m, k), weights(n, k, fmt, block=32)
    want, norm, _, _ = formula64(x, w8, ws, block=32)
    got = fl._fp8_linear_ref(x, w8, ws, block=32)
    assert rel_err(got, want, norm) <= REF_BOUND
    with use("reference"):
        assert torch.equal(fl.fp8_linear(x, w8, ws, block=32), got)
    if max(n, k) > 32:
        with pytest.raises(ValueError, match="weight scale"):
            fl.fp8_linear(x, w8, ws)                                        # 32-block scales read as 128 blocks
    with pytest.raises(ValueError, match="block 64 is not one of"):
        fl.fp8_linear(x, *weights(n, k, fmt, block=64), block=64)


def test_reference_equals_dequantized_linear():
    """The op is F.linear of the fake-quantized activations and the dequantized weights, in fp32."""
    x, (w8, ws) = acts(10, 256), weights(192, 256, "e8m0")
    want = torch.nn.functional.linear(fake_quant_fp8(x, 128), dequantize_fp8_blocks(w8, ws, dtype=torch.float32))
    assert torch.equal(fl._fp8_linear_ref(x, w8, ws), want)


@pytest.mark.parametrize("backend", registry.BACKEND_SETS)
def test_every_backend_on_cpu(backend, one_thread):
    """On CPU tensors (no interpreter here) triton runs the reference, triton_invariant the invariant backend."""
    x, (w8, ws) = acts(29, 300).view(29, 300), weights(200, 300, "e8m0")
    with use("reference"):
        want = fl.fp8_linear(x, w8, ws)
        want_q = fl.quantize_act_fp8(x)
    with use(backend):
        got = fl.fp8_linear(x.view(29, 1, 300), w8, ws, torch.float32)
        got_q = fl.quantize_act_fp8(x)
    assert got.shape == (29, 1, 200)
    assert torch.allclose(got.view(29, 200), want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    assert torch.equal(got_q[0].view(torch.uint8), want_q[0].view(torch.uint8)) and torch.equal(got_q[1], want_q[1])


@pytest.mark.parametrize("backend", ["invariant", "triton_invariant"])
def test_invariant_backend_is_batch_invariant(backend, one_thread):
    x, (w8, ws) = acts(45, 384), weights(256, 384, "e8m0")
    with use(backend):
        full = fl.fp8_linear(x, w8, ws)
        alone = fl.fp8_linear(x[21:22], w8, ws)
        middle = fl.fp8_linear(x[5:30], w8, ws)
    assert torch.equal(full[21:22], alone) and torch.equal(full[5:30], middle)


def test_tables_and_bad_shapes():
    names = KernelTable("triton_invariant").backends
    impls = registry.implemented("fp8_linear")
    assert names["fp8_linear"] == ("triton_invariant" if "triton" in impls else "invariant")
    assert KernelTable("invariant").backends["fp8_linear"] == "invariant"
    x, (w8, ws) = acts(2, 256), weights(128, 256, "e8m0")
    with pytest.raises(ValueError, match="weight scale"):
        fl.fp8_linear(x, w8, ws[:, :1])
    with pytest.raises(ValueError, match="channels"):
        fl.fp8_linear(x[:, :128], w8, ws)


def test_module_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "from deepinfer.kernels import fp8_linear_triton as flt, registry\n"
            "from deepinfer.kernels.table import KernelTable\n"
            "assert flt.triton is None and set(registry.implemented('fp8_linear')) == {'reference', 'invariant'}\n"
            "t = KernelTable('triton'); assert t.backends['fp8_linear'] == 'reference'\n"
            "assert KernelTable('triton_invariant').backends['fp8_linear'] == 'invariant'\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]


# ------------------------------------------------------------------------------- Triton, interpreter

def _case_name(m, n, k, i):
    return f"M{m}-N{n}-K{k}-{SCALE_FMTS[i % 3]}"


INTERP_CASES = [_case_name(m, n, k, i) for i, (m, n, k) in enumerate(SHAPES)]
BLOCK32_SHAPES = [(1, 64, 96), (5, 200, 300), (70, 96, 160)]


def _interpreter_main():
    """Runs under TRITON_INTERPRET=1 (a subprocess of the tests below); prints one JSON object of results."""
    assert flt._INTERPRET and flt.triton is not None
    from tests.interpreter_dot import install
    install()                          # tl.dot in an order the code fixes, not the host BLAS's (docs/testing.md)
    torch.set_num_threads(1)
    out = {}
    # act quant: bitwise, ragged K, fp32 / fp16 inputs, row count not a multiple of the kernel's rows
    for dtype in (torch.float32, torch.float16):
        for m, k in ((70, 384), (5, 300), (1, 128)):
            x = acts(m, k, dtype=dtype)
            (q0, s0), (q1, s1) = fl._act_quant_ref(x), flt._act_quant_triton(x)
            out[f"aq-{m}-{k}-{dtype}"] = bool(torch.equal(q0.view(torch.uint8), q1.view(torch.uint8))
                                              and torch.equal(s0, s1))
    # the kernel's e4m3 rounding: every e4m3 magnitude, the midpoints between neighbours and one ulp either side
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (grid[1:] + grid[:-1]) / 2
    vals = torch.cat([grid, mid, mid.nextafter(torch.tensor(0.0)), mid.nextafter(torch.tensor(1e9))])
    vals = torch.cat([vals, -vals, torch.tensor([448.0, -448.0, 1e-30, -1e-30, -0.0])])
    blocks = math.ceil(vals.numel() / 127)
    x = torch.cat([torch.full((blocks, 1), 448.0),                          # scale 1: the values convert as they are
                   torch.nn.functional.pad(vals, (0, blocks * 127 - vals.numel())).view(blocks, 127)], dim=1)
    (q0, s0), (q1, s1) = fl._act_quant_ref(x.view(1, -1)), flt._act_quant_triton(x.view(1, -1))
    out["aq-e4m3-rounding"] = bool(torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and bool((s0 == 1).all()))
    # GEMM: the op through the table (the path from M), the other path forced, the invariant variant
    for i, (m, n, k) in enumerate(SHAPES):
        x, (w8, ws) = acts(m, k, seed=i), weights(n, k, SCALE_FMTS[i % 3], seed=100 + i)
        ref = fl._fp8_linear_ref(x, w8, ws)
        _, norm, _, _ = formula64(x, w8, ws)
        errs = {}
        with use("triton"):
            errs["auto"] = rel_err(fl.fp8_linear(x, w8, ws), ref, norm)
        if n == 200:                                                        # (interpreter time: ragged N only)
            other = "prefill" if m <= flt.DECODE_MAX_M else "decode"
            errs[other] = rel_err(flt._fp8_linear_triton_any(x, w8, ws, None, False, other), ref, norm)
            with use("triton_invariant"):
                errs["invariant"] = rel_err(fl.fp8_linear(x, w8, ws), ref, norm)
        out[_case_name(m, n, k, i)] = errs
    # 32-blocks (V4.1): every path against the reference of the same recipe
    for i, (m, n, k) in enumerate(BLOCK32_SHAPES):
        x, (w8, ws) = acts(m, k, seed=50 + i), weights(n, k, SCALE_FMTS[i % 3], seed=150 + i, block=32)
        ref = fl._fp8_linear_ref(x, w8, ws, block=32)
        _, norm, _, _ = formula64(x, w8, ws, block=32)
        errs = {path: rel_err(flt._fp8_linear_triton_any(x, w8, ws, None, path == "invariant", path, block=32), ref,
                              norm) for path in ("decode", "prefill", "invariant")}
        with use("triton"):
            errs["auto"] = rel_err(fl.fp8_linear(x, w8, ws, block=32), ref, norm)
        out[f"b32-{m}-{n}-{k}"] = errs
    # split-K: the decode path splits these (the interpreter counts 16 SMs), the last split running past K
    out["splits"] = {f"{m}-{n}-{k}": flt._split_k(m, n, -(-k // 128), flt.DECODE_CONFIG, torch.device("cpu"))
                     for m, n, k in ((1, 128, 384), (3, 200, 600))}
    # fp16 activations and output, 3-D x
    x, (w8, ws) = acts(6, 300, seed=7, dtype=torch.float16).view(2, 3, 300), weights(200, 300, "e8m0")
    with use("triton"):
        y = fl.fp8_linear(x, w8, ws)
    ref = fl._fp8_linear_ref(x, w8, ws, torch.float32).view(6, 200)
    _, norm, _, _ = formula64(x.view(6, 300).float(), w8, ws)
    excess = (y.view(6, 200).float() - ref).abs() - (2 ** -11 * ref.abs() + 2 ** -25)    # fp16 rounding of y
    out["fp16"] = [list(y.shape), str(y.dtype), float((excess.double() / norm).max())]
    # the invariant variant: a row's bits whatever M and wherever the row sits (prefixes, rows alone, a middle
    # slice, a shuffle): the order-fixed tl.dot sums a row alike at any place in the tile, as the MMA does
    x, (w8, ws) = acts(70, 300, seed=3), weights(200, 300, "fp32")
    perm = torch.randperm(70, generator=torch.Generator().manual_seed(0))
    with use("triton_invariant"):
        full = fl.fp8_linear(x, w8, ws)
        out["invariant-bits"] = all(bool(torch.equal(fl.fp8_linear(x[rows], w8, ws), full[rows]))
                                    for rows in (slice(0, 1), slice(0, 38), slice(0, 64), slice(37, 38),
                                                 slice(69, 70), slice(5, 60), perm))
    print("RESULTS " + json.dumps(out))


@pytest.fixture(scope="module")
def interp():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = "from tests.test_kernels_fp8_linear import _interpreter_main as m; m()"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    line = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert run.returncode == 0 and line, (run.stdout[-2000:], run.stderr[-4000:])
    return json.loads(line[-1][len("RESULTS "):])


def test_interpreter_act_quant_is_bitwise(interp):
    checks = {k: v for k, v in interp.items() if k.startswith("aq-")}
    assert len(checks) == 7 and all(checks.values()), checks


@pytest.mark.parametrize("case", INTERP_CASES)
def test_interpreter_gemm_matches_reference(interp, case):
    errs = interp[case]
    m, n = (int(part[1:]) for part in case.split("-")[:2])
    other = "prefill" if m <= flt.DECODE_MAX_M else "decode"
    assert set(errs) == ({"auto", "invariant", other} if n == 200 else {"auto"})
    assert max(errs.values()) <= KERNEL_BOUND, errs


@pytest.mark.parametrize("m,n,k", BLOCK32_SHAPES)
def test_interpreter_block32_matches_reference(interp, m, n, k):
    errs = interp[f"b32-{m}-{n}-{k}"]
    assert set(errs) == {"decode", "prefill", "invariant", "auto"} and max(errs.values()) <= KERNEL_BOUND, errs


def test_interpreter_split_k_fp16_and_invariance(interp):
    assert interp["splits"] == {"1-128-384": 1, "3-200-600": 2}            # 3 splits of 1; 3 splits of 2, 2, 1
    shape, dtype, err = interp["fp16"]
    assert shape == [2, 3, 200] and dtype == "torch.float16" and err <= KERNEL_BOUND
    assert interp["invariant-bits"]


# ------------------------------------------------------------------------------------------------ GPU

V4_FLASH_SHAPES = [(1024, 4096), (4096, 8192), (2048, 4096), (4096, 2048), (200, 300)]   # (N, K): wq_a, wo_b,
# shared expert w1/w3 and w2, a ragged one


def _gpu_cases(n, k, block, rows):
    """Weights [n, k] with block x block scales and bf16 activations on the GPU; per row count m (TF32 off):
    the Triton act quant checked bitwise against the reference, then (m, x, reference fp32 output, error norm)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w8, ws = quantize_fp8_blocks(torch.randn(n, k, device=dev, generator=g) * 0.02, (block, block))
    big = torch.randn(max(rows), k, device=dev, generator=g).bfloat16()
    w_abs = dequantize_fp8_blocks(w8, ws, (block, block), torch.float32).abs().T
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        def cases():
            for m in rows:
                x = big[:m]
                q0, s0 = fl._act_quant_ref(x, block)
                q1, s1 = flt._act_quant_triton(x, block)
                assert torch.equal(q0.view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s0, s1), m
                norm = (q0.float() * s0.repeat_interleave(block, -1)[:, :k]).abs() @ w_abs
                yield m, x, fl._fp8_linear_ref(x, w8, ws, torch.float32, block), norm
        return w8, ws, big, list(cases())
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n,k", V4_FLASH_SHAPES)
def test_gpu_kernels_at_model_shapes(n, k):
    pytest.importorskip("triton")
    assert flt.triton is not None and not flt._INTERPRET
    w8, ws, big, cases = _gpu_cases(n, k, 128, (1, 16, 64, 256, 8192))
    ws32 = ws.view(torch.uint8).to(torch.int32).sub(127).float().exp2()
    for m, x, ref, norm in cases:
        for scales in (ws, ws32):
            for backend in ("triton", "triton_invariant"):
                with use(backend):
                    y = fl.fp8_linear(x, w8, scales, torch.float32)
                    yb = fl.fp8_linear(x, w8, scales)
                assert rel_err(y, ref, norm) <= GPU_BOUND, (m, backend)
                assert yb.dtype == torch.bfloat16 and rel_err(yb, ref, norm) <= GPU_BOUND + 2 ** -8, (m, backend)
    with use("triton_invariant"):
        full = fl.fp8_linear(big, w8, ws)
        for m in (1, 16, 64, 256):
            assert torch.equal(fl.fp8_linear(big[:m], w8, ws), full[:m]), m
        assert torch.equal(fl.fp8_linear(big[100:101], w8, ws), full[100:101])


V41_FLASH_SHAPES = [(1280, 5120), (512, 5120), (5120, 8192), (2304, 5120), (5120, 2304), (200, 300)]  # (N, K): wq_a,
# wkv, wo_b, shared expert w1/w3 and w2, a ragged one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n,k", V41_FLASH_SHAPES)
def test_gpu_block32_kernels_at_model_shapes(n, k):
    """V4.1's 32x32 blocks through the Triton GEMM (passed on the H200, so the op runs them there), every path,
    against the reference of the same recipe; the invariant path's row bits."""
    pytest.importorskip("triton")
    assert flt.triton is not None and not flt._INTERPRET
    w8, ws, big, cases = _gpu_cases(n, k, 32, (1, 16, 64, 256, 4096))
    for m, x, ref, norm in cases:
        for path in (None, "decode", "prefill", "invariant"):
            y = flt._fp8_linear_triton_any(x, w8, ws, torch.float32, path == "invariant", path, block=32)
            assert rel_err(y, ref, norm) <= GPU_BOUND, (m, path)
    full = flt._fp8_linear_triton_any(big, w8, ws, None, True, block=32)
    for m in (1, 16, 64, 256):
        assert torch.equal(flt._fp8_linear_triton_any(big[:m], w8, ws, None, True, block=32), full[:m]), m
