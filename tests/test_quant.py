"""Tests for deepinfer.kernels.quant (CPU; one CUDA parity test is skipped without a GPU)."""

import math

import pytest
import torch

from deepinfer.kernels import quant as Q

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _nearest_even_e2m1(v: float) -> float:
    """Independent brute-force e2m1 rounding: nearest grid magnitude, ties to the even
    mantissa (grid index even), magnitudes above 6 saturate."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda i: (abs(GRID[i] - a), i % 2))
    return math.copysign(GRID[best], v)


# ----------------------------------------------------------------------------- E8M0

def test_e8m0_edge_bytes():
    b = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    want = [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127]
    got = Q.e8m0_to_float(b)
    assert got.dtype == torch.float32
    assert got[:6].tolist() == want
    assert math.isnan(got[6].item())
    # 2^-127 is a float32 subnormal; it must be exact, not flushed to zero.
    assert got[0].item() == 2.0**-127 and got[0].item() > 0
    # The float8_e8m0fnu storage dtype gives the same values.
    got8 = Q.e8m0_to_float(b.view(torch.float8_e8m0fnu))
    assert torch.equal(got8[:6], got[:6]) and math.isnan(got8[6].item())


def test_e8m0_all_bytes_round_trip_and_match_torch():
    b = torch.arange(255, dtype=torch.uint8)
    f = Q.e8m0_to_float(b)
    assert torch.equal(f, torch.pow(2.0, b.double() - 127).float())
    assert torch.equal(Q.float_to_e8m0(f), b)
    assert torch.equal(f, b.view(torch.float8_e8m0fnu).float())
    assert Q.float_to_e8m0(torch.tensor([float("nan")])).item() == 255


def test_float_to_e8m0_rejects_non_powers_of_two():
    with pytest.raises(ValueError):
        Q.float_to_e8m0(torch.tensor([1.0, 3.0]))
    with pytest.raises(ValueError):
        Q.float_to_e8m0(torch.tensor([0.0]))


def test_pow2_ceil():
    x = torch.tensor([1.0, 1.5, 3.0, 0.75, 2.0**-126, 448.0, 0.3])
    assert Q.pow2_ceil(x).tolist() == [1.0, 2.0, 4.0, 1.0, 2.0**-126, 512.0, 0.5]


# ---------------------------------------------------------------------- FP8 blocks

def _fp8_representable(shape, seed):
    g = torch.Generator().manual_seed(seed)
    v = (torch.randn(shape, generator=g) * 100).clamp(-448, 448)
    return v.to(torch.float8_e4m3fn).float()


def test_fp8_blocks_exact_round_trip():
    # Per block: fp8-representable values with one entry at +-448, times a power of two.
    # The chosen scale must be that power of two and the round trip exact.
    block = (4, 8)
    vals = _fp8_representable((8, 16), 0)
    vals[0, 0], vals[4, 8], vals[0, 8], vals[4, 0] = 448.0, -448.0, 448.0, 448.0
    pow2 = torch.tensor([[2.0**-3, 1.0], [2.0**5, 2.0**-20]])
    w = vals * pow2.repeat_interleave(4, 0).repeat_interleave(8, 1)
    w_fp8, s = Q.quantize_fp8_blocks(w, block)
    assert w_fp8.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.shape == (2, 2)
    assert torch.equal(Q.e8m0_to_float(s), pow2)
    assert s.view(torch.uint8).tolist() == [[124, 127], [132, 107]]
    assert torch.equal(w_fp8.float(), vals)
    assert torch.equal(Q.dequantize_fp8_blocks(w_fp8, s, block, torch.float32), w)


def test_fp8_blocks_idempotent_and_error_bound():
    w = torch.randn(256, 384) * 0.02
    d1 = Q.dequantize_fp8_blocks(*Q.quantize_fp8_blocks(w), dtype=torch.float32)
    d2 = Q.dequantize_fp8_blocks(*Q.quantize_fp8_blocks(d1), dtype=torch.float32)
    assert torch.equal(d1, d2)
    # e4m3 has 3 mantissa bits: relative error <= 2^-4 for normal values.
    big = w.abs() > 1e-3
    assert ((d1 - w).abs()[big] <= w.abs()[big] * 2.0**-4).all()


def test_fp8_blocks_scale_is_smallest_pow2_above_amax_over_448():
    w = torch.zeros(2, 3)
    w[0, 0] = 449.0          # 449/448 -> scale 2
    w[1, 2] = 448.0          # exactly 448 -> scale 1, not bumped
    _, s = Q.quantize_fp8_blocks(w, (1, 2))
    f = Q.e8m0_to_float(s)
    assert f[0, 0].item() == 2.0 and f[1, 1].item() == 1.0
    # All-zero blocks: amax floored at 1e-4 -> 2^ceil(log2(1e-4/448)) = 2^-22.
    assert f[0, 1].item() == 2.0**-22 and f[1, 0].item() == 2.0**-22


def test_fp8_blocks_ragged():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(130, 200, generator=g)
    w[128:, 128:] *= 1000.0            # only the ragged corner block is large
    w_fp8, s = Q.quantize_fp8_blocks(w)
    assert w_fp8.shape == (130, 200) and s.shape == (2, 2)
    f = Q.e8m0_to_float(s)
    for (r, c) in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        amax = w[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128].abs().max()
        want = 2.0 ** math.ceil(math.log2(amax.item() / 448))
        assert f[r, c].item() == want
    d = Q.dequantize_fp8_blocks(w_fp8, s, dtype=torch.float32)
    assert d.shape == (130, 200)
    assert torch.equal(d, Q.dequantize_fp8_blocks(*Q.quantize_fp8_blocks(d), dtype=torch.float32))
    # Error: half a step, 2^-4 relative for normals, 2^-10 * scale in the subnormal range.
    step_floor = Q.dequantize_fp8_blocks(torch.ones_like(w_fp8), s, dtype=torch.float32) * 2.0**-10
    assert ((d - w).abs() <= torch.maximum(w.abs() * 2.0**-4, step_floor)).all()


def test_fp8_blocks_float32_scale():
    w = torch.zeros(3, 5)
    w[0, 0], w[2, 4] = 896.0, -3.5
    w_fp8, s = Q.quantize_fp8_blocks(w, (2, 4), scale_fmt="float32")
    assert s.dtype == torch.float32 and s.shape == (2, 2)
    assert s[0, 0].item() == 2.0                        # 896 / 448
    assert s[1, 1].item() == pytest.approx(3.5 / 448, rel=1e-7)
    d = Q.dequantize_fp8_blocks(w_fp8, s, (2, 4), torch.float32)
    assert d[0, 0].item() == 896.0 and d[2, 4].item() == pytest.approx(-3.5, rel=1e-6)
    with pytest.raises(ValueError):
        Q.dequantize_fp8_blocks(w_fp8, s[:1], (2, 4))


# ----------------------------------------------------------------------------- FP4

def test_e2m1_every_grid_value():
    vals = torch.tensor(GRID + [-g for g in GRID])
    codes = Q.e2m1_encode(vals)
    assert codes.tolist() == list(range(8)) + [8 + i for i in range(8)]
    dec = Q.e2m1_decode(torch.arange(16))
    assert dec.tolist() == GRID + [-g for g in GRID]
    assert torch.signbit(dec[8])                        # code 8 is -0.0


def test_e2m1_bit_layout():
    # sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0.
    for code in range(16):
        s, e, m = code >> 3, (code >> 1) & 3, code & 1
        mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
        assert Q.e2m1_decode(torch.tensor([code])).item() == (-mag if s else mag)


def test_e2m1_ties_to_even_and_saturation():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0, float("inf"),
                      -0.25, -0.75, -1.25, -5.0, -7.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0,
            -0.0, -1.0, -1.0, -4.0, -6.0]
    assert Q.e2m1_decode(Q.e2m1_encode(x)).tolist() == want
    # Just off the ties they go to the nearer value.
    eps = 1e-3
    off = torch.tensor([0.25 + eps, 0.75 - eps, 1.25 + eps, 2.5 + eps, 5.0 + eps])
    assert Q.e2m1_decode(Q.e2m1_encode(off)).tolist() == [0.5, 0.5, 1.5, 3.0, 6.0]


def test_e2m1_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    x = torch.cat([torch.randn(4000, generator=g) * 3,
                   torch.arange(-28, 29) * 0.25])       # every quarter step in [-7, 7]
    got = Q.e2m1_decode(Q.e2m1_encode(x))
    want = torch.tensor([_nearest_even_e2m1(v) for v in x.tolist()])
    assert torch.equal(got, want)


def test_nibble_order():
    codes = torch.tensor([[1, 2, 3, 4, 15, 8]], dtype=torch.uint8)
    packed = Q.pack_fp4(codes)
    assert packed.dtype == torch.int8
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x43, 0x8F]]
    assert torch.equal(Q.unpack_fp4(packed), codes)
    # The packed bytes can be stored as torch's MXFP4 dtype and read back.
    as_fp4 = packed.view(torch.float4_e2m1fn_x2)
    assert torch.equal(Q.unpack_fp4(as_fp4), codes)


def test_quantize_fp4_known_block():
    # Block 0: amax 6 -> scale 1. Block 1: amax 0.75 -> 0.75/6 = 0.125 -> scale 2^-3.
    b0 = [6.0, -3.0, 0.5, 1.25, 2.5, 5.0, -0.25, 7.0 / 8] + [0.0] * 24
    b1 = [0.75, -0.0625] + [0.0] * 30
    w = torch.tensor([b0 + b1])
    packed, s = Q.quantize_fp4(w)
    assert packed.shape == (1, 32) and s.shape == (1, 2)
    assert s.dtype == torch.float8_e8m0fnu
    assert s.view(torch.uint8).tolist() == [[127, 124]]
    codes = Q.unpack_fp4(packed)[0]
    # 6->7, -3->13, 0.5->1, 1.25->1.0 (2), 2.5->2 (4), 5->4 (6), -0.25->-0 (8), 0.875->1 (2)
    assert codes[:8].tolist() == [7, 13, 1, 2, 4, 6, 8, 2]
    assert packed.view(torch.uint8)[0, :4].tolist() == [0xD7, 0x21, 0x64, 0x28]
    # Block 1: 0.75 / 2^-3 = 6 -> 7; -0.0625 / 2^-3 = -0.5 -> 9.
    assert codes[32:34].tolist() == [7, 9]
    d = Q.dequantize_fp4(packed, s, dtype=torch.float32)[0]
    assert d[:8].tolist() == [6.0, -3.0, 0.5, 1.0, 2.0, 4.0, -0.0, 1.0]
    assert d[32:34].tolist() == [0.75, -0.0625]


def test_quantize_fp4_scale_rule_and_zero_block():
    w = torch.zeros(3, 32)
    w[0, 0] = 6.5            # 6.5/6 -> scale 2; 6.5/2 = 3.25 -> 3 -> 6.0
    w[1, 0] = 12.0           # exactly 6*2 -> scale 2, not bumped
    packed, s = Q.quantize_fp4(w)
    f = Q.e8m0_to_float(s)[:, 0]
    assert f.tolist() == [2.0, 2.0, 2.0**-126]          # all-zero: amax floor 6*2^-126
    assert s.view(torch.uint8)[2, 0].item() == 1
    d = Q.dequantize_fp4(packed, s, dtype=torch.float32)
    assert d[0, 0].item() == 6.0 and d[1, 0].item() == 12.0 and not d[2].any()


def test_fp4_round_trip_idempotent_and_bf16_dtype():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 128, generator=g).to(torch.bfloat16)
    d1 = Q.dequantize_fp4(*Q.quantize_fp4(w))
    assert d1.dtype == torch.bfloat16 and d1.shape == w.shape
    d2 = Q.dequantize_fp4(*Q.quantize_fp4(d1))
    assert torch.equal(d1, d2)


_TORCH_FP4_NAMES = {"_n_ones", "EBITS_F32", "MBITS_F32", "F32_EXP_BIAS", "_f32_to_floatx_unpacked",
                    "down_size", "pack_uint4", "FP4_EBITS", "FP4_MBITS", "_bfloat16_to_float4_e2m1fn_x2"}


def _torch_fp4_packer():
    """torch's own bf16 -> float4_e2m1fn_x2 packer from its testing helpers.

    Importing that module needs test-only packages (expecttest); when the import fails,
    run just the few top-level definitions the packer needs from torch's source file.
    """
    try:
        from torch.testing._internal.common_quantized import _bfloat16_to_float4_e2m1fn_x2
        return _bfloat16_to_float4_e2m1fn_x2
    except Exception:
        pass
    import ast
    import importlib.util
    import typing
    spec = importlib.util.find_spec("torch.testing._internal")
    path = spec.submodule_search_locations[0] + "/common_quantized.py"
    tree = ast.parse(open(path).read())

    def names(node):
        if isinstance(node, ast.FunctionDef):
            return {node.name}
        if isinstance(node, ast.Assign):
            return {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        return set()

    body = [n for n in tree.body if names(n) and names(n) <= _TORCH_FP4_NAMES]
    ns = {"torch": torch, "Tensor": torch.Tensor, "typing": typing}
    exec(compile(ast.Module(body=body, type_ignores=[]), path, "exec"), ns)
    return ns["_bfloat16_to_float4_e2m1fn_x2"]


def test_fp4_cross_check_torch_float4_packing():
    try:
        to_fp4 = _torch_fp4_packer()
    except Exception as exc:  # private helper; skip cleanly where it is missing
        pytest.skip(f"torch's float4_e2m1fn_x2 packing helper is unavailable: {exc}")
    g = torch.Generator().manual_seed(4)
    x = torch.cat([torch.randn(2000, generator=g) * 2.5,
                   torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 9.0] * 2)])
    x = x.to(torch.bfloat16)
    ref_fp4 = to_fp4(x)
    assert ref_fp4.dtype == torch.float4_e2m1fn_x2
    ref = ref_fp4.view(torch.uint8)
    ours = Q.pack_fp4(Q.e2m1_encode(x.float())).view(torch.uint8)
    # torch maps negatives that round to zero to +0 or -0; compare the values, and the
    # codes wherever the value is not zero.
    assert torch.equal(Q.e2m1_decode(Q.unpack_fp4(ref)), Q.e2m1_decode(Q.unpack_fp4(ours)))
    nz = Q.e2m1_decode(Q.unpack_fp4(ours)) != 0
    assert torch.equal(Q.unpack_fp4(ref)[nz], Q.unpack_fp4(ours)[nz])


# ------------------------------------------------------------------ fake quantization

def test_fake_quant_fp8_hand_values():
    x = torch.tensor([[1.0, -0.3, 0.01, 0.0,    # amax 1 -> scale 2^-8
                       0.0, 0.0, 0.0, 0.0,      # zeros stay zero
                       448.0, 1.0, -3.0, 100.0]])  # amax 448 -> scale 1
    y = Q.fake_quant_fp8(x, 4)
    # 1/2^-8 = 256 (exact); -0.3*256 = -76.8 -> -80 (step 8); 2.56 -> 2.5 (step 0.25)
    want = [1.0, -80 / 256, 2.5 / 256, 0.0, 0, 0, 0, 0, 448.0, 1.0, -3.0, 96.0]
    assert y[0].tolist() == want
    assert y.dtype == x.dtype


def test_fake_quant_fp8_bf16_and_float_scale():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 128, generator=g)
    y32 = Q.fake_quant_fp8(x, 64)
    y16 = Q.fake_quant_fp8(x.to(torch.bfloat16), 64)
    assert y16.dtype == torch.bfloat16
    assert torch.equal(Q.fake_quant_fp8(x.to(torch.bfloat16).float(), 64).to(torch.bfloat16), y16)
    assert torch.equal(Q.fake_quant_fp8(y32, 64), y32)              # idempotent
    assert ((y32 - x).abs() <= x.abs() * 2.0**-4 + 1e-6).all()
    # Without power-of-two rounding the block max maps to 448 exactly.
    z = torch.tensor([[3.0, 1.0, -0.5, 0.25]])
    y = Q.fake_quant_fp8(z, 4, round_scale=False)
    assert y[0, 0].item() == pytest.approx(3.0, rel=1e-6)
    with pytest.raises(ValueError):
        Q.fake_quant_fp8(torch.zeros(2, 10), 4)


def test_fake_quant_fp4_ue8m0():
    x = torch.tensor([[6.0, 1.25, -0.75, 5.0, 12.0, 2.5, -1.0, 0.2]])
    y = Q.fake_quant_fp4(x, 4)
    # block 0: scale 1; block 1: amax 12 -> scale 2: 1.25 -> 1, -0.5 -> -0.5, 0.1 -> 0
    assert y[0].tolist() == [6.0, 1.0, -1.0, 4.0, 12.0, 2.0, -1.0, 0.0]
    # Agrees with quantize_fp4 + dequantize_fp4 on random data (same rule).
    g = torch.Generator().manual_seed(6)
    w = torch.randn(8, 64, generator=g)
    assert torch.equal(Q.fake_quant_fp4(w, 32),
                       Q.dequantize_fp4(*Q.quantize_fp4(w), dtype=torch.float32))


def test_fake_quant_fp4_e4m3_scale():
    x = torch.zeros(2, 16)
    x[0, 0], x[0, 1], x[0, 2] = 7.0, 1.0, -2.0
    y = Q.fake_quant_fp4(x, 16, scale_fmt="e4m3")
    # amax 7: 7/6 = 1.1667 -> e4m3 (step 1/8) 1.125. 7/1.125 = 6.2 -> clamp 6 -> 6.75;
    # 1/1.125 = 0.89 -> 1 -> 1.125; -2/1.125 = -1.78 -> -2 -> -2.25.
    assert y[0, :3].tolist() == [6.75, 1.125, -2.25]
    assert not y[0, 3:].any() and not y[1].any()      # zero block: floor 6*2^-9, stays 0
    # Small amax uses an e4m3 subnormal scale: amax 0.03 -> 0.005 -> 5 * 2^-10 (rounded to 2^-9 steps).
    z = torch.zeros(1, 16)
    z[0, 0] = 0.03
    s = torch.tensor(0.03 / 6).to(torch.float8_e4m3fn).float().item()
    assert s == 3 * 2.0**-9
    want = Q.e2m1_decode(Q.e2m1_encode(torch.tensor(min(0.03 / s, 6.0)))).item() * s
    assert Q.fake_quant_fp4(z, 16, "e4m3")[0, 0].item() == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError):
        Q.fake_quant_fp4(x, 16, scale_fmt="nvfp4")


# ---------------------------------------------------------------------- Hadamard

def _sylvester(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), h)
    return h


@pytest.mark.parametrize("n", [1, 2, 8, 128, 512])
def test_hadamard_orthonormal(n):
    H = Q.hadamard_matrix(n)
    assert torch.allclose(H * math.sqrt(n), _sylvester(n), atol=1e-6)
    assert torch.allclose(H @ H.T, torch.eye(n), atol=1e-5)
    assert torch.equal(H, H.T)


def test_hadamard_norm_and_involution():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 3, 128, generator=g)
    y = Q.hadamard_rotate(x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    assert torch.allclose(Q.hadamard_rotate(y), x, atol=1e-5)
    assert torch.allclose(y, x @ Q.hadamard_matrix(128), atol=1e-5)
    # e_0 maps to the constant vector n^-0.5.
    e0 = torch.zeros(128)
    e0[0] = 1.0
    assert torch.allclose(Q.hadamard_rotate(e0), torch.full((128,), 128**-0.5))
    yb = Q.hadamard_rotate(x.to(torch.bfloat16))
    assert yb.dtype == torch.bfloat16
    assert torch.equal(yb, Q.hadamard_rotate(x.to(torch.bfloat16).float()).to(torch.bfloat16))
    with pytest.raises(ValueError):
        Q.hadamard_rotate(torch.zeros(4, 6))


# ------------------------------------------------------------------------- CUDA

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    g = torch.Generator().manual_seed(8)
    w = torch.randn(200, 256, generator=g).to(torch.bfloat16)
    dev = torch.device("cuda")
    q, s = Q.quantize_fp8_blocks(w)
    qc, sc = Q.quantize_fp8_blocks(w.to(dev))
    assert torch.equal(q.view(torch.uint8), qc.view(torch.uint8).cpu())
    assert torch.equal(s.view(torch.uint8), sc.view(torch.uint8).cpu())
    assert torch.equal(Q.dequantize_fp8_blocks(q, s), Q.dequantize_fp8_blocks(qc, sc).cpu())
    p, ps = Q.quantize_fp4(w)
    pc, psc = Q.quantize_fp4(w.to(dev))
    assert torch.equal(p, pc.cpu()) and torch.equal(ps.view(torch.uint8), psc.view(torch.uint8).cpu())
    assert torch.equal(Q.dequantize_fp4(p, ps), Q.dequantize_fp4(pc, psc).cpu())
    for fn in (lambda t: Q.fake_quant_fp8(t, 64), lambda t: Q.fake_quant_fp4(t, 32),
               lambda t: Q.fake_quant_fp4(t, 16, "e4m3"), Q.hadamard_rotate):
        assert torch.equal(fn(w), fn(w.to(dev)).cpu())
    b = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(Q.e8m0_to_float(b)[:255], Q.e8m0_to_float(b.to(dev)).cpu()[:255])
