"""Tile / split / head-block variants of the sparse attention kernel (kernels/attention_triton.py) at decode
shapes on a GPU: per variant the error against the reference and the cold-L2 time (kernel_bench._time), and per
shape the fastest variants next to the reference and the default tiles (`auto`: DECODE with split_plan). This is
how DECODE was chosen (docs/results.md, reports/1/attention-tiles-h200/).

    python -m deepinfer.harness.attention_tiles --out reports/1/attention-tiles-h200/attn_tune.json
"""

from __future__ import annotations

import itertools
import json
import time

import click
import torch


def variants():
    from deepinfer.kernels import attention_triton as kat
    out = [("auto", kat.DECODE, None)]
    for bh, w, mode in itertools.product((64, 32, 16), (4, 8), ("one", 16, 32, 64, 128)):
        out.append((f"h{bh}/n16/w{w}/{mode}", kat.AttnTiles(16, 128 if mode == "one" else mode, w, 2, bh),
                    0 if mode == "one" else 1))
    for bh, w, mode in itertools.product((32, 16), (4, 8), (32, 64, 128)):
        out.append((f"h{bh}/n32/w{w}/{mode}", kat.AttnTiles(32, mode, w, 2, bh), 1))
    return out


@click.command()
@click.option("--out", "out_path", required=True, help="JSON file for the per-shape results")
@click.option("--device", default="cuda")
@click.option("--context", default=8192, show_default=True)
@click.option("--bound", default=1e-2, show_default=True, help="largest error a variant may have to be ranked")
def main(out_path: str, device: str, context: int, bound: float) -> None:
    from deepinfer.harness import kernel_bench as kb
    from deepinfer.kernels import attention as ka
    from deepinfer.kernels import attention_triton as kat
    if not torch.cuda.is_available() or not device.startswith("cuda"):
        raise click.UsageError("the tile study times Triton kernels: it needs a CUDA device (--device cuda)")
    rows, t0, cases = [], time.time(), variants()
    for kind in kb.ATTENTION_KINDS:
        for tokens in (1, 16, 64):
            g = torch.Generator(device=device).manual_seed(0)
            q, sources, sink, k = kb.attention_inputs(kind, tokens, context, device, g)
            want = ka._sparse_sink_attention(q, sources, sink, 0.04).float()
            ref_ms = 1e3 * kb._time(lambda: ka._sparse_sink_attention(q, sources, sink, 0.04), device, 2, 10)
            res = []
            for name, tiles, splits in cases:
                fn = lambda: kat.sparse_attention(q, sources, sink, 0.04, tiles=tiles, splits=splits)  # noqa: E731
                try:
                    err = float((fn().float() - want).abs().max() / want.abs().max())
                    ms = 1e3 * kb._time(fn, device, 2, 10)
                except Exception as e:          # a variant that does not compile or fit: recorded, not ranked
                    res.append((name, None, f"{type(e).__name__}: {str(e)[:80]}"))
                    continue
                res.append((name, ms, err))
            ranked = sorted((r for r in res if r[1] is not None and r[2] <= bound), key=lambda r: r[1])
            auto = next(r for r in res if r[0] == "auto")
            rows.append(dict(kind=kind, tokens=tokens, keys=k, ref_ms=ref_ms, auto=auto, best=ranked[:5],
                             failed=[r for r in res if r[1] is None or r[2] > bound]))
            click.echo(f"{kind} t{tokens} k{k}: reference {ref_ms:.4f} ms, auto {auto[1]:.4f}, best {ranked[0][0]} "
                       f"{ranked[0][1]:.4f} ({time.time() - t0:.0f} s)")
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    main()
