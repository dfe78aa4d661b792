"""`deepinfer-bench kernels`: one row per (op, shape, numerics, backend) -- time, achieved bandwidth and FLOP rate,
their share of the ceilings measured in the same run, the torch reference's time and the kernel's error against
it on the same fresh random inputs (docs/bench.md "Kernel rows").

Ops and what a row counts:
  experts      kernels.experts.grouped_experts at a model's released expert shapes over `tokens` tokens routed
               top-k uniformly at random (seeded): bytes = the touched experts' stored weights + scales, the rows in
               (x), the SwiGLU output written and read back (h) and the fp32 output; FLOPs = 6 * rows * D * I.
               Storage fp4 / fp8 / bf16, numerics a16 (activations in bf16) / a8 (FP8 per 1x128).
  fp8_linear   kernels.fp8_linear.fp8_linear (W8A8) at a model's FP8 projection shapes and blocks (V4: 128x128
               weights, 1x128 activations; V4.1: 32x32, 1x32): bytes = weights + scales + x + y; next to cuBLAS
               bf16 (F.linear) and torch._scaled_mm (per-tensor scales) at the same shape.
  attention    kernels.attention sparse_sink_attention over a 64-head x 512 latent (V4 / V4.1 flash): layer kinds
               swa (the 128-key window), csa (window + 512 selected entries) and hca (window + every ratio-128
               entry of the context), `tokens` query rows at each of `contexts`: bytes = the keys each row reads
               (rows x keys x 512 x 2) + q + out, FLOPs = 4 * rows * 64 * keys * 512. Decode-sized rows (<= 256)
               read each its own sequence's store (no cache sharing between rows); more rows share one sequence's
               store (a prefill chunk).
Ceilings (harness/ceilings.py): device copy bandwidth (read+write), torch bf16 GEMM peak, torch._scaled_mm FP8
peak. A row's `bandwidth_share` = bytes / time / copy bandwidth; `peak_share` = FLOP/s / the peak of its numerics
(bf16 for a16 and bf16 weights, fp8 for a8 and fp8_linear)."""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from deepinfer.errors import DeepInferError
from deepinfer.validate import check_device

from .ceilings import time_calls, measure_ceilings
from .options import check_distinct
from .bench import RunFolder, json_text
from .rows import environment, identity, read_rows, run_dir_guard, utc_now

KERNEL_METHOD_VERSION = "1"
MODEL_SHAPES = {   # experts: (E, D, I, top_k); linears: name -> (N, K) of its FP8 projections
    "v4": {"experts": (256, 4096, 2048, 6), "hc": 4,
           "linears": {"q_a": (1024, 4096), "q_b": (32768, 1024), "kv": (512, 4096), "o_b": (4096, 8192),
                       "shared_w13": (2048, 4096), "shared_w2": (4096, 2048)}},
    "v41": {"experts": (384, 5120, 2304, 6), "hc": 4,
            "linears": {"q_a": (1280, 5120), "q_b": (32768, 1280), "kv": (512, 5120), "o_b": (5120, 8192),
                        "shared_w13": (2304, 5120), "shared_w2": (5120, 2304)}},
}
OPS = ("experts", "fp8_linear", "attention", "mhc", "route")
FP8_BLOCK = {"v4": 128, "v41": 32}      # the release's FP8 weight blocks (activations per 1 x block)
# layer kind -> (compress ratio of its entries, entries selected per row; None: none / every visible one)
ATTENTION_KINDS = {"swa": (None, None), "csa": (4, 512), "hca": (128, None)}
STORAGE = ("fp4", "fp8", "bf16")
NUMERICS = ("a16", "a8")
BACKENDS = ("triton", "triton_invariant", "reference")


@dataclass
class KernelConfig:
    device: str = "cuda"
    ops: tuple[str, ...] = OPS
    models: tuple[str, ...] = ("v41", "v4")
    tokens: tuple[int, ...] = (1, 16, 64, 256, 8192)
    contexts: tuple[int, ...] = (8192, 32768, 131072)     # attention rows: the context behind each query row
    storage: tuple[str, ...] = ("fp4", "fp8", "bf16")
    numerics: tuple[str, ...] = NUMERICS
    backends: tuple[str, ...] = ("triton", "triton_invariant")
    iters: int = 20
    warmup: int = 3
    seed: int = 0
    check_reference: bool = True      # also time the reference backend and measure the error against it
    experts_limit: int | None = None  # build only this many experts (a smaller run on small devices / CPU)
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        for name, values, allowed in (("--op", self.ops, OPS), ("--model", self.models, tuple(MODEL_SHAPES)),
                                      ("--storage", self.storage, STORAGE), ("--numerics", self.numerics, NUMERICS),
                                      ("--backend", self.backends, BACKENDS)):
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise DeepInferError(f"{name} {','.join(bad) or '(empty)'}: use one or more of {', '.join(allowed)}")
            check_distinct(name, values)
        if any(c < 1 for c in self.contexts) or not self.contexts:
            raise DeepInferError("--contexts: positive integers, comma-separated (e.g. 8192,32768,131072)")
        if any(t < 1 for t in self.tokens) or not self.tokens:
            raise DeepInferError("--tokens: positive integers, comma-separated (e.g. 1,16,64,256,8192)")
        check_distinct("--contexts", self.contexts)
        check_distinct("--tokens", self.tokens)
        if self.iters < 1 or self.warmup < 0:
            raise DeepInferError("--iters must be >= 1 and --warmup >= 0")
        triton_sets = [b for b in self.backends if b.startswith("triton")]
        if triton_sets and not self.device.startswith("cuda"):
            raise DeepInferError(f"--backend {','.join(triton_sets)} runs Triton kernels on CUDA only; on "
                                 f"{self.device} use --backend reference")

    def to_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------------------------- expert cases

def random_expert_weights(storage: str, n_experts: int, dim: int, inter: int, act_fp8: bool, device, gen):
    """Released-shape routed experts with random weights as stored: fp4 codes anywhere with e8m0 scales
    2^-9..2^-6 (bytes 118..121), fp8 e4m3 of N(0, 1) with fp32 block scales ~0.003, bf16 N(0, 0.02)."""
    from deepinfer.kernels.experts import ExpertWeights
    shapes = ((inter, dim), (dim, inter), (inter, dim))
    ws, ss = [], []
    for r, c in shapes:
        if storage == "fp4":
            ws.append(torch.randint(0, 256, (n_experts, r, c // 2), device=device, dtype=torch.uint8, generator=gen))
            ss.append(torch.randint(118, 122, (n_experts, r, c // 32), device=device, dtype=torch.uint8,
                                    generator=gen))
        elif storage == "fp8":
            w = torch.randn(n_experts, r, c, device=device, generator=gen, dtype=torch.bfloat16)
            ws.append(w.to(torch.float8_e4m3fn))
            del w
            ss.append(0.002 + 0.002 * torch.rand(n_experts, -(-r // 128), -(-c // 128), device=device,
                                                  generator=gen))
        else:
            ws.append(torch.randn(n_experts, r, c, device=device, generator=gen, dtype=torch.bfloat16) * 0.02)
    return ExpertWeights(*ws, dtype=torch.bfloat16, limit=10.0, scales=tuple(ss) if ss else None,
                         act_fp8=act_fp8)


def routed_batch(tokens: int, n_experts: int, dim: int, top_k: int, device, gen):
    """`tokens` rows routed to top_k distinct experts uniformly at random, dispatched: (x sorted [M, D] bf16,
    expert_ids [M], offsets [E+1], route weights [M] fp32, experts touched)."""
    from deepinfer.parallel.dispatch import LocalDispatch
    scores = torch.rand(tokens, n_experts, device=device, generator=gen)
    ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, device=device, generator=gen)
    x = torch.randn(tokens, dim, device=device, generator=gen, dtype=torch.bfloat16)
    d = LocalDispatch(n_experts).dispatch(x, weights, ids)
    touched = int(torch.unique(ids).numel())
    return d.x, d.expert_ids, d.offsets, d.weights.float(), touched


def expert_traffic(ew, rows: int, touched: int) -> tuple[int, int]:
    """(bytes the op must move, FLOPs): touched experts' stored bytes + x in + h out and in + y out (fp32)."""
    act = rows * ew.dim * 2 + 2 * rows * ew.inter * 2 + rows * ew.dim * 4
    return touched * ew.stored_bytes_per_expert() + act, 6 * rows * ew.dim * ew.inter


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


TIMING = {}   # how the last _time call timed: "graph, cold L2" (see _time) or "eager"
GRAPH_CALLS = 8          # calls of the op per captured graph: a replay's own launch cost spread over them
FLUSH_BYTES = 128 << 20  # zeroed before every call: more than the L2 (50 MB on H100/H200), so weights come from HBM


def _time(fn, device, warmup: int, iters: int) -> float:
    """Median seconds of one fn(), its inputs not in L2. On CUDA: GRAPH_CALLS x (zero FLUSH_BYTES, fn) captured in
    one CUDA graph and GRAPH_CALLS x (zero FLUSH_BYTES) in another, both replayed; one call = (first - second) /
    GRAPH_CALLS, so neither the graph launch nor the flush counts and a decode GEMM reads its weights from HBM as
    it does inside a step (back-to-back replays of one call would find them in L2). A fn that cannot be captured
    (a host sync) is timed eagerly, one call at a time, without the flush. TIMING says which."""
    device = torch.device(device)
    if device.type == "cuda":
        flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
        try:
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream(device).wait_stream(side)
            both, flushes = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(both):
                for _ in range(GRAPH_CALLS):
                    flush.zero_()
                    fn()
            with torch.cuda.graph(flushes):
                for _ in range(GRAPH_CALLS):
                    flush.zero_()
        except RuntimeError:
            torch.cuda.synchronize(device)
        else:
            with_fn = time_calls(both.replay, device, warmup, iters)
            alone = time_calls(flushes.replay, device, warmup, iters)
            if with_fn > alone:
                TIMING["last"] = "graph, cold L2"
                return (with_fn - alone) / GRAPH_CALLS
            TIMING["last"] = "eager (the cold-L2 difference was below the replays' noise)"
            return time_calls(fn, device, warmup, iters)
    TIMING["last"] = "eager"
    return time_calls(fn, device, warmup, iters)


def expert_rows(cfg: KernelConfig, ceilings: dict, done: set[str], emit, echo) -> None:
    """Every experts row of cfg not in `done`: one weight build per (model, storage), every numerics / tokens /
    backend over it."""
    import dataclasses

    from deepinfer.kernels import experts_triton
    from deepinfer.kernels.experts import grouped_experts
    from deepinfer.kernels.table import use
    device = cfg.device
    for model in cfg.models:
        e_all, dim, inter, top_k = MODEL_SHAPES[model]["experts"]
        n_experts = min(e_all, cfg.experts_limit or e_all)
        for storage in cfg.storage:
            numerics = [n for n in cfg.numerics if not (storage == "bf16" and n == "a8")]
            keys = {f"experts/{model}/{storage}/{n}/t{t}/{b}" for n in numerics for t in cfg.tokens
                    for b in cfg.backends}
            ogs_sets = [b for b in cfg.backends if b.startswith("triton")] \
                if storage == "fp4" and "a16" in numerics and _ogs_runs(device) else []
            keys |= {f"experts/{model}/fp4/a16/t{t}/{b}/hopper_mx" for t in cfg.tokens for b in ogs_sets}
            if keys <= done:
                continue
            gen = torch.Generator(device=device).manual_seed(cfg.seed)
            base = random_expert_weights(storage, n_experts, dim, inter, False, device, gen)
            hopper = _hopper_copy(base) if ogs_sets else None      # converted once, timed at every token count
            for tokens in cfg.tokens:
                x, ids, offs, r, touched = routed_batch(tokens, n_experts, dim, top_k, device, gen)
                a16_out = None
                for num in numerics:
                    ew = dataclasses.replace(base, act_fp8=num == "a8")
                    nbytes, flops = expert_traffic(ew, x.shape[0], touched)
                    ref_ms = ref_out = ref_timing = None
                    if cfg.check_reference:
                        with use("reference"):
                            ref_out = grouped_experts(x, ids, offs, r, ew)
                            ref_ms = 1e3 * _time(lambda: grouped_experts(x, ids, offs, r, ew), device,
                                                 1, max(1, min(cfg.iters, 5)))
                            ref_timing = TIMING["last"]
                    times = {}
                    variants = [(b, "rows", ew) for b in cfg.backends] + \
                        [(b, "hopper_mx", hopper) for b in ogs_sets if hopper is not None and num == "a16"]
                    for backend, layout, ew in variants:
                        key = f"experts/{model}/{storage}/{num}/t{tokens}/{backend}" + \
                            ("" if layout == "rows" else f"/{layout}")
                        with use(backend):
                            out = grouped_experts(x, ids, offs, r, ew)
                            ms = 1e3 * _time(lambda: grouped_experts(x, ids, offs, r, ew), device, cfg.warmup,
                                             cfg.iters)
                            timing = TIMING["last"]
                        times.setdefault(layout, {})[backend] = ms
                        if num == "a16" and backend == cfg.backends[0] and layout == "rows":
                            a16_out = out
                        peak = ceilings["fp8_flops_per_s"] if num == "a8" else ceilings["gemm_bf16_flops_per_s"]
                        ran = ("matmul_ogs" if layout != "rows" else "kernel"
                               if backend.startswith("triton") and experts_triton.supported(x, ew) else "reference")
                        row = {"key": key, "op": "experts", "model_shapes": model, "storage": storage, "ran": ran,
                               "weight_layout": layout, "over_rows": (ms / times["rows"][backend]
                                                                      if layout != "rows" else None),
                               "numerics": num, "backend": backend, "tokens": tokens, "rows": x.shape[0],
                               "experts": n_experts, "experts_touched": touched, "dim": dim, "inter": inter,
                               "top_k": top_k, **_rates(ms, nbytes, flops, ceilings, peak),
                               "timing": timing, "reference_timing": ref_timing if ref_ms is not None else None,
                               **_against(ms, backend, times[layout], out, ref_ms, ref_out),
                               "err_vs_a16": (None if num != "a8" or a16_out is None else _rel_err(out, a16_out))}
                        if key not in done:
                            emit(row)
                        echo(f"  {key}: {ms:.3f} ms, {row['bandwidth_share']:.0%} of copy BW, "
                             f"{(row['peak_share'] or 0):.0%} of peak, err {row['err_vs_reference']}")
            del base, hopper
            if device.startswith("cuda"):
                torch.cuda.empty_cache()


def _ogs_runs(device) -> bool:
    """Whether triton_kernels' matmul_ogs can run FP4 experts on this device (sm_90, installed)."""
    if not str(device).startswith("cuda"):
        return False
    from deepinfer.kernels import experts_ogs as ogs
    return ogs.runs_on(device)


def _hopper_copy(ew):
    """ew in the Hopper layout matmul_ogs reads (what an engine on sm_90 runs; its rows carry `over_rows`, its time
    over ours on the same inputs), None where the weights cannot take it."""
    from deepinfer.kernels import experts_ogs as ogs
    return ogs.hopper_copy(ew) if ogs.fits(ew) else None


def _against(ms: float, backend: str, times: dict, out, ref_ms: float | None, ref_out) -> dict:
    """The fields every row sets side by side: the reference's time and the error against it, and for an
    invariant row its time over the default set's on the same inputs."""
    return {"reference_ms": ref_ms, "vs_reference": None if ref_ms is None else ref_ms / ms,
            "err_vs_reference": None if ref_out is None else _rel_err(out, ref_out),
            "invariant_over_default": (ms / times["triton"] if backend == "triton_invariant" and "triton" in times
                                       else None)}


def _rates(ms: float, nbytes: int, flops: int, ceilings: dict, peak: float | None) -> dict:
    s = ms / 1e3
    return {"time_ms": ms, "bytes": nbytes, "flops": flops, "tb_per_s": nbytes / s / 1e12,
            "tflop_per_s": flops / s / 1e12, "bandwidth_share": nbytes / s / ceilings["copy_bytes_per_s"],
            "peak_share": None if not peak else flops / s / peak,
            "memory_bound_ms": 1e3 * nbytes / ceilings["copy_bytes_per_s"],
            "compute_bound_ms": None if not peak else 1e3 * flops / peak}


# ----------------------------------------------------------------------------------------------- fp8 linear cases

def fp8_linear_rows(cfg: KernelConfig, ceilings: dict, done: set[str], emit, echo) -> None:
    from deepinfer.kernels import fp8_linear as fl
    from deepinfer.kernels.quant import quantize_fp8_blocks
    from deepinfer.kernels.table import use
    import torch.nn.functional as F
    device = cfg.device
    for model in cfg.models:
        block = FP8_BLOCK[model]
        for name, (n, k) in MODEL_SHAPES[model]["linears"].items():
            gen = torch.Generator(device=device).manual_seed(cfg.seed)
            w = torch.randn(n, k, device=device, generator=gen) * 0.02
            w8, ws = quantize_fp8_blocks(w, (block, block), "ue8m0")
            wb = w.to(torch.bfloat16)
            del w
            for tokens in cfg.tokens:
                x = torch.randn(tokens, k, device=device, generator=gen, dtype=torch.bfloat16)
                nbytes = w8.numel() + ws.numel() * ws.element_size() + x.numel() * 2 + tokens * n * 2
                flops = 2 * tokens * n * k
                cublas_ms = 1e3 * _time(lambda: F.linear(x, wb), device, cfg.warmup, cfg.iters)
                scaled_ms = _scaled_mm_ms(x, w8, device, cfg)
                ref_out = ref_ms = None
                if cfg.check_reference:
                    with use("reference"):
                        ref_out = fl.fp8_linear(x, w8, ws, block=block)
                        ref_ms = 1e3 * _time(lambda: fl.fp8_linear(x, w8, ws, block=block), device, 1,
                                             max(1, min(cfg.iters, 5)))
                times = {}
                for backend in cfg.backends:
                    key = f"fp8_linear/{model}/{name}/b{block}/t{tokens}/{backend}"
                    fn = lambda: fl.fp8_linear(x, w8, ws, block=block)  # noqa: E731
                    with use(backend):
                        out = fn()
                        ms = 1e3 * _time(fn, device, cfg.warmup, cfg.iters)
                        timing = TIMING["last"]
                    times[backend] = ms
                    row = {"key": key, "op": "fp8_linear", "model_shapes": model, "linear": name, "n": n, "k": k,
                           "block": block,
                           "storage": "fp8", "numerics": "a8", "backend": backend, "tokens": tokens,
                           **_rates(ms, nbytes, flops, ceilings, ceilings["fp8_flops_per_s"]),
                           "weight_bandwidth_share": (w8.numel() + ws.numel() * ws.element_size()) / (ms / 1e3)
                           / ceilings["copy_bytes_per_s"],
                           "timing": timing, "cublas_bf16_ms": cublas_ms, "scaled_mm_ms": scaled_ms,
                           "vs_scaled_mm": None if scaled_ms is None else scaled_ms / ms,
                           **_against(ms, backend, times, out, ref_ms, ref_out)}
                    if key not in done:
                        emit(row)
                    echo(f"  {key}: {ms:.4f} ms, weights {row['weight_bandwidth_share']:.0%} of copy BW, "
                         f"_scaled_mm {scaled_ms} ms, err {row['err_vs_reference']}")


def _scaled_mm_ms(x, w8, device, cfg) -> float | None:
    """torch._scaled_mm (per-tensor unit scales) at this shape: cuBLAS's FP8 GEMM, None off CUDA."""
    if not str(device).startswith("cuda") or not hasattr(torch, "_scaled_mm"):
        return None
    m = x.shape[0]
    pad = -m % 16
    x8 = torch.nn.functional.pad(x, (0, 0, 0, pad)).to(torch.float8_e4m3fn)
    one = torch.ones((), device=x.device)
    try:
        return 1e3 * _time(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                           device, cfg.warmup, cfg.iters)
    except RuntimeError:
        return None


# ------------------------------------------------------------------------------------------------ attention cases

def attention_inputs(kind: str, rows: int, context: int, device, gen, heads: int = 64, dim: int = 512):
    """(q [rows, H, d] bf16, sources, sink [H] fp32, keys per row) for one layer kind at `context` tokens. Window:
    the 128 positions before each row; csa: 512 distinct entries of context/4 (V4's ratio; V4.1's ratio 2 reads
    as many), hca: every one of context/128. Rows <= 256: one store per row; more: one shared store."""
    own = rows <= 256
    copies = rows if own else 1
    # the window: each sequence's last 128 positions (decode rows), or one sequence's whole context (a chunk)
    span = 128 if own else context
    window = torch.randn(copies * span, dim, device=device, generator=gen, dtype=torch.bfloat16)
    if own:
        win_index = (torch.arange(rows, device=device) * span).view(-1, 1) + torch.arange(128, device=device)
    else:
        pos = context - 1 - torch.arange(rows, device=device) % context
        win_index = (pos.view(-1, 1) - torch.arange(128, device=device)).clamp(min=0)
    sources = [(window, win_index)]
    ratio, picked = ATTENTION_KINDS[kind]
    if ratio is not None:
        entries = max(1, context // ratio)
        store = torch.randn(copies * entries, dim, device=device, generator=gen, dtype=torch.bfloat16)
        ebase = (torch.arange(rows, device=device) * entries if own
                 else torch.zeros(rows, device=device, dtype=torch.long)).view(-1, 1)
        if picked is None:
            index = ebase + torch.arange(entries, device=device).view(1, -1)
        else:
            k = min(picked, entries)
            index = ebase + torch.rand(rows, entries, device=device, generator=gen).topk(k, dim=-1).indices
        sources.append((store, index))
    q = torch.randn(rows, heads, dim, device=device, generator=gen, dtype=torch.bfloat16)
    sink = torch.randn(heads, device=device, generator=gen)
    return q, sources, sink, sum(i.shape[1] for _, i in sources)


def attention_rows(cfg: KernelConfig, ceilings: dict, done: set[str], emit, echo) -> None:
    from deepinfer.kernels import attention_triton as kat
    from deepinfer.kernels import registry
    impls = {b: implementation("sparse_sink_attention", b) for b in ("reference", *cfg.backends)}
    device, heads, dim = cfg.device, 64, 512
    for kind in ATTENTION_KINDS:
        for context in cfg.contexts:
            for tokens in cfg.tokens:
                keys = {f"attention/{kind}/c{context}/t{tokens}/{b}" for b in cfg.backends}
                if keys <= done:
                    continue
                gen = torch.Generator(device=device).manual_seed(cfg.seed)
                q, sources, sink, k = attention_inputs(kind, tokens, context, device, gen, heads, dim)
                nbytes = tokens * k * dim * 2 + 2 * q.numel() * 2
                flops = 4 * tokens * heads * k * dim
                scale = dim ** -0.5
                ref_out = ref_ms = None
                if cfg.check_reference and tokens * k <= 256 * 4096:
                    ref_out = impls["reference"](q, sources, sink, scale)
                    ref_ms = 1e3 * _time(lambda: impls["reference"](q, sources, sink, scale), device, 1,
                                         max(1, min(cfg.iters, 5)))
                times = {}
                for backend in cfg.backends:
                    key = f"attention/{kind}/c{context}/t{tokens}/{backend}"
                    fn = impls[backend]
                    out = fn(q, sources, sink, scale)
                    ms = 1e3 * _time(lambda: fn(q, sources, sink, scale), device, cfg.warmup, cfg.iters)
                    times[backend] = ms
                    row = {"key": key, "op": "attention", "kind": kind, "context": context, "tokens": tokens,
                           "keys_per_row": k, "heads": heads, "dim": dim, "backend": backend,
                           "ran": "kernel" if backend != "reference" and kat.supported(q, sources) else "reference",
                           "in_backend_sets": "triton" in registry.OPS["sparse_sink_attention"],
                           **_rates(ms, nbytes, flops, ceilings, ceilings["gemm_bf16_flops_per_s"]),
                           "timing": TIMING["last"], **_against(ms, backend, times, out, ref_ms, ref_out)}
                    if key not in done:
                        emit(row)
                    echo(f"  {key}: {ms:.4f} ms, {row['bandwidth_share']:.0%} of copy BW, "
                         f"{(row['peak_share'] or 0):.0%} of bf16 peak, err {row['err_vs_reference']}")
                del q, sources
                if device.startswith("cuda"):
                    torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------- mHC mixes and route

def _row_op_rows(op: str, cfg: KernelConfig, ceilings: dict, done: set[str], emit, echo, impls: dict, build,
                 traffic) -> None:
    """One row per (model, tokens, backend) of a row-wise op: build(model, tokens, gen) -> args; traffic(model,
    tokens) -> (bytes, flops). The reference is timed beside each (error against it in every row)."""
    device = cfg.device
    for model in cfg.models:
        for tokens in cfg.tokens:
            keys = {f"{op}/{model}/t{tokens}/{b}" for b in cfg.backends}
            if keys <= done:
                continue
            gen = torch.Generator(device=device).manual_seed(cfg.seed)
            args = build(model, tokens, gen)
            nbytes, flops = traffic(model, tokens)
            ref_out = ref_ms = None
            if cfg.check_reference:
                ref_out = impls["reference"](*args)
                ref_ms = 1e3 * _time(lambda: impls["reference"](*args), device, 1, max(1, min(cfg.iters, 5)))
            times = {}
            for backend in cfg.backends:
                key = f"{op}/{model}/t{tokens}/{backend}"
                fn = impls[backend]
                out = fn(*args)
                ms = 1e3 * _time(lambda: fn(*args), device, cfg.warmup, cfg.iters)
                times[backend] = ms
                row = {"key": key, "op": op, "model": model, "tokens": tokens, "backend": backend,
                       **_rates(ms, nbytes, flops, ceilings, None), "timing": TIMING["last"],
                       **_against(ms, backend, times, out[0], ref_ms, None if ref_out is None else ref_out[0])}
                if key not in done:
                    emit(row)
                echo(f"  {key}: {ms:.4f} ms, {row['bandwidth_share']:.0%} of copy BW, err {row['err_vs_reference']}")


def mhc_rows(cfg: KernelConfig, ceilings: dict, done: set[str], emit, echo) -> None:
    """hc_mixes at the released widths (hc x hidden, bf16 streams, fp32 fn [24, hc * D]): the `triton` set takes
    the cuBLAS projection from mhc_triton.GEMM_ROWS rows, `triton_invariant` always the chunk kernel."""
    impls = {b: implementation("hc_mixes", b) for b in ("reference", *cfg.backends)}

    def build(model, tokens, gen):
        hc, d = MODEL_SHAPES[model]["hc"], MODEL_SHAPES[model]["experts"][1]
        streams = torch.randn(tokens, hc, d, device=cfg.device, generator=gen).to(_dtype(cfg))
        fn = torch.randn((2 + hc) * hc, hc * d, device=cfg.device, generator=gen) * (hc * d) ** -0.5
        base = torch.randn((2 + hc) * hc, device=cfg.device, generator=gen) * 0.3
        scale = torch.randn(3, device=cfg.device, generator=gen) * 0.3 + 1.0
        return streams, fn, base, scale, 1e-6, 1e-6, 20

    def traffic(model, tokens):
        hc, d = MODEL_SHAPES[model]["hc"], MODEL_SHAPES[model]["experts"][1]
        return tokens * hc * d * 2 + (2 + hc) * hc * hc * d * 4, 2 * tokens * hc * d * (2 + hc) * hc
    _row_op_rows("mhc", cfg, ceilings, done, emit, echo, impls, build, traffic)


def route_rows(cfg: KernelConfig, ceilings: dict, done: set[str], emit, echo) -> None:
    """route (scores sqrt(softplus), bias, top-6) at the released router widths: the `triton` set's logits on
    cuBLAS from routing.ROUTE_GEMM_ROWS rows, `triton_invariant` always the chunk kernel."""
    kw = dict(top_k=6, score_func="sqrtsoftplus", route_scale=1.5, temp=1.0, normalize=True)
    impls = {b: functools.partial(implementation("route", b), **kw) for b in ("reference", *cfg.backends)}

    def build(model, tokens, gen):
        e, d = MODEL_SHAPES[model]["experts"][:2]
        return (torch.randn(tokens, d, device=cfg.device, generator=gen).to(_dtype(cfg)),
                torch.randn(e, d, device=cfg.device, generator=gen).to(_dtype(cfg)) * d ** -0.5,
                torch.randn(e, device=cfg.device, generator=gen) * 0.1)

    def traffic(model, tokens):
        e, d = MODEL_SHAPES[model]["experts"][:2]
        return (tokens + e) * d * 2, 2 * tokens * d * e
    _row_op_rows("route", cfg, ceilings, done, emit, echo, impls, build, traffic)


def implementation(op: str, backend: str):
    """The function the kernel table of backend set `backend` runs for `op` (its fallback's where the set has
    none of its own): the bench times what the engine would run."""
    from deepinfer.kernels.table import KernelTable
    return KernelTable(backend).fns[op]


def _dtype(cfg: KernelConfig) -> torch.dtype:
    return torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32


# ---------------------------------------------------------------------------------------------------- the run

CASES = {"experts": expert_rows, "fp8_linear": fp8_linear_rows, "attention": attention_rows, "mhc": mhc_rows,
         "route": route_rows}


def run_kernel_bench(cfg: KernelConfig, run_dir: Path, resume: bool = False, echo=None) -> list[dict]:
    """Every row of cfg not yet in run_dir (rows.jsonl, appended as each finishes); returns all rows there."""
    echo = echo or (lambda s: None)
    check_device(cfg.device)
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise DeepInferError("deepinfer-bench kernels --device cuda: no CUDA device here; use --device cpu for "
                             "the reference backend only")
    folder = RunFolder(run_dir, "kernels.json", resume)
    done = folder.check(bench="kernel")
    echo(f"ceilings on {cfg.device} ...")
    ceilings = measure_ceilings(cfg.device, torch.bfloat16 if cfg.device.startswith("cuda") else torch.float32)
    echo(f"  copy {ceilings['copy_bytes_per_s'] / 1e12:.3f} TB/s, bf16 "
         f"{(ceilings['gemm_bf16_flops_per_s'] or 0) / 1e12:.0f} TFLOP/s, fp8 "
         f"{(ceilings['fp8_flops_per_s'] or 0) / 1e12:.0f} TFLOP/s")
    env = environment()
    with run_dir_guard(run_dir):
        store = folder.open(json_text(cfg.to_dict()), env)
        ident = identity(env, KERNEL_METHOD_VERSION, bench="kernels", run_id=run_dir.name, device=cfg.device,
                         seed=cfg.seed, iters=cfg.iters, warmup=cfg.warmup, ceilings=ceilings, is_projected=False)

        def emit(row: dict) -> None:
            store.append({**ident, **row, "status": "ok", "finished": utc_now()})

        with torch.inference_mode():
            for op in cfg.ops:
                CASES[op](cfg, ceilings, done, emit, echo)
    return read_rows(run_dir)


def table(rows: list[dict]) -> list[str]:
    head = f"{'row':<46} {'ms':>9} {'TB/s':>6} {'BW%':>5} {'TF/s':>6} {'peak%':>6} {'xref':>6} {'err':>8}"
    lines = [head]
    for r in rows:
        if r.get("status") != "ok":
            continue
        err = r.get("err_vs_reference")
        lines.append(f"{r['key']:<46} {r['time_ms']:>9.4f} {r['tb_per_s']:>6.2f} {100 * r['bandwidth_share']:>4.0f}% "
                     f"{r['tflop_per_s']:>6.0f} {100 * (r['peak_share'] or 0):>5.0f}% "
                     f"{(r.get('vs_reference') or 0):>6.1f} {'-' if err is None else f'{err:.1e}':>8}")
    return lines
