"""The Triton expert kernel (and, last, the FP8 dense GEMM) compiles for sm_90 on this CPU machine (Triton's bundled LLVM and ptxas need no GPU):
every weight format x numerics x declared tile configuration (BN as declared; the launch may narrow it to 16 / 32
for small grids), including the tl.dot_scaled W4A8 path and the byte-table decode that Triton's interpreter cannot
run. Catches a kernel that would fail to build on the H200 before a device is used."""

from __future__ import annotations

import re

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl                                   # noqa: E402
from triton.backends.compiler import GPUTarget                # noqa: E402
from triton.compiler import ASTSource                         # noqa: E402

from deepinfer.kernels import experts_triton as kt            # noqa: E402

POINTERS = {0: ("*bf16", "*bf16"), 1: ("*u8", "*u8"), 2: ("*fp8e4nv", "*fp32")}   # weights, scales per format


def compile_sm90(fn, runtime: dict, consts: dict, **options):
    """fn compiled for sm_90 with these runtime argument types and constexprs (options: num_warps, num_stages);
    asserts it fits an SM's shared memory. Compiled as sm_90 launches it: with programmatic dependent launch
    (kernels/pdl.py) unless consts say otherwise."""
    consts = {"PDL": True, **consts}
    signature = {**runtime, **{name: "constexpr" for name in consts}}
    kernel = triton.compile(ASTSource(fn, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                            options=options)
    assert kernel.metadata.shared <= 227 * 1024
    return kernel


def compile_expert_gemm(wfmt: int, a8: bool, gated: bool, tiles: kt.Tiles, native: bool, n=2304, k=5120,
                        lut: bool = False):
    w, s = POINTERS[wfmt]
    signature = {"x_ptr": "*bf16", "w1_ptr": w, "s1_ptr": s, "w3_ptr": w, "s3_ptr": s, "r_ptr": "*fp32",
                 "out_ptr": "*bf16" if gated else "*fp32", "tile_expert_ptr": "*i32", "tile_row0_ptr": "*i32",
                 "tile_rows_ptr": "*i32", "stride_xm": "i32", "stride_om": "i32", "swe": "i64", "swn": "i32",
                 "sse": "i64", "ssn": "i32", "ssk": "i32", "limit": "fp32"}
    consts = dict(N=n, K=k, WFMT=wfmt, A8=a8, GATED=gated, BM=tiles.bm, BN=tiles.bn,
                  BK=tiles.bk if wfmt else tiles.bk // 2, EXACT=False, ROUND=tl.bfloat16, NATIVE=native,
                  LUT=lut, PDL=True)
    signature.update({name: "constexpr" for name in consts})
    return triton.compile(ASTSource(kt._expert_gemm, signature, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": tiles.warps, "num_stages": tiles.stages})


@pytest.mark.parametrize("wfmt,a8,native,lut", [(1, False, False, False), (1, False, False, True), (1, True, False, False),
                                                (1, True, True, False), (2, True, False, False), (2, False, False, False),
                                                (0, False, False, False)])
@pytest.mark.parametrize("config", ["DECODE", "PREFILL", "INVARIANT", "INVARIANT_FP4"])
def test_expert_kernel_compiles_for_sm90(wfmt, a8, native, lut, config):
    tiles = getattr(kt, config)
    kernel = compile_expert_gemm(wfmt, a8, True, tiles, native, lut=lut)
    assert "warp_group_dot" in kernel.asm["ttgir"] or "mma" in kernel.asm["ttgir"]
    assert kernel.metadata.shared <= 227 * 1024                 # fits an H200 SM's shared memory
    if config == "PREFILL":
        compile_expert_gemm(wfmt, a8, False, tiles, native, n=5120, k=2304, lut=lut)     # the down projection


@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("config,fuse", [("DECODE_CONFIG", True), ("PREFILL_CONFIG", False),
                                         ("PREFILL_WIDE_CONFIG", False), ("INVARIANT_CONFIG", False)])
def test_fp8_gemm_compiles_for_sm90(block, config, fuse):
    """The FP8 block-scaled GEMM (kernels/fp8_linear_triton.py) at V4's 128 and V4.1's 32 scale blocks, every tile
    configuration: a BLOCK_N wider than the scale block reads one weight scale per column block."""
    from deepinfer.kernels import fp8_linear_triton as fl
    cfg = getattr(fl, config)
    runtime = {"x_ptr": "*bf16" if fuse else "*fp8e4nv", "sx_ptr": "*fp32", "w_ptr": "*fp8e4nv", "sw_ptr": "*u8",
               "y_ptr": "*fp32", **{a: "i32" for a in ("M", "N", "K", "NKB", "stride_x", "stride_sx", "stride_w",
                                                       "stride_sw", "stride_ys", "stride_y")}}
    consts = dict(KB_PER_SPLIT=4, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block,
                  GROUP=1 if fuse else fl.GROUP_M, FUSE_QUANT=fuse, SW_E8M0=True, SOFT_CVT=False)
    kernel = compile_sm90(fl._fp8_gemm_kernel, runtime, consts, num_warps=cfg["num_warps"],
                          num_stages=cfg["num_stages"])
    assert "warp_group_dot" in kernel.asm["ttgir"] or "mma" in kernel.asm["ttgir"]


def _ptxas_spill_bytes(ptx: str) -> int:
    """Spill stores `ptxas -v` reports for sm_90a, with the ptxas Triton itself compiles with (its bundled one,
    which differs by Triton version); the test is skipped where none is found, so call this last."""
    import os
    import re
    import subprocess
    import tempfile

    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = get_ptxas(90).path
    except Exception:                        # an older / newer Triton without this helper, or no ptxas at all
        import triton.backends.nvidia as nv
        ptxas = os.path.join(os.path.dirname(nv.__file__), "bin", "ptxas")
    if not ptxas or not os.path.exists(ptxas):
        pytest.skip("no ptxas for Triton here: the spill check needs it")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True,
                             timeout=300)
    found = re.findall(r"(\d+) bytes spill stores", out.stderr)
    assert found, f"ptxas -v printed no spill line: {out.stderr[-500:]}"
    return sum(map(int, found))


PACKED = {"plain": (0, 0, 0, 1, False), "v4_latent": (1, 448, 576, 64, False), "v41_window": (1, 512, 512, 32, False),
          "v41_entry": (2, 512, 256, 16, True)}      # (kind, quantized, scale offset, block, e4m3): kv_formats.py


@pytest.mark.parametrize("one_pass,window,entries", [
    (True, "plain", "plain"), (False, "plain", "plain"), (True, "v4_latent", "v4_latent"),
    (False, "v4_latent", "v4_latent"), (True, "v41_window", "v41_entry"), (False, "v41_window", "v41_entry")])
def test_sparse_attention_compiles_for_sm90(one_pass, window, entries):
    """The sparse sink attention kernel (kernels/attention_triton.py) at released widths: 64 heads x 512, window +
    selected entries, bf16, one pass and split-KV (+ the combine), runtime trip counts, with the DECODE tiles
    (32 heads a program: both dots on mma.sync, M = 32 being under wgmma's 64); spills no worse than measured with
    Triton 3.6 (one pass 1384 bytes, split 1408: the tiles the H200 timed fastest spill; 64 heads x 16 keys x 8
    warps spilled 100 / 180 on wgmma and ran 1.0-1.5x slower, docs/results.md). The FP8 KV records (V4's 584 B
    latents, V4.1's FP8 window + FP4 entries: kernels/kv_formats.py) decode in registers, in the key dtype; Triton
    3.6 spills 4.9-5.0 KB for V4's (the bf16 RoPE tail is a second [keys, 512] load) and 2.4 KB for V4.1's: bounded
    at 5 KB."""
    from deepinfer.kernels import attention_triton as kat
    t = kat.DECODE
    ptr = lambda fmt: "*u8" if PACKED[fmt][0] else "*bf16"            # noqa: E731
    runtime = {"q_ptr": "*bf16", "s1_ptr": ptr(window), "s1_16": "*bf16" if window in ("plain", "v4_latent") else
               ptr(window), "n1_ptr": "*bf16", "i1_ptr": "*i64",
               "s2_ptr": ptr(entries), "s2_16": "*bf16" if entries in ("plain", "v4_latent") else ptr(entries),
               "n2_ptr": "*bf16", "i2_ptr": "*i64", "sink_ptr": "*fp32", "o_ptr": "*bf16" if one_pass else "*fp32",
               "ml_ptr": "*fp32", **{a: "i32" for a in ("H", "D", "K1", "K2", "R1", "R2", "nsplit", "iters",
                                                       "stride_qn", "stride_qh", "stride_s1", "stride_n1",
                                                       "stride_i1", "stride_s2", "stride_n2", "stride_i2",
                                                       "stride_on", "stride_oh", "stride_os")},
               "qk_scale": "fp32"}
    consts = dict(BLOCK_H=t.block_h, BLOCK_D=512, BLOCK_N=t.block_n, SPLIT=t.split, ONE_PASS=one_pass, ITERS=0,
                  TWO=True, F32=False, **dict(zip(("P1", "Q1", "O1", "B1", "E1"), PACKED[window])),
                  **dict(zip(("P2", "Q2", "O2", "B2", "E2"), PACKED[entries])))
    kernel = compile_sm90(kat._sparse_attn_kernel, runtime, consts, num_warps=t.warps, num_stages=t.stages)
    assert "mma" in kernel.asm["ttgir"]
    assert kernel.metadata.shared <= 227 * 1024
    spills = _ptxas_spill_bytes(kernel.asm["ptx"])
    print(f"sparse attention, {window} + {entries}, one_pass={one_pass}: {spills} B of spills")
    assert spills <= ((1400 if one_pass else 1420) if window == "plain" else 5120), spills
    if not one_pass:
        combine = {"part_ptr": "*fp32", "ml_ptr": "*fp32", "sink_ptr": "*fp32", "o_ptr": "*bf16",
                   **{a: "i32" for a in ("H", "D", "nsplit", "stride_pn", "stride_ps", "stride_ph", "stride_on",
                                         "stride_oh")}}
        compile_sm90(kat._combine_kernel, combine, dict(NSPLIT=0, BLOCK_H=kat.COMBINE_HEADS, BLOCK_D=512),
                     num_warps=4)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("heads", [64, 32])
def test_index_scores_compile_for_sm90(heads, packed):
    """The lightning-indexer score kernel (kernels/indexer_triton.py) at V4's 64 and V4.1's 32 index heads x 128,
    bf16 keys or FP4 key records (68 B): tensor cores for q.k^T, shared memory within an SM, no spills."""
    from deepinfer.kernels import indexer_triton as kit
    keys = "*u8" if packed else "*bf16"
    runtime = {"q_ptr": "*bf16", "w_ptr": "*fp32", "s_ptr": keys, "s16_ptr": keys, "i_ptr": "*i64", "o_ptr": "*fp32",
               **{a: "i32" for a in ("H", "DI", "K", "stride_qn", "stride_qh", "stride_wn", "stride_s", "stride_in",
                                     "stride_on")}, "scale": "fp32"}
    fmt = (2, 128, 64, 32, False) if packed else (0, 0, 0, 1, False)
    kernel = compile_sm90(kit._index_scores_kernel, runtime,
                          dict(BLOCK_H=heads, BLOCK_D=128, BLOCK_K=kit.BLOCK_K, F32=False,
                               **dict(zip(("P", "PQ", "PO", "PB", "PE"), fmt))), num_warps=kit.WARPS)
    ttgir = kernel.asm["ttgir"]
    assert "warp_group_dot" in ttgir or "mma" in ttgir
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0


@pytest.mark.parametrize("from_parts", [False, True])
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_hc_mixes_compiles_for_sm90(dtype, from_parts):
    """The fused mHC mixing kernels (kernels/mhc_triton.py) at released width (hc 4 x 5120 = 20480 per row), 20
    Sinkhorn iterations, walking the chunks or adding the chunk kernel's parts (+ that kernel): shared memory
    within an SM, spills no worse than measured with Triton 3.6 and TF32x3 dots (session 25; a TF32x3 dot holds
    each operand as a high and a low part): walking the chunks 644 bytes (bf16 streams) / 176 (fp32), a path no
    batch takes on an H200 (chunks first below 1057 rows, cuBLAS from 512); from the parts none / 8; the chunk
    kernel, the decode path, 12 / 8 (ieee dots: 8 / 88, 0 / 8, 0 / 8)."""
    from deepinfer.kernels import mhc_triton as kmt
    runtime = {"x_ptr": dtype, "fn_ptr": "*fp32", "part_ptr": "*fp32", "base_ptr": "*fp32", "scale_ptr": "*fp32",
               "pre_ptr": "*fp32", "post_ptr": "*fp32", "comb_ptr": "*fp32", "N": "i32", "K": "i32",
               "stride_x": "i32", "hc_eps": "fp32", "norm_eps": "fp32"}
    block_k = kmt.BLOCK_K[torch.bfloat16 if dtype == "*bf16" else torch.float32]
    chunk_iters = kmt.CHUNK // block_k
    tiles = dict(HC=4, BLOCK_C=16, BLOCK_R=kmt.BLOCK_R, BLOCK_K=block_k, CHUNK_ITERS=chunk_iters, PREC=kmt.PRECISION)
    kernel = compile_sm90(kmt._hc_mixes_kernel, runtime, dict(tiles, CHUNKS=20480 // kmt.CHUNK,
                                                              FROM_PARTS=from_parts, ITERS=20), num_warps=kmt.WARPS)
    bound = {("*bf16", False): 644, ("*fp32", False): 176, ("*bf16", True): 0, ("*fp32", True): 8}[dtype, from_parts]
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) <= bound
    if from_parts:
        chunks = {a: runtime[a] for a in ("x_ptr", "fn_ptr", "part_ptr", "N", "K", "stride_x")}
        kernel = compile_sm90(kmt._hc_chunks_kernel, chunks, tiles, num_warps=kmt.WARPS)
        assert _ptxas_spill_bytes(kernel.asm["ptx"]) <= (12 if dtype == "*bf16" else 8)


@pytest.mark.parametrize("block,tiles,warps,k_pad", [(4096, 8, 8, 512), (4096, 1, 8, 2048), (256, 1, 4, 512)])
def test_top_k_compiles_for_sm90(block, tiles, warps, k_pad):
    """The indexer's top-k (kernels/indexer_triton.py: radix select over the ordered key, an index-order pass, a
    K_PAD-wide sort) as top_k_kernel launches it: 32768 candidates in 4096-key tiles, 4096 resident in registers,
    a 256-key decode row: compiles, fits an SM, no spills."""
    from deepinfer.kernels import indexer_triton as kit
    runtime = {"s_ptr": "*fp32", "o_ptr": "*i64", "tmp_ptr": "*i64",
               **{a: "i32" for a in ("K", "k", "stride_s", "stride_o", "stride_t")}}
    kernel = compile_sm90(kit._top_k_kernel, runtime, dict(BLOCK=block, TILES=tiles, K_PAD=k_pad), num_warps=warps)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0
    hists = [line for line in kernel.asm["ttgir"].splitlines() if "tt.histogram" in line]
    assert hists and all(re.search(r"tt\.histogram %[\w.]+ :", h) for h in hists)     # the radix passes, unmasked


@pytest.mark.parametrize("dtype,block_n", [("*bf16", 8192), ("*bf16", 512), ("*fp32", 8192)])
def test_rms_norm_compiles_for_sm90(dtype, block_n):
    """The RMSNorm kernel (kernels/norm_triton.py) at the hidden widths (5120 -> BLOCK_N 8192, one row a program)
    and the q-norm's 512 (8 rows a program): compiles, fits an SM, no spills."""
    from deepinfer.kernels import norm_triton as knt
    runtime = {"x_ptr": dtype, "w_ptr": dtype, "out_ptr": dtype, "rows": "i32", "n": "i32", "eps": "fp32"}
    block_r = max(1, min(16, 4096 // block_n))           # as rms_norm_kernel picks it
    kernel = compile_sm90(knt._rms_norm_kernel, runtime, dict(HAS_W=True, BLOCK_R=block_r, BLOCK_N=block_n),
                          num_warps=knt.WARPS)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_mhc_row_kernels_compile_for_sm90(dtype):
    """hc_collapse / hc_post (kernels/mhc_triton.py) at hc 4: compile, fit an SM, no spills."""
    from deepinfer.kernels import mhc_triton as kr
    consts = dict(HC=4, BLOCK_D=kr.ROWS_BLOCK_D)
    collapse = compile_sm90(kr._collapse_kernel, {"h_ptr": dtype, "pre_ptr": "*fp32", "out_ptr": dtype, "D": "i32"},
                            consts, num_warps=kr.ROWS_WARPS)
    post = compile_sm90(kr._post_kernel, {"f_ptr": dtype, "h_ptr": dtype, "post_ptr": "*fp32", "comb_ptr": "*fp32",
                                          "out_ptr": dtype, "D": "i32"}, consts, num_warps=kr.ROWS_WARPS)
    assert _ptxas_spill_bytes(collapse.asm["ptx"]) == 0 and _ptxas_spill_bytes(post.asm["ptx"]) == 0


@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_rope_compiles_for_sm90(dtype):
    """RoPE (kernels/rope_triton.py) over 512-channel rows, 8 rows a program: compiles, fits an SM, no spills."""
    from deepinfer.kernels import rope_triton as krt
    runtime = {"x_ptr": dtype, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": dtype, "M": "i32", "D": "i32",
               "HALF": "i32", "SIGN": "fp32"}
    kernel = compile_sm90(krt._rope_kernel, runtime, dict(BLOCK_M=8, BLOCK_D=512), num_warps=krt.WARPS)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0


def test_rope_angles_compile_for_sm90():
    """The cos / sin tables (kernels/rope_triton.py `_angles_kernel`) at 128 rows x 32 frequencies: compiles, and
    cos / sin are the accurate functions (no cos.approx / sin.approx). Local memory stays bounded: libdevice's
    cosf / sinf keep their large-argument reduction (Payne-Hanek) in a small local array (60 bytes here)."""
    from deepinfer.kernels import rope_triton as krt
    runtime = {"pos_ptr": "*i64", "inv_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "N": "i32", "H": "i32"}
    kernel = compile_sm90(krt._angles_kernel, runtime, dict(BLOCK_N=128, BLOCK_H=32), num_warps=4)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) <= 64
    assert "sin.approx" not in kernel.asm["ptx"] and "cos.approx" not in kernel.asm["ptx"]


@pytest.mark.parametrize("values", [False, True])
@pytest.mark.parametrize("fmt", ["v4_latent", "v41_window", "v41_entry", "index_key"])
def test_row_quantizer_compiles_for_sm90(fmt, values):
    """The row quantizer (kernels/quant_triton.py) for the released records (584 / 528 / 288 / 68 B) and as the
    QAT fake-quant (VALUES), bf16 rows: no spills."""
    from deepinfer.kernels import kv_formats as kf
    from deepinfer.kernels import quant_triton as kq
    f = {"v4_latent": kf.V4_LATENT, "v41_window": kf.V41_WINDOW, "v41_entry": kf.V41_ENTRY,
         "index_key": kf.INDEX_KEY}[fmt]
    nb = f.quantized // f.block
    pad = f.record_bytes - f.scale_offset - nb
    runtime = {"x_ptr": "*bf16", "o_ptr": "*bf16" if values else "*u8", "o16_ptr": "*bf16" if values else "*i16",
               "y_ptr": "*bf16", "stride_x": "i32", "stride_o": "i32", "stride_y": "i32"}
    consts = dict(KIND=1 if f.kind == "fp8" else 2, Q=f.quantized, W=f.width, SOFF=f.scale_offset,
                  B=f.record_bytes, BLK=f.block, NB=nb, NB_PAD=kq.pow2(nb, 1),
                  E4M3=f.kind == "fp4" and f.scale == "e4m3",
                  TAIL_PAD=kq.pow2(f.tail, 1) if f.tail and not values else 0,
                  PAD_PAD=kq.pow2(pad, 1) if pad and not values else 0, VALUES=values, SOFT=False, HADAMARD=0,
                  HSCALE=1.0)
    kernel = compile_sm90(kq._quant_kernel, runtime, consts, num_warps=4)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0


def test_index_qat_compiles_for_sm90():
    """The row quantizer with the Hadamard butterfly first (V4's indexer q / k: 128 channels, FP4 per 32), bf16."""
    from deepinfer.kernels import quant_triton as kq
    runtime = {"x_ptr": "*bf16", "o_ptr": "*bf16", "o16_ptr": "*bf16", "y_ptr": "*bf16", "stride_x": "i32",
               "stride_o": "i32", "stride_y": "i32"}
    consts = dict(KIND=2, Q=128, W=128, SOFF=64, B=68, BLK=32, NB=4, NB_PAD=4, E4M3=False, TAIL_PAD=0, PAD_PAD=0,
                  VALUES=True, SOFT=False, HADAMARD=7, HSCALE=128 ** -0.5)
    kernel = compile_sm90(kq._quant_kernel, runtime, consts, num_warps=4)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0


@pytest.mark.parametrize("noise", [False, True])
def test_sampling_draw_compiles_for_sm90(noise):
    """The sampler's draw (kernels/sampling_triton.py: int64 SplitMix64 in registers, float64 log) over fp32 logits:
    compiles, fits an SM, no spills."""
    from deepinfer.kernels import sampling_triton as ks
    runtime = {"x_ptr": "*fp32", "noise_ptr": "*i8", "seed_ptr": "*i64", "pos_ptr": "*i64",
               "val_ptr": "*fp64" if noise else "*fp32",
               "idx_ptr": "*i64", "V": "i32", "stride_x": "i32", "salt": "i64"}
    kernel = compile_sm90(ks._draw_kernel, runtime, dict(NOISE=noise, CHUNK=ks.CHUNK, BLOCK=ks.BLOCK), num_warps=4)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0


@pytest.mark.parametrize("from_parts", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_route_compiles_for_sm90(bias, from_parts):
    """The fused route kernel (kernels/routing_triton.py: logits from the chunk parts or walked here, scores, k rounds
    of argmax) at V4.1's router (384 experts of 5120, top 6) as _route_triton launches it: compiles, fits an SM, no
    spills."""
    from deepinfer.kernels import routing_triton as kr
    runtime = {**{p: t for p, t in (("x_ptr", "*bf16"), ("w_ptr", "*fp32"), ("part_ptr", "*fp32"),
                                    ("bias_ptr", "*fp32"), ("tid2eid_ptr", "*i32"), ("input_ids_ptr", "*i64"),
                                    ("out_w_ptr", "*fp32"), ("out_ids_ptr", "*i64"))},
               "N": "i32", "temp": "fp32", "route_scale": "fp32"}
    consts = dict(D=5120, E=384, K=6, SCORE=0, HAS_BIAS=bias, HASH=False, NORMALIZE=True, BLOCK_N=kr.ROUTE_BLOCK_ROWS,
                  BLOCK_D=32, E_PAD=512, K_PAD=8, CHUNKS=10, CHUNK_ITERS=16, FROM_PARTS=from_parts,
                  PREC=kr.ROUTE_PRECISION)
    kernel = compile_sm90(kr._route_kernel, runtime, consts, num_warps=8)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0


@pytest.mark.parametrize("rows,warps", [(1, 1), (2, 2), (8, 8)])
def test_route_few_row_epilogue_compiles_for_sm90(rows, warps):
    """The `triton` set's decode epilogue (kernels/routing_triton.py fit_rows) at V4.1's router: pow2(N) rows on a
    warp per 512 logits, as _route_triton launches it below 16 rows: compiles, no spills."""
    from deepinfer.kernels import routing_triton as kr
    runtime = {**{p: t for p, t in (("x_ptr", "*bf16"), ("w_ptr", "*fp32"), ("part_ptr", "*fp32"),
                                    ("bias_ptr", "*fp32"), ("tid2eid_ptr", "*i32"), ("input_ids_ptr", "*i64"),
                                    ("out_w_ptr", "*fp32"), ("out_ids_ptr", "*i64"))},
               "N": "i32", "temp": "fp32", "route_scale": "fp32"}
    consts = dict(D=5120, E=384, K=6, SCORE=0, HAS_BIAS=True, HASH=False, NORMALIZE=True, BLOCK_N=rows,
                  BLOCK_D=32, E_PAD=512, K_PAD=8, CHUNKS=10, CHUNK_ITERS=16, FROM_PARTS=True,
                  PREC=kr.ROUTE_PRECISION)
    kernel = compile_sm90(kr._route_kernel, runtime, consts, num_warps=warps)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0


@pytest.mark.parametrize("has_rows", [False, True])
def test_step_index_kernels_compile_for_sm90(has_rows):
    """The step-index kernels (kernels/step_index_triton.py) at the largest column blocks the functions launch:
    compile, fit an SM, no spills."""
    from deepinfer.kernels import step_index_triton as ks
    i64 = "*i64"
    ring = compile_sm90(ks._ring_index_kernel, {**{p: i64 for p in ("pos_ptr", "start_ptr", "first_ptr", "ring_ptr",
                                                                     "rows_ptr", "out_ptr")},
                                                **{a: "i32" for a in ("C", "count", "base", "span")}},
                        dict(HAS_ROWS=has_rows, BLOCK_R=ks.BLOCK_ROWS, BLOCK_T=ks.RING_BLOCK_COLS), num_warps=4)
    slots = compile_sm90(ks._entry_slots_kernel, {"pos_ptr": i64, "slot_ptr": i64, "rows_ptr": i64,
                                                  "table_ptr": "*i32", "floor_ptr": i64, "out_block_ptr": i64,
                                                  "out_at_ptr": i64,
                                                  **{a: "i32" for a in ("C", "stride_t", "max_blocks", "ratio",
                                                                        "per_block", "block_tokens", "scratch")}},
                         dict(HAS_ROWS=has_rows, BLOCK=ks.BLOCK), num_warps=4)
    index = compile_sm90(ks._entry_index_kernel, {"pos_ptr": i64, "slot_ptr": i64, "rows_ptr": i64, "table_ptr": "*i32",
                                                  "out_ptr": i64, **{a: "i32" for a in ("C", "J", "stride_t", "ratio",
                                                                                         "per_block")}},
                         dict(HAS_ROWS=has_rows, BLOCK_J=ks.ENTRY_BLOCK_COLS), num_warps=4)
    ring_slots = compile_sm90(ks._ring_slots_kernel, {"pos_ptr": i64, "end_ptr": i64, "slot_ptr": i64,
                                                      "out_slot_ptr": i64, "out_at_ptr": i64, "N": "i32", "span": "i32",
                                                      "scratch": "i32"}, dict(BLOCK=ks.BLOCK), num_warps=4)
    pick = compile_sm90(ks._entry_pick_kernel, {"index_ptr": i64, "top_ptr": i64, "out_ptr": i64,
                                                **{a: "i32" for a in ("C", "J", "k", "stride_i", "stride_t")}},
                        dict(BLOCK_C=512, BLOCK_K=8), num_warps=4)
    for kernel in (ring, slots, index, ring_slots, pick):
        assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0


@pytest.mark.parametrize("dtype,fill,block_w", [("fp32", "fp32", 512), ("bf16", "fp32", 4096), ("i64", "i64", 1)])
def test_gather_rows_compiles_for_sm90(dtype, fill, block_w):
    """gather_rows (kernels/gather_triton.py) for a compressor's fp32 pending rows, a bf16 store and the int64
    token-id look-back, at its widest column block and at one column: compiles, fits an SM, no spills."""
    from deepinfer.kernels import gather_triton as kg
    kernel = compile_sm90(kg._gather_rows_kernel, {"ring_ptr": f"*{dtype}", "new_ptr": f"*{dtype}", "index_ptr": "*i64",
                                                   "out_ptr": f"*{dtype}", "L": "i32", "W": "i32", "R": "i32",
                                                   "stride_r": "i32", "stride_n": "i32", "fill": fill},
                          dict(BLOCK_R=kg.BLOCK_ELEMENTS // block_w, BLOCK_W=block_w), num_warps=4)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0


@pytest.mark.parametrize("bins,bm", [(512, 16), (1024, 64)])
def test_tile_table_compiles_for_sm90(bins, bm):
    """The experts' one-launch tile table (kernels/experts_triton.py) for V4.1's 384 experts and the largest table
    a program holds: compiles, fits an SM, no spills."""
    kernel = compile_sm90(kt._tile_table_kernel, {"offsets_ptr": "*i64", "out_ptr": "*i32", "T": "i32", "E": "i32",
                                                  "last_row": "i32"},
                          dict(BM=bm, BLOCK_T=kt.TILE_BLOCK, BINS=bins), num_warps=4)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0


@pytest.mark.parametrize("dtype,has_r", [("bf16", True), ("fp32", False)])
def test_gated_activation_compiles_for_sm90(dtype, has_r):
    """The experts' gated activation (kernels/experts_ogs_triton.py), with the routing weight (between matmul_ogs's
    GEMMs) and without (the `swiglu` op), at its widest block: compiles, no spills."""
    from deepinfer.kernels import experts_ogs_triton as ko
    kernel = compile_sm90(ko._gated_activation, {"gate_ptr": f"*{dtype}", "up_ptr": f"*{dtype}", "r_ptr": "*fp32",
                                                 "h_ptr": "*fp32", "N": "i32", "sg": "i32", "su": "i32", "sh": "i32",
                                                 "limit": "fp32"},
                          dict(HAS_R=has_r, BLOCK=1024), num_warps=4)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0


@pytest.mark.parametrize("slots", [4, 8, 128])
def test_softmax_pool_compiles_for_sm90(slots):
    """The compressor pooling kernel (kernels/softmax_pool_triton.py) for V4.1's 4-slot groups and V4's 8 / 128-slot
    windows at the block the function picks for 512 channels: compiles, no spills."""
    from deepinfer.kernels import softmax_pool_triton as ks
    kernel = compile_sm90(ks._softmax_pool_kernel, {"kv_ptr": "*fp32", "score_ptr": "*fp32", "out_ptr": "*fp32",
                                                    **{a: "i32" for a in ("S", "D", "kv_n", "kv_s", "sc_n", "sc_s")}},
                          dict(S_PAD=slots, BLOCK_D=min(512, ks.BLOCK_ELEMENTS // slots)), num_warps=4)
    assert _ptxas_spill_bytes(kernel.asm["ptx"]) == 0
