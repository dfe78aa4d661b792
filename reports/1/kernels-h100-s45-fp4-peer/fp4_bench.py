"""FP4 A16 expert GEMM variants (fp4_swap.py beside this file) against the repo kernel (experts_triton DECODE) at V4.1-Flash
expert shapes (E 384, H 5120, I 2304, top-6 uniform routing): time per MoE (gate_up + down, CUDA-graph replays),
bytes of the touched experts over that time, its share of a device copy's bandwidth measured in the same run,
and each variant's max error against the repo kernel. Rows as JSON lines in $OUT/fp4_variants.jsonl."""
import json, os, sys, traceback
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp4_swap as fs
from deepinfer.kernels import experts as kx
from deepinfer.kernels import experts_triton as kt
from deepinfer.kernels.experts import ExpertWeights

DRY = os.environ.get("DRY") == "1"        # CPU dry run of the script under TRITON_INTERPRET=1 (tiny shapes)
E, H, I, TOPK = (8, 256, 128, 2) if DRY else (384, 5120, 2304, 6)
DT = torch.float32 if DRY else torch.bfloat16
TOKENS = [int(t) for t in os.environ.get("TOKENS", "1,16,64,256").split(",")]
dev = torch.device("cpu" if DRY else "cuda")
g = torch.Generator(device=dev).manual_seed(0)
pk = lambda r, c: torch.randint(0, 256, (E, r, c // 2), device=dev, dtype=torch.uint8, generator=g)   # noqa: E731
sc = lambda r, c: torch.randint(125, 129, (E, r, c // 32), device=dev, dtype=torch.uint8, generator=g)  # noqa: E731
ew = ExpertWeights(pk(I, H), pk(H, I), pk(I, H), dtype=DT, limit=10.0,
                   scales=(sc(I, H), sc(H, I), sc(I, H)))
PER_EXPERT = 3 * I * H // 2 + 3 * I * H // 32           # packed bytes + e8m0 bytes of one expert's three matrices


def timed(fn, reps=10, graphs=3):
    """Median ms of one fn() from CUDA-graph replays of `reps` calls."""
    if DRY:
        fn()
        return 1.0
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    out = []
    for _ in range(graphs + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); graph.replay(); b.record(); torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / reps)
    return sorted(out[1:])[len(out[1:]) // 2]


def copy_tbps():
    a = torch.empty(1 << 20 if DRY else 2 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = timed(lambda: b.copy_(a), reps=5)
    return 2 * a.numel() / ms / 1e9            # read + write, TB/s


VARIANTS = [("repo DECODE", None)] + [
    (f"{k} lut={int(l)} bc={int(b)} pf={int(p)} BN={bn} w={w}", dict(kind=k, lut=l, bcast=b, prefetch=p, bn=bn, warps=w))
    for k, l, b, p, bn, w in [("cur", True, True, False, 64, 4), ("cur", True, True, True, 64, 4),
                              ("swap", False, False, False, 64, 4), ("swap", False, False, True, 64, 4),
                              ("swap", False, False, True, 128, 4), ("swap", True, False, True, 64, 4),
                              ("split", False, False, True, 64, 4), ("cur", True, True, True, 128, 8)]]

if os.environ.get("ONLY"):
    VARIANTS = [v for v in VARIANTS if v[0] == os.environ["ONLY"]]
ceiling = copy_tbps()
print(f"device copy: {ceiling:.2f} TB/s (read + write)", flush=True)
rows, out_path = [], os.path.join(os.environ.get("OUT", "."), "fp4_variants.jsonl")
for t in TOKENS:
    ids = torch.rand(t, E, device=dev, generator=g).topk(TOPK, dim=1).indices.flatten().sort().values
    offsets = torch.searchsorted(ids, torch.arange(E + 1, device=dev))
    x = torch.randn(ids.shape[0], H, device=dev, generator=g).to(DT)
    r = torch.rand(ids.shape[0], device=dev, generator=g)
    touched = int(torch.unique(ids).numel())
    gbytes = touched * PER_EXPERT / 1e9
    base = kt.run(x, offsets, r, ew, kt.DECODE)
    if t == 16 or DRY:
        ref = kx._reference(x, ids, offsets, r, ew)
        print(f"  repo DECODE vs torch reference at t16: {float((base - ref).abs().max() / ref.abs().max()):.2e}")
    for name, kw in VARIANTS:
        try:
            fn = (lambda: kt.run(x, offsets, r, ew, kt.DECODE)) if kw is None else \
                 (lambda kw=kw: fs.run(x, offsets, r, ew, **kw))
            got = fn()
            err = float((got - base).abs().max() / base.abs().max())
            ms = timed(fn)
            tbps = gbytes / ms
            row = dict(variant=name, tokens=t, touched=touched, ms=round(ms, 4), weight_gb=round(gbytes, 4),
                       tbps=round(tbps, 3), copy_tbps=round(ceiling, 3), share=round(tbps / ceiling, 3),
                       err_vs_repo=err, device="cpu" if DRY else torch.cuda.get_device_name())
        except Exception as exc:                     # one line, then the next variant
            print(f"  {name} t{t}: failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}", flush=True)
            continue
        rows.append(row)
        with open(out_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"  t{t:4d} {name:38s} {ms*1e3:8.1f} us {tbps:5.2f} TB/s {tbps/ceiling:5.1%} err {err:.1e}", flush=True)
print("\nvariant                                 " + "".join(f"  t{t:<5d}" for t in TOKENS) + "  (share of copy bandwidth)")
for name, _ in VARIANTS:
    cells = {r["tokens"]: r["share"] for r in rows if r["variant"] == name}
    print(f"{name:40s}" + "".join(f"  {cells[t]:6.1%}" if t in cells else "      - " for t in TOKENS))
