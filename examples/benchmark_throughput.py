"""Offline throughput of LLM.generate: random-token prompts, fixed output lengths, one JSON result row.

    python examples/benchmark_throughput.py --model tiny --num-prompts 64 --input-len 128 --output-len 32
    python examples/benchmark_throughput.py --model random:deepseek_v4:flash:4 --device cuda --dtype bfloat16 \
        --vs-transformers      # a flash-width 4-layer V4 built in memory; transformers' generate on it too
Row: output and total tokens/s, TTFT and TPOT (mean, median, p99), the engine arguments, the environment;
with --vs-transformers (V4 only) also transformers' greedy generate on the same weights, prompts and GPU in
the same run, its tokens/s, the speed ratio and how many generated tokens agree.
Written atomically to --out (default: print only)."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.cli import run_cli
from deepinfer.harness.rows import atomic_write_text, git_state


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="checkpoint dir, hub id, 'tiny', or random:ARCH:PRESET:LAYERS "
                    "(random weights built in memory)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--expert-storage", default="dense")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--no-qat", action="store_true", help="leave out the QAT activation steps (as transformers)")
    ap.add_argument("--vs-transformers", action="store_true", help="also time transformers' generate (V4)")
    ap.add_argument("--out", default=None, help="write the JSON row here (atomically)")
    args = ap.parse_args()
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype, seed=args.seed, qat_fake_quant=not args.no_qat, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, expert_storage=args.expert_storage,
              max_model_len=args.max_model_len or args.input_len + args.output_len + 1)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = llm.model.cfg.vocab_size
    prompts = [torch.randint(10, vocab, (args.input_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)    # warm-up: captures the graphs the
    llm.generate(prompts[:1], warm, use_tqdm=False)                         # timed run uses (batch 1 and the
    llm.generate(prompts, warm, use_tqdm=False)                             # full batch at this context)
    llm.engine.reset_stats()                                                # stats of the timed run only
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
    engine = llm.stats           # steps, tokens, preemptions, graph replays, kernel backends, state pools
    row = {
        "schema": "deepinfer.throughput/1", "model": args.model, "model_type": llm.model.cfg.model_type,
        "layers": llm.model.cfg.num_hidden_layers, "device": args.device, "dtype": args.dtype,
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "elapsed_s": elapsed, "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_out + args.num_prompts * args.input_len) / elapsed,
        "ttft_s": stats(ttft), "tpot_s": stats(tpot) if tpot else None, "measured": True,
        "async_scheduling": llm.async_scheduling, "cuda_graphs": engine.cuda_graphs,
        "graphs_captured": engine.graphs_captured, "batch_invariant": llm.batch_invariant,
        "state_pools": engine.state_summary, "engine": engine.to_dict(),
        "env": {"torch": torch.__version__, "python": platform.python_version(), "host": platform.node(),
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "git_sha": git_state()["sha"]},
    }
    if args.vs_transformers:
        row["batch1"] = {"prompts": BATCH1_PROMPTS, "output_tokens_per_s": one_by_one(
            lambda p: llm.generate([p], sp, use_tqdm=False), prompts[:BATCH1_PROMPTS], args.output_len)}
        print(json.dumps({k: row[k] for k in ("output_tokens_per_s", "tpot_s", "graphs_captured", "batch1")}),
              flush=True)
        row["transformers"] = tf = transformers_generate(llm, prompts, args.output_len, outs)
        row["speedup_vs_transformers_batch1"] = row["batch1"]["output_tokens_per_s"] / tf["batch1"]["output_tokens_per_s"]
        if "output_tokens_per_s" in tf:
            row["speedup_vs_transformers"] = row["output_tokens_per_s"] / tf["output_tokens_per_s"]
    text = json.dumps(row, indent=1)
    if args.out:
        atomic_write_text(args.out, text)
    print(text)


def transformers_generate(llm, prompts: list[list[int]], output_len: int, ours) -> dict:
    """transformers' DeepseekV4ForCausalLM on our weights (our model is moved off the GPU first), greedy
    generate on the same prompts as one batch (equal lengths: no padding)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from deepinfer.checkpoint.writer import hf_tensors
    model = llm.model
    if model.cfg.model_type != "deepseek_v4":
        raise SystemExit("--vs-transformers needs a deepseek_v4 model (transformers has no deepseek_v41 release)")
    device, dtype = model.device, model.dtype
    d = model.cfg.to_hf_dict()
    d.pop("model_type"), d.pop("architectures")
    cfg = DeepseekV4Config(**d)
    state = {k: v.to("cpu") for k, v in hf_tensors(model) if not k.startswith("mtp.")}
    del llm.model, llm.engine, model
    import gc
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    with torch.device(device):
        twin = DeepseekV4ForCausalLM(cfg).to(dtype).eval()
    missing, unexpected = twin.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise SystemExit(f"transformers twin: missing {missing[:3]}, unexpected {unexpected[:3]}")
    del state
    ids = torch.tensor(prompts, device=device)
    kw = dict(max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    out = {"transformers": __import__("transformers").__version__}
    with torch.inference_mode():
        run = lambda x: twin.generate(x, **{**kw, "attention_mask": torch.ones_like(x)})  # noqa: E731
        run(ids[:1, :8])                                                                # warm-up
        out["batch1"] = {"prompts": BATCH1_PROMPTS, "output_tokens_per_s": one_by_one(
            lambda p: run(torch.tensor([p], device=device)), prompts[:BATCH1_PROMPTS], output_len)}
        try:
            sync()
            t0 = time.perf_counter()
            gen = run(ids)
            sync()
        except RuntimeError as e:        # recorded, not hidden: the row says transformers failed at this batch
            out["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            return out
    elapsed = time.perf_counter() - t0
    new = gen[:, ids.shape[1]:].tolist()
    agree = sum(a == b for o, row in zip(ours, new) for a, b in zip(o.outputs[0].token_ids, row))
    first = sum(o.outputs[0].token_ids[0] == row[0] for o, row in zip(ours, new))
    return {**out, "elapsed_s": elapsed, "output_tokens_per_s": len(prompts) * output_len / elapsed,
            "tokens_agreeing": agree, "tokens_compared": len(prompts) * output_len, "first_tokens_agreeing": first}


BATCH1_PROMPTS = 4


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def one_by_one(generate, prompts: list[list[int]], output_len: int) -> float:
    """Output tokens/s generating the prompts one at a time (batch 1)."""
    sync()
    t0 = time.perf_counter()
    for p in prompts:
        generate(p)
    sync()
    return len(prompts) * output_len / (time.perf_counter() - t0)


if __name__ == "__main__":
    run_cli(main)
