#!/usr/bin/env python3
"""Peer benchmark: Triton `triton_kernels` MXFP4 MoE matmul (`matmul_ogs`) on Hopper (sm_90).

Measurement script only (not part of the project). Built against triton_kernels from the
triton v3.6.0 tag (commit 7c56a5e40f7fd928dfd5c72902d5def0097db73a, python/triton_kernels),
which is the version that matches the triton==3.6.0 wheel.

Shapes: DeepSeek-V4.1-Flash routed experts: E=384, top-k=6, H=5120, I=2304.
  gate_up: y[T*6, 2I] = x[T, H] (gathered per expert) @ W1[e]   (W1 ours: [E, 2I, H], K=H)
  down   : y[T, H]    = sum_k a[T*6, I] @ W2[e]                 (W2 ours: [E, H, I], K=I)
Weights: MXFP4 = e2m1 packed 2/byte along K (low nibble = even k) + e8m0 scale per 32 along K,
random bytes. Activations bf16 (W4A16). fp8 x mxfp4 is NOT supported on sm_90 by this
triton_kernels version (tests skip "float8 x mx not supported with cuda capability < 10";
the HOPPER_VALUE kernel path static_asserts bf16 activations), so W4A8 is not run.

Run:  PYTHONPATH=<site> python tk_peer.py      (env: OUT=<dir>, TK_T=1,16,64,256,8192,
      TK_NW=auto|4|8|both, TK_SEED=0, TK_REF=1, TK_PROF=1, TK_BUDGET_S=170)
      python tk_peer.py --cpu-selftest   (tiny shapes, CPU torch: layout/routing/reference code)
Every stage prints one line on failure ("[FAIL] stage: Exc: msg"); the script always exits 0.
"""
import json
import os
import sys
import time
import traceback

TK_VERSION = "triton v3.6.0 tag, commit 7c56a5e40f7fd928dfd5c72902d5def0097db73a"
E, TOPK, H, I = 384, 6, 5120, 2304
T_LIST = [int(t) for t in os.environ.get("TK_T", "1,16,64,256,8192").split(",") if t.strip()]
NW_MODE = os.environ.get("TK_NW", "auto")
SEED = int(os.environ.get("TK_SEED", "0"))
DO_REF = os.environ.get("TK_REF", "1") != "0"
DO_PROF = os.environ.get("TK_PROF", "1") != "0"
BUDGET_S = float(os.environ.get("TK_BUDGET_S", "170"))
OUT_DIR = os.environ.get("OUT") or "."
SCALE_LO, SCALE_HI = 118, 122  # e8m0 exponents -> 2^-9 .. 2^-5 (keeps outputs O(1))
CHUNK_E = 32  # experts per swizzle chunk (bounds temporary memory of the layout code)

T0 = time.time()
ROWS = []
ERRLOG = []


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def fail(stage, e):
    msg = f"{type(e).__name__}: {e}".replace("\n", " | ")
    if len(msg) > 500:
        msg = msg[:500] + "..."
    print(f"[FAIL] {stage}: {msg}", flush=True)
    ERRLOG.append(f"=== {stage}\n{traceback.format_exc()}")


def emit(row):
    ROWS.append(row)
    try:
        os.makedirs(OUT_DIR, exist_ok=True)
        with open(os.path.join(OUT_DIR, "tk_peer.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
    except Exception as e:  # keep going; rows are also printed at the end
        fail("write jsonl", e)


# --------------------------------------------------------------------------------------
# code shared by the GPU run and the CPU self-test
# --------------------------------------------------------------------------------------
def build_value_tensor(q_raw, layout_cls, layout_opts, chunk=CHUNK_E):
    """q_raw: our layout [E, N, K/2] uint8 contiguous (packed along K).
    Returns a triton_kernels Tensor (dtype FP4, logical shape [E, K, N]) in `layout_cls`,
    identical to convert_layout(wrap_torch_tensor(q_raw.transpose(1, 2), FP4), layout_cls, **opts)
    but swizzled `chunk` experts at a time (the layout code is per-expert; checked on CPU)."""
    import torch
    from triton_kernels.tensor import convert_layout, wrap_torch_tensor, FP4, Tensor, Storage
    w = q_raw.transpose(1, 2)  # [E, K/2, N], K contiguous == downcast_to_mxfp(..., axis=1) output
    n_e = w.shape[0]
    full = None
    for e0 in range(0, n_e, chunk):
        t = convert_layout(wrap_torch_tensor(w[e0:e0 + chunk], dtype=FP4), layout_cls, **layout_opts)
        d = t.storage.data
        if full is None:
            dense_batch_outer = d.ndim == 3 and d.stride(0) == d.shape[1] * d.shape[2]
            if not dense_batch_outer or chunk >= n_e:
                # fall back to one-shot conversion (identical result, more temporary memory)
                return convert_layout(wrap_torch_tensor(w, dtype=FP4), layout_cls, **layout_opts)
            full = torch.empty_strided((n_e, ) + tuple(d.shape[1:]), d.stride(), dtype=d.dtype, device=d.device)
        full[e0:e0 + d.shape[0]].copy_(d)
        del t, d
    lay = layout_cls(w.shape, **layout_opts)
    shape = list(w.shape)
    shape[1] *= 2
    return Tensor(Storage(full, lay), dtype=FP4, shape=shape)


def build_scale_tensor(s_raw, layout_cls, layout_opts):
    """s_raw: our layout [E, N, K/32] uint8 (e8m0). Returns Tensor [E, K/32, N] in layout_cls."""
    from triton_kernels.tensor import convert_layout, wrap_torch_tensor
    return convert_layout(wrap_torch_tensor(s_raw.transpose(1, 2)), layout_cls, **layout_opts)


def make_routing_indices(T, n_e, k, device, gen):
    """Uniform random routing: each token gets k distinct experts.
    Returns expt [T,k] int32, flat [T*k], col_sorted (sorted pos -> pair id),
    row_sorted (pair id -> sorted pos), col_sum [E] (tokens per expert), all int32.
    Same semantics as triton_kernels BitmatrixMetadata (make_bitmatrix_metadata_torch); its
    triton topk/bitmatrix kernels need power-of-2 k (tl.arange(0, k)), so k=6 is built in torch."""
    import torch
    logits = torch.rand((T, n_e), device=device, generator=gen)
    expt = torch.topk(logits, k, dim=1).indices
    expt = torch.sort(expt, dim=1).values.to(torch.int32)
    flat = expt.reshape(-1)
    col_sorted = torch.argsort(flat, stable=True).to(torch.int32)
    row_sorted = torch.argsort(col_sorted, stable=True).to(torch.int32)
    col_sum = torch.bincount(flat.long(), minlength=n_e).to(torch.int32)
    return expt, flat, col_sorted, row_sorted, col_sum


def check_routing(flat, col_sorted, row_sorted, col_sum, slice_offs):
    """Sorted rows must be grouped by expert consistently with the ragged metadata."""
    import torch
    e_sorted = flat.long()[col_sorted.long()]
    assert bool((e_sorted[1:] >= e_sorted[:-1]).all()), "sorted rows not grouped by expert"
    n = flat.numel()
    assert torch.equal(row_sorted.long()[col_sorted.long()], torch.arange(n, device=flat.device)), "not inverse perms"
    offs = slice_offs.long()
    assert int(offs[-1]) == n and int(offs[0]) == 0, "slice_offs ends wrong"
    assert torch.equal(offs[1:] - offs[:-1], col_sum.long()), "slice_offs != cumsum(col_sum)"
    # each sorted row r lies inside the slice of its expert
    r = torch.arange(n, device=flat.device)
    assert bool(((r >= offs[e_sorted]) & (r < offs[e_sorted + 1])).all()), "row outside its expert slice"


def dequant_expert(q_raw, s_raw, e):
    """[N, K] float32 from our layout (low nibble = even k), via triton_kernels' torch reference."""
    import torch
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch
    return upcast_from_mxfp_torch(q_raw[e], s_raw[e], torch.float32, axis=-1)


def dequant_expert_lut(q_raw, s_raw, e):
    """Independent dequant (for the self-test only)."""
    import torch
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       device=q_raw.device)
    q = q_raw[e].long()
    v = torch.stack([lut[q & 0xF], lut[(q >> 4) & 0xF]], dim=-1).reshape(q.shape[0], -1)
    sc = torch.exp2(s_raw[e].float() - 127.0).repeat_interleave(32, dim=-1)
    return v * sc


def ref_gate_up(x, q_raw, s_raw, flat, col_sorted, rows):
    """Reference for sorted-order output rows `rows` of the gathered gate_up GEMM."""
    import torch
    pairs = col_sorted.long()[rows]
    toks = pairs // TOPK
    experts = flat.long()[pairs]
    out = torch.empty((rows.numel(), q_raw.shape[1]), dtype=torch.float32, device=x.device)
    for e in torch.unique(experts).tolist():
        m = experts == e
        w = dequant_expert(q_raw, s_raw, e)  # [N, K]
        out[m] = x[toks[m]].float() @ w.t()
    return out


def ref_down(a, q_raw, s_raw, flat, row_sorted, toks):
    """Reference for tokens `toks` of the scattered+reduced down GEMM (no gammas)."""
    import torch
    out = torch.zeros((toks.numel(), q_raw.shape[1]), dtype=torch.float32, device=a.device)
    pairs = (toks[:, None] * TOPK + torch.arange(TOPK, device=a.device)[None, :]).reshape(-1)
    experts = flat.long()[pairs]
    srows = row_sorted.long()[pairs]
    slot = torch.arange(toks.numel(), device=a.device).repeat_interleave(TOPK)
    for e in torch.unique(experts).tolist():
        m = experts == e
        w = dequant_expert(q_raw, s_raw, e)
        out.index_add_(0, slot[m], a[srows[m]].float() @ w.t())
    return out


def rel_err(y, ref):
    y = y.float()
    return float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# --------------------------------------------------------------------------------------
# CPU self-test (tiny shapes): exercises the code paths above that do not need a GPU
# --------------------------------------------------------------------------------------
def cpu_selftest():
    import torch
    from triton_kernels.tensor import convert_layout, wrap_torch_tensor, FP4, make_ragged_tensor_metadata_torch
    from triton_kernels.tensor_details.layout import HopperMXValueLayout, HopperMXScaleLayout
    from triton_kernels.numerics_details.mxfp import downcast_to_mxfp_torch
    ok = True
    g = torch.Generator().manual_seed(0)
    n_e, N, K = 5, 512, 384
    q = torch.randint(0, 256, (n_e, N, K // 2), dtype=torch.uint8, generator=g)
    s = torch.randint(SCALE_LO, SCALE_HI + 1, (n_e, N, K // 32), dtype=torch.uint8, generator=g)
    whole = convert_layout(wrap_torch_tensor(q.transpose(1, 2), dtype=FP4), HopperMXValueLayout, mx_axis=1)
    for ch in (1, 2, 3):
        t = build_value_tensor(q, HopperMXValueLayout, {"mx_axis": 1}, chunk=ch)
        same = (torch.equal(t.storage.data, whole.storage.data) and t.storage.data.stride() == whole.storage.data.stride()
                and list(t.shape) == list(whole.shape) and t.dtype == whole.dtype
                and t.storage.layout == whole.storage.layout and t.stride(-2) == 1)
        print(f"value chunk={ch}: equal to one-shot convert_layout: {same}; storage {tuple(t.storage.data.shape)} "
              f"stride {t.storage.data.stride()} logical {t.shape}")
        ok &= same
    rt = whole.storage.layout.unswizzle_data(whole.storage.data)
    print(f"value unswizzle roundtrip: {torch.equal(rt, q.transpose(1, 2))}")
    ok &= torch.equal(rt, q.transpose(1, 2))
    for nw in (4, 8):
        ts = build_scale_tensor(s, HopperMXScaleLayout, {"mx_axis": 1, "num_warps": nw})
        r = torch.equal(ts.storage.layout.unswizzle_data(ts.storage.data), s.transpose(1, 2))
        print(f"scale nw={nw}: roundtrip {r}; storage {tuple(ts.storage.data.shape)} stride {ts.storage.data.stride()}")
        ok &= r
    # dequant convention: triton_kernels torch reference == independent LUT; and matches downcast packing
    d1, d2 = dequant_expert(q, s, 2), dequant_expert_lut(q, s, 2)
    print(f"dequant ref == LUT: {torch.equal(d1, d2)}")
    ok &= torch.equal(d1, d2)
    wf = torch.randn(N, K) * 0.1
    qq, ss = downcast_to_mxfp_torch(wf, torch.uint8, axis=-1)
    back = dequant_expert_lut(qq[None], ss[None], 0)
    r = float((back - wf).abs().max() / wf.abs().max())
    print(f"downcast_to_mxfp_torch -> LUT dequant rel err {r:.3f} (packing convention check, expect < 0.2)")
    ok &= r < 0.2
    # routing + ragged metadata (torch version) + reference helpers
    for T in (1, 3, 16, 64, 300):
        ne = 384
        expt, flat, cs, rs, csum = make_routing_indices(T, ne, TOPK, "cpu", g)
        assert all(len(set(row)) == TOPK for row in expt.tolist())
        meta = make_ragged_tensor_metadata_torch(csum, flat.numel())
        check_routing(flat, cs, rs, csum, meta.slice_offs)
        assert meta.slice_sizes.dtype == torch.int32 and meta.block_offs_data.dtype == torch.int32
    print("routing indices / ragged metadata (torch) consistent for T in (1,3,16,64,300): True")
    # reference helpers vs brute force
    T, ne, Kx, Nx = 7, 9, 64, 96
    qx = torch.randint(0, 256, (ne, Nx, Kx // 2), dtype=torch.uint8, generator=g)
    sx = torch.randint(SCALE_LO, SCALE_HI + 1, (ne, Nx, Kx // 32), dtype=torch.uint8, generator=g)
    expt, flat, cs, rs, csum = make_routing_indices(T, ne, TOPK, "cpu", g)
    x = torch.randn(T, Kx).bfloat16()
    rows = torch.arange(T * TOPK)
    y = ref_gate_up(x, qx, sx, flat, cs, rows)
    brute = torch.stack([x[int(cs[r]) // TOPK].float() @ dequant_expert_lut(qx, sx, int(flat[int(cs[r])])).t()
                         for r in range(T * TOPK)])
    a = torch.randn(T * TOPK, Kx).bfloat16()
    yd = ref_down(a, qx, sx, flat, rs, torch.arange(T))
    bd = torch.stack([sum(a[int(rs[t * TOPK + j])].float() @ dequant_expert_lut(qx, sx, int(expt[t, j])).t()
                          for j in range(TOPK)) for t in range(T)])
    r1, r2 = rel_err(y, brute), rel_err(yd, bd)
    print(f"ref_gate_up vs brute {r1:.2e}; ref_down vs brute {r2:.2e}")
    ok &= r1 < 1e-5 and r2 < 1e-5
    print("CPU SELFTEST", "PASSED" if ok else "FAILED")
    return ok


# --------------------------------------------------------------------------------------
# GPU benchmark
# --------------------------------------------------------------------------------------
def main():
    try:
        import torch
        import triton
        import triton_kernels
        import triton_kernels.matmul_ogs as mo
        from triton_kernels.matmul_ogs import matmul_ogs, PrecisionConfig, FlexCtx, RoutingData, GatherIndx, ScatterIndx
        from triton_kernels.numerics import InFlexData
        from triton_kernels.tensor import make_ragged_tensor_metadata, make_ragged_tensor_metadata_torch
        from triton_kernels.tensor_details import layout
        import triton_kernels.matmul_ogs_details.opt_flags as opt_flags_mod
    except Exception as e:
        fail("import torch/triton/triton_kernels", e)
        return
    if not torch.cuda.is_available():
        print("[FAIL] setup: no CUDA device")
        return
    dev = torch.device("cuda")
    try:
        os.makedirs(OUT_DIR, exist_ok=True)
        open(os.path.join(OUT_DIR, "tk_peer.jsonl"), "w").close()
    except Exception as e:
        fail("truncate jsonl", e)
    props = torch.cuda.get_device_properties(0)
    cap = torch.cuda.get_device_capability()
    info = dict(device=props.name, sms=props.multi_processor_count, cap=f"{cap[0]}.{cap[1]}", torch=torch.__version__,
                triton=triton.__version__, tk=TK_VERSION, tk_path=os.path.dirname(triton_kernels.__file__))
    log("env " + json.dumps(info))
    if cap[0] != 9:
        log(f"WARNING: capability {cap}; layouts/paths below were prepared for sm_90 (Hopper)")
    log("W4A8 (fp8 act x mxfp4): skipped - not supported on sm_90 by this triton_kernels version")

    # record the opt flags matmul_ogs picks (wraps the name bound inside triton_kernels.matmul_ogs)
    last_flags = {}
    try:
        _orig_mof = mo.make_opt_flags

        def _rec_mof(*a, **k):
            f = _orig_mof(*a, **k)
            last_flags["f"] = f
            return f

        mo.make_opt_flags = _rec_mof
    except Exception as e:
        fail("hook opt flags (info only)", e)

    flush_buf = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=dev)

    def timed(fn, target_s=0.15, max_iter=150, min_iter=10):
        """Median us per call, L2 flushed before each call ("cold"), plus warm median.
        Uses a CUDA graph of one call (no host overhead); falls back to eager launches."""
        fn()
        torch.cuda.synchronize()
        mode = "graph"
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            g.replay()
            torch.cuda.synchronize()
            run = g.replay
        except Exception as e:
            fail("cuda graph capture (falling back to eager timing)", e)
            torch.cuda.synchronize()
            mode, run = "eager", fn
        # estimate
        st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        st.record()
        for _ in range(3):
            run()
        en.record()
        torch.cuda.synchronize()
        est_ms = max(st.elapsed_time(en) / 3, 1e-3) + 0.1  # + flush
        n = int(min(max_iter, max(min_iter, target_s * 1e3 / est_ms)))

        def loop(flush):
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
            for a, b in evs:
                if flush:
                    flush_buf.zero_()
                a.record()
                run()
                b.record()
            torch.cuda.synchronize()
            ts = sorted(a.elapsed_time(b) for a, b in evs)
            return ts[len(ts) // 2] * 1e3

        cold = loop(True)
        warm = loop(False)
        return cold, warm, n, mode

    def kernel_breakdown(fn, n=5):
        """Per-kernel device time (us per call, L2 flushed before each call) via torch.profiler."""
        from torch.profiler import profile, ProfilerActivity
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                flush_buf.zero_()
                fn()
            torch.cuda.synchronize()
        out = {}
        for ev in prof.key_averages():
            t = getattr(ev, "self_device_time_total", None)
            if t is None:
                t = getattr(ev, "self_cuda_time_total", 0)
            if t and t > 0 and "FillFunctor" not in ev.key:
                key = ev.key[:60]
                out[key] = round(out.get(key, 0.0) + t / n, 2)
        return out

    # ---- copy ceiling -------------------------------------------------------------------
    copy_tbps = None
    try:
        nbytes = 1 << 30
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize()
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
        for a, b in evs:
            a.record()
            dst.copy_(src)
            b.record()
        torch.cuda.synchronize()
        ms = sorted(a.elapsed_time(b) for a, b in evs)[5]
        copy_tbps = 2 * nbytes / (ms * 1e-3) / 1e12
        log(f"copy 1 GiB D2D: {ms * 1e3:.1f} us -> {copy_tbps:.3f} TB/s (read+write) / {copy_tbps / 2:.3f} TB/s one-way")
        emit(dict(op="copy_1GiB", us=ms * 1e3, tbps_rw=copy_tbps, tbps_oneway=copy_tbps / 2, **info))
        del src, dst
        torch.cuda.empty_cache()
    except Exception as e:
        fail("copy bandwidth", e)

    # ---- weights ------------------------------------------------------------------------
    gen = torch.Generator(device=dev)
    gen.manual_seed(SEED)
    W = {}
    try:
        vl, vopts = layout.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        log(f"value layout: {vl.__name__} {vopts}")
        for name, N, K in (("gate_up", 2 * I, H), ("down", H, I)):
            q = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, device=dev, generator=gen)
            s = torch.randint(SCALE_LO, SCALE_HI + 1, (E, N, K // 32), dtype=torch.uint8, device=dev, generator=gen)
            wt = build_value_tensor(q, vl, vopts)
            torch.cuda.synchronize()
            W[name] = dict(q=q, s=s, w=wt, N=N, K=K, scales={},
                           bytes_per_expert=N * K // 2 + N * K // 32,
                           storage_bytes_per_expert=(wt.storage.data.numel() + s.numel()) / E)
            log(f"{name}: ours q{tuple(q.shape)} s{tuple(s.shape)} -> tk {wt.shape} storage {tuple(wt.storage.data.shape)} "
                f"stride {wt.storage.data.stride()} layout {wt.storage.layout.name}")
        torch.cuda.empty_cache()
    except Exception as e:
        fail("build weights (value layout)", e)
        W = {}

    def scale_for(name, nw):
        d = W[name]
        if nw not in d["scales"]:
            sl, sopts = layout.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=nw)
            d["scales"][nw] = build_scale_tensor(d["s"], sl, sopts)
        return d["scales"][nw]

    # ---- per T --------------------------------------------------------------------------
    for T in T_LIST:
        if not W:
            break
        if time.time() - T0 > BUDGET_S:
            log(f"[SKIP] T={T}: time budget TK_BUDGET_S={BUDGET_S:.0f}s exceeded")
            continue
        try:
            expt, flat, col_sorted, row_sorted, col_sum = make_routing_indices(T, E, TOPK, dev, gen)
            try:
                ragged = make_ragged_tensor_metadata(col_sum, flat.numel())
                rt = make_ragged_tensor_metadata_torch(col_sum, flat.numel())
                same = (torch.equal(ragged.slice_offs, rt.slice_offs) and torch.equal(ragged.block_offs_data, rt.block_offs_data)
                        and torch.equal(ragged.block_schedule_data, rt.block_schedule_data))
                if not same:
                    log(f"WARNING T={T}: triton ragged metadata != torch reference; using torch version")
                    ragged = rt
            except Exception as e:
                fail(f"T={T} ragged metadata (triton kernel; using torch version)", e)
                ragged = make_ragged_tensor_metadata_torch(col_sum, flat.numel())
            check_routing(flat, col_sorted, row_sorted, col_sum, ragged.slice_offs)
            rdata = RoutingData(None, ragged.slice_sizes, E, TOPK, ragged)
            gidx = GatherIndx(src_indx=col_sorted, dst_indx=row_sorted)
            sidx = ScatterIndx(src_indx=row_sorted, dst_indx=col_sorted)
            touched = int(torch.unique(flat).numel())
            x = torch.randn((T, H), device=dev, dtype=torch.bfloat16, generator=gen)
            a = torch.randn((T * TOPK, I), device=dev, dtype=torch.bfloat16, generator=gen)
        except Exception as e:
            fail(f"T={T} routing/inputs", e)
            continue
        if NW_MODE == "both":
            nws = [4, 8]
        elif NW_MODE in ("4", "8"):
            nws = [int(NW_MODE)]
        else:
            nws = [4 if T <= 512 else 8]  # bench/bench_mlp.py rule (batch <= 512 -> 4 warps)

        for op in ("gate_up", "down"):
            d = W[op]
            if NW_MODE == "auto":  # fallbacks only if the default config fails (e.g. shared-memory OOR)
                tried = [(nws[0], {}), (8 if nws[0] == 4 else 4, {}), (nws[0], {"num_stages": 2})]
            else:
                tried = [(nw_, {}) for nw_ in nws]
            done = False
            for nw, cons in tried:
                if done and NW_MODE == "auto":
                    break
                stage = f"T={T} {op} nw={nw}" + (f" constraints={cons}" if cons else "")
                try:
                    opt_flags_mod.reset_opt_flags_constraints()
                    if cons:
                        opt_flags_mod.update_opt_flags_constraints(cons)
                    pc = PrecisionConfig(flex_ctx=FlexCtx(rhs_data=InFlexData()), weight_scale=scale_for(op, nw))
                    if op == "gate_up":
                        fn = lambda: matmul_ogs(x, d["w"], None, rdata, gather_indx=gidx, precision_config=pc)
                    else:
                        fn = lambda: matmul_ogs(a, d["w"], None, rdata, scatter_indx=sidx, precision_config=pc)
                    last_flags.clear()
                    y = fn()
                    torch.cuda.synchronize()
                    f = last_flags.get("f")
                    flags = (dict(block_m=f.block_m, block_n=f.block_n, block_k=f.block_k, num_warps=f.num_warps,
                                  num_stages=f.num_stages, split_k=f.split_k, persistent=f.is_persistent) if f else {})
                    exp_shape = (T * TOPK, d["N"]) if op == "gate_up" else (T, d["N"])
                    assert tuple(y.shape) == exp_shape, f"output shape {tuple(y.shape)} != {exp_shape}"
                    err = None
                    if DO_REF:
                        try:
                            if op == "gate_up":
                                n_rows = T * TOPK
                                rows = (torch.arange(n_rows, device=dev) if n_rows <= 384 else
                                        torch.randperm(n_rows, device=dev, generator=gen)[:256])
                                ref = ref_gate_up(x, d["q"], d["s"], flat, col_sorted, rows)
                                err = rel_err(y[rows], ref)
                            else:
                                toks = (torch.arange(T, device=dev) if T <= 32 else
                                        torch.randperm(T, device=dev, generator=gen)[:32])
                                ref = ref_down(a, d["q"], d["s"], flat, row_sorted, toks)
                                err = rel_err(y[toks], ref)
                            del ref
                        except Exception as e:
                            fail(stage + " reference check", e)
                    del y
                    cold, warm, n, mode = timed(fn)
                    kb, us_kernel = None, None
                    if DO_PROF:
                        try:
                            kb = kernel_breakdown(fn)
                            mm = [v for k_, v in kb.items() if "matmul" in k_]
                            us_kernel = sum(mm) if mm else None
                        except Exception as e:
                            fail(stage + " profiler breakdown (info only)", e)
                    wbytes = touched * d["bytes_per_expert"]
                    tbps = wbytes / (cold * 1e-6) / 1e12
                    flops = 2.0 * T * TOPK * d["N"] * d["K"]
                    row = dict(T=T, op=op, us=cold, us_warm=warm, iters=n, timing=mode, touched_experts=touched,
                               weight_bytes=wbytes, tbps=tbps, copy_share=(tbps / copy_tbps if copy_tbps else None),
                               tflops=flops / (cold * 1e-6) / 1e12, rel_err=err,
                               ok=(err is not None and err < 2e-2), scale_nw=nw, flags=flags, constraints=cons,
                               us_kernel=us_kernel,
                               tbps_kernel=(wbytes / (us_kernel * 1e-6) / 1e12 if us_kernel else None),
                               kernels=kb,
                               N=d["N"], K=d["K"], E=E, topk=TOPK, dtype="bf16 x mxfp4", **info)
                    emit(row)
                    log(f"T={T:5d} {op:7s} nw={nw}: {cold:9.1f} us cold ({warm:9.1f} warm, {mode}, n={n}) "
                        f"experts={touched:3d} {wbytes / 1e6:8.1f} MB {tbps:6.3f} TB/s "
                        f"share={row['copy_share'] if row['copy_share'] is None else round(row['copy_share'], 3)} "
                        f"err={err if err is None else f'{err:.2e}'} flags={flags}")
                    if kb:
                        log(f"        kernels (us/call, cold, profiler): {kb}")
                    done = True
                except Exception as e:
                    fail(stage, e)
                    try:
                        opt_flags_mod.reset_opt_flags_constraints()
                        torch.cuda.synchronize()
                    except Exception as e2:
                        fail(stage + " (device sync after failure)", e2)
        x = a = None  # free before next T


def summary():
    print("\n=== triton_kernels matmul_ogs (" + TK_VERSION + "), bf16 x mxfp4, E={E} top{TOPK} H={H} I={I} ===".format(E=E, TOPK=TOPK, H=H, I=I))
    cp = [r for r in ROWS if r.get("op") == "copy_1GiB"]
    if cp:
        print(f"copy ceiling (1 GiB D2D, read+write): {cp[0]['tbps_rw']:.3f} TB/s on {cp[0]['device']}")
    hdr = (f"{'T':>5} {'op':7} {'us(cold)':>9} {'us(warm)':>9} {'us(kern)':>9} {'experts':>7} {'W MB':>8} {'TB/s':>6} "
           f"{'%copy':>6} {'TB/s(k)':>7} {'TFLOPS':>7} {'rel_err':>8} nw timing")
    print(hdr)
    for r in ROWS:
        if r.get("op") == "copy_1GiB":
            continue
        share = "-" if r["copy_share"] is None else f"{100 * r['copy_share']:.1f}"
        err = "-" if r["rel_err"] is None else f"{r['rel_err']:.1e}"
        uk = "-" if not r.get("us_kernel") else f"{r['us_kernel']:9.1f}"
        tk = "-" if not r.get("tbps_kernel") else f"{r['tbps_kernel']:7.3f}"
        print(f"{r['T']:>5} {r['op']:7} {r['us']:9.1f} {r['us_warm']:9.1f} {uk:>9} {r['touched_experts']:7d} "
              f"{r['weight_bytes'] / 1e6:8.1f} {r['tbps']:6.3f} {share:>6} {tk:>7} {r['tflops']:7.1f} {err:>8} {r['scale_nw']:>2} {r['timing']}")
    print(f"rows -> {os.path.join(OUT_DIR, 'tk_peer.jsonl')}; W MB = touched experts x (packed e2m1 + e8m0 scales); "
          f"%copy = weight-read TB/s / copy (read+write) TB/s; us(cold/warm) = whole matmul_ogs call in a CUDA graph "
          f"(incl. its index-div / reduce kernels), median, L2 flushed (cold) or not (warm); us(kern) = _matmul_ogs kernel "
          f"only (profiler, cold); total {time.time() - T0:.1f}s")
    if ERRLOG:
        try:
            p = os.path.join(OUT_DIR, "tk_peer_errors.log")
            with open(p, "w") as f:
                f.write("\n".join(ERRLOG))
            print(f"{len(ERRLOG)} failure(s); tracebacks in {p}")
        except Exception:
            pass


if __name__ == "__main__":
    if "--cpu-selftest" in sys.argv:
        try:
            cpu_selftest()
        except Exception as e:
            fail("cpu selftest", e)
            print(ERRLOG[-1])
        sys.exit(0)
    try:
        main()
    except Exception as e:
        fail("main", e)
    try:
        summary()
    except Exception as e:
        fail("summary", e)
    sys.exit(0)
