"""DeepSeek-V4.1-Flash at released dims on one GPU: a reduced layer stack (every layer kind, both
engram layers with a reduced table, the three DSpark stages), random weights, bf16, FP4-resident
experts. Prefill (full and YOCO-truncated), 32 decode steps, DSpark drafts, cached-state bytes/token.

  python examples/v41_flash_gpu.py --layers 9 --out result.json
Writes one JSON row (atomically) and prints a short table.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from deepinfer.checkpoint.make import random_model
from deepinfer.config.presets import preset_config
from deepinfer.cli import run_cli
from deepinfer.reference import compute_logits, extend, extend_and_draft, new_state, packed_kv_bytes_per_token


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="flash")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--engram-vocab-size", type=int, default=1000)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--out", default="v41_flash_gpu.json")
    args = ap.parse_args()

    t0 = time.perf_counter()
    model = random_model("deepseek_v41", args.preset, seed=0, layers=args.layers, device=args.device,
                         engram_vocab_size=args.engram_vocab_size, expert_storage="fp4")
    cfg = model.cfg
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    packed = sum(b.numel() * 2 for n, b in model.named_buffers() if n.endswith("_fp4"))   # 2 weights per byte
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, cfg.vocab_size, (args.prompt + args.decode,), generator=gen)
    p = args.prompt

    full, t_full = timed(lambda: compute_logits(model, ids[None, :p].to(args.device))[0, -1])
    st = new_state(model)
    last, t_trunc = timed(lambda: extend(model, [ids[:p]], [st], last_only=True)[0][0])
    trunc_err = (last - full).abs().max().item()
    steps = []
    sync()
    t = time.perf_counter()
    for i in range(args.decode):
        steps.append(extend(model, [ids[p + i:p + i + 1]], [st])[0][0])
    sync()
    t_decode = (time.perf_counter() - t) / args.decode
    ref = compute_logits(model, ids[None, :p + args.decode].to(args.device))[0, p:]
    dec = torch.stack(steps)
    decode_err = (dec - ref).abs().max().item()
    greedy_agree = (dec.argmax(-1) == ref.argmax(-1)).float().mean().item()

    half = new_state(model)
    extend(model, [ids[:p // 2]], [half], last_only=True)
    grown = new_state(model)
    extend(model, [ids[:p]], [grown], last_only=True)
    per_token = (grown.nbytes() - half.nbytes()) / (p - p // 2)

    dst = new_state(model)
    (y, _, drafts), t_draft_prefill = timed(lambda: extend_and_draft(model, [ids[:p]], [dst]))
    t = time.perf_counter()
    for i in range(args.decode):
        y, _, drafts = extend_and_draft(model, [y.cpu()], [dst])
    sync()
    t_draft_step = (time.perf_counter() - t) / args.decode

    row = {
        "what": "v41-flash-reduced random bf16", "layers": args.layers, "schedule": list(cfg.compress_ratios),
        "kv_sources": list(cfg.kv_source_layer_ids), "engram_layers": list(cfg.engram_layer_ids),
        "engram_rows": list(cfg.engram_num_embeddings), "dspark_stages": cfg.num_nextn_predict_layers,
        "params_dense": params, "params_fp4_experts": packed, "build_s": round(build_s, 1),
        "prompt": p, "prefill_full_ms": round(t_full * 1e3, 1), "prefill_yoco_ms": round(t_trunc * 1e3, 1),
        "yoco_vs_full_max_abs_logit_diff": trunc_err, "decode_ms_per_step": round(t_decode * 1e3, 2),
        "decode_vs_full_max_abs_logit_diff": decode_err, "decode_vs_full_greedy_agreement": greedy_agree,
        "state_bytes_per_token_measured": per_token,
        "state_bytes_per_token_packed_released": packed_kv_bytes_per_token(preset_config("deepseek_v41", "flash")),
        "state_bytes_per_token_packed_this_stack": packed_kv_bytes_per_token(cfg),
        "dspark_prefill_ms": round(t_draft_prefill * 1e3, 1), "dspark_step_ms": round(t_draft_step * 1e3, 2),
        "draft_tokens_last": drafts.tokens[0].tolist(), "draft_confidence_last": drafts.confidence[0].tolist(),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
    }
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(row, f, indent=1)
    os.replace(tmp, args.out)
    for k, v in row.items():
        print(f"{k:45s} {v}")


if __name__ == "__main__":
    run_cli(main)      # bad input: one error line, exit 2 (docs/errors.md)
