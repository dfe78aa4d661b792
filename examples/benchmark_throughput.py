"""Offline throughput of LLM.generate: random-token prompts, fixed output lengths, one JSON result row.

    python examples/benchmark_throughput.py --model tiny --num-prompts 64 --input-len 128 --output-len 32
Row: output and total tokens/s, TTFT and TPOT (mean, median, p99), the engine arguments, the environment.
Written atomically to --out (default: print only)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.checkpoint.make import embedded_tiny_dir
from deepinfer.cli import run_cli


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except OSError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="checkpoint dir, hub id, or 'tiny'")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--expert-storage", default="dense")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the JSON row here (atomically)")
    args = ap.parse_args()
    model = embedded_tiny_dir() if args.model == "tiny" else args.model
    llm = LLM(model=model, device=args.device, dtype=args.dtype, seed=args.seed, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, expert_storage=args.expert_storage)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = llm.model.cfg.vocab_size
    prompts = [torch.randint(10, vocab, (args.input_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics[0].first_token_time - t0 for o in outs]
    tpot = [(o.metrics[0].finished_time - o.metrics[0].first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outs if len(o.outputs[0].token_ids) > 1]
    stats = lambda xs: {"mean": statistics.fmean(xs), "median": statistics.median(xs), "p99": percentile(xs, 0.99)}  # noqa: E731
    row = {
        "schema": "deepinfer.throughput/1", "model": str(model), "model_type": llm.model.cfg.model_type,
        "layers": llm.model.cfg.num_hidden_layers, "device": args.device, "dtype": args.dtype,
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "elapsed_s": elapsed, "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_out + args.num_prompts * args.input_len) / elapsed,
        "ttft_s": stats(ttft), "tpot_s": stats(tpot) if tpot else None, "measured": True,
        "env": {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "git_sha": git_sha()},
    }
    text = json.dumps(row, indent=1)
    if args.out:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)
    print(text)


if __name__ == "__main__":
    run_cli(main)
