"""GPU: expert-GEMM tile variants (FP4 A16 V4.1 shapes, bf16 V4 shapes) and the indexer top-k, cold-L2 graph timing.
Prints a table, writes $OUT/variants.json."""
import dataclasses, json, os, sys, time
import torch
from deepinfer.harness.kernel_bench import MODEL_SHAPES, random_expert_weights, routed_batch, expert_traffic, _time, _rel_err
from deepinfer.harness.ceilings import copy_bandwidth
from deepinfer.kernels import experts_triton as et, indexer_triton as kit, indexer as ki
from deepinfer.kernels.experts import grouped_experts
from deepinfer.kernels.table import use
dev = "cuda"
bw = copy_bandwidth(torch.device(dev), 1 << 30, 3, 10)
V = {
  "DECODE": et.DECODE, "PREFILL": et.PREFILL, "PREFILL+lut": dataclasses.replace(et.PREFILL, lut_fp4=True),
  "INV64-arith": dataclasses.replace(et.INVARIANT, lut_fp4=False), "INV64+lut": et.INVARIANT,
  "INV16+lut": et.Tiles(bm=16, bn=64, bk=128, warps=4, stages=4, min_bn=64, lut_fp4=True),
  "INV32+lut": et.Tiles(bm=32, bn=64, bk=128, warps=4, stages=4, min_bn=64, lut_fp4=True),
}
out = {"copy_bw": bw, "experts": [], "topk": []}
for model, storage, toks in (("v41", "fp4", (1, 16, 64, 256, 2048, 8192)), ("v4", "bf16", (1, 64, 256, 8192))):
    E, D, I, K = MODEL_SHAPES[model]["experts"]
    g = torch.Generator(device=dev).manual_seed(0)
    ew = random_expert_weights(storage, E, D, I, False, dev, g)
    for t in toks:
        x, ids, offs, r, touched = routed_batch(t, E, D, K, dev, g)
        nbytes, flops = expert_traffic(ew, x.shape[0], touched)
        with use("reference"):
            ref = grouped_experts(x, ids, offs, r, ew)
        row = {"model": model, "storage": storage, "tokens": t}
        for name, tiles in V.items():
            if storage == "bf16" and "lut" in name and name.startswith("PREFILL"):
                continue
            try:
                y = et.run(x, offs, r, ew, tiles)
                ms = 1e3 * _time(lambda: et.run(x, offs, r, ew, tiles), dev, 3, 10)
                row[name] = {"ms": ms, "bw_share": nbytes / (ms / 1e3) / bw, "tflops": flops / (ms / 1e3) / 1e12,
                             "err": _rel_err(y, ref)}
            except Exception as e:
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        out["experts"].append(row)
        print(model, storage, t, " ".join(f"{k}={v['ms']:.3f}" if 'ms' in v else f"{k}=ERR" for k, v in row.items() if isinstance(v, dict)), flush=True)
    del ew; torch.cuda.empty_cache()
for n, width, k in ((1, 256, 512), (1, 1024, 512), (1, 4096, 512), (64, 1024, 512), (256, 1024, 512), (1, 8192, 512), (1, 32768, 2048), (64, 16384, 512)):
    s = torch.randn(n, width, device=dev)
    got = kit.top_k_kernel(s, k)
    want = ki._top_k_indices(s, k)
    ms = 1e3 * _time(lambda: kit.top_k_kernel(s, k), dev, 3, 20)
    ref_ms = 1e3 * _time(lambda: ki._top_k_indices(s, k), dev, 3, 20)
    out["topk"].append({"n": n, "width": width, "k": k, "ms": ms, "ref_ms": ref_ms, "equal": bool(torch.equal(got, want))})
    print("topk", n, width, k, f"{ms*1e3:.1f} us (torch sort {ref_ms*1e3:.1f} us) equal={torch.equal(got, want)}", flush=True)
from deepinfer.kernels import sampling as ks
out["draw"] = []
for b in (1, 16, 64, 256):
    x = torch.randn(b, 129280, device=dev) * 4
    seeds = torch.arange(b, device=dev) + 11; pos = torch.arange(b, device=dev) * 7
    for name, rows in (("greedy", None), ("noise", torch.ones(b, dtype=torch.bool, device=dev))):
        ms = 1e3 * _time(lambda: ks.draw_kernel(x, rows, seeds, pos, 0), dev, 3, 20)
        ref_ms = 1e3 * _time(lambda: ks._reference(x, rows, seeds, pos, 0), dev, 2, 5)
        eq = bool(torch.equal(ks.draw_kernel(x, rows, seeds, pos, 0), ks._reference(x, rows, seeds, pos, 0)))
        out["draw"].append({"b": b, "kind": name, "ms": ms, "ref_ms": ref_ms, "equal": eq})
        print("draw", b, name, f"{ms*1e3:.1f} us (torch {ref_ms*1e3:.1f} us) equal={eq}", flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "variants.json"), "w"), indent=1)
print("\nexperts ms (bw share):")
names = list(V)
print("model tokens " + " ".join(f"{n:>14s}" for n in names))
for row in out["experts"]:
    print(f"{row['model']:5s} {row['tokens']:6d} " + " ".join(
        (f"{row[n]['ms']:7.3f}({row[n]['bw_share']:.0%})" if n in row and 'ms' in row[n] else f"{'-':>14s}") for n in names))
