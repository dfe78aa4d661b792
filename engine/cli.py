"""The `deepinfer` command: make-checkpoint, run."""

from __future__ import annotations

import sys
import time

import click

from .env import accelerator
from .errors import DeepInferError


def run_cli(entry) -> None:
    """Invoke a click group (or a plain function, e.g. an example's main); a DeepInferError (bad
    SamplingParams included) becomes one line on stderr and exit status 2."""
    try:
        entry(standalone_mode=False) if isinstance(entry, click.Command) else entry()
    except DeepInferError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(2)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)


@click.group(help="deepinfer: run DeepSeek-V4-family models (V4.1-Flash first) offline.")
def cli() -> None:
    """Command group; the subcommands below do the work."""


@cli.command("make-checkpoint", help="Write a seeded random model in the real on-disk layout.")
@click.option("--arch", default="deepseek_v41", show_default=True, help="HF model_type: deepseek_v41 or deepseek_v4")
@click.option("--preset", default="tiny", show_default=True, help="tiny (CPU seconds) or flash (released dims)")
@click.option("--format", "fmt", type=click.Choice(["deepseek", "hf"]), default="deepseek", show_default=True)
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--layers", default=None, type=int, help="reduced depth (N layers of the preset)")
@click.option("--engram-vocab-size", default=None, type=int,
              help="deepseek_v41: smaller engram tables (bucket primes start here; the release uses 16000000)")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="output directory")
@click.option("--overwrite", is_flag=True, help="replace a non-empty --out")
def make_checkpoint_cmd(arch, preset, fmt, seed, layers, engram_vocab_size, out, overwrite) -> None:
    from .checkpoint.make import make_checkpoint
    t0 = time.perf_counter()
    path = make_checkpoint(arch, preset, fmt, seed, out, layers, overwrite, engram_vocab_size=engram_vocab_size)
    click.echo(f"wrote {arch}/{preset} seed {seed} ({fmt} format) to {path} in {time.perf_counter() - t0:.1f}s")


@cli.command("run", help="Greedy-decode a prompt (default: the embedded tiny model on CPU).")
@click.option("--model", default=None, help="checkpoint dir or hub id (default: the embedded tiny model)")
@click.option("--arch", default="deepseek_v41", show_default=True,
              help="the embedded tiny model's arch when --model is not given (deepseek_v41 or deepseek_v4)")
@click.option("--prompt", default="The quick brown fox", show_default=True)
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(1, 100000))
@click.option("--device", default=None, help="cpu, cuda, cuda:N (default: $DEEPINFER_ACCELERATOR, else cpu)")
@click.option("--dtype", default="float32", show_default=True)
@click.option("--no-qat", is_flag=True, help="turn off the reference's QAT fake-quant steps")
@click.option("--expert-storage", type=click.Choice(["dense", "fp4"]), default="dense", show_default=True,
              help="fp4: keep V4.1 routed experts packed as stored (0.56 B/weight), dequantized per use")
def run_cmd(model, arch, prompt, max_tokens, device, dtype, no_qat, expert_storage) -> None:
    import torch
    from tokenizers import Tokenizer

    from .api import load_model
    from .checkpoint.make import embedded_tiny_dir
    path = model if model is not None else embedded_tiny_dir(arch)
    t0 = time.perf_counter()
    llm = load_model(path, device=device or accelerator(), dtype=dtype, qat_fake_quant=not no_qat, expert_storage=expert_storage)
    tok_file = llm.checkpoint_dir / "tokenizer.json"
    if not tok_file.is_file():
        raise DeepInferError(f"{llm.checkpoint_dir} has no tokenizer.json; the run command needs one")
    tokenizer = Tokenizer.from_file(str(tok_file))
    ids = tokenizer.encode(prompt).ids
    click.echo(f"loaded {llm.cfg.model_type} ({llm.cfg.num_hidden_layers} layers) from {llm.checkpoint_dir} "
               f"in {time.perf_counter() - t0:.1f}s; prompt {len(ids)} tokens")
    state, out = llm.new_state(), []
    t1 = time.perf_counter()
    logits = llm.extend([torch.tensor(ids)], [state])[0][-1]
    t2 = time.perf_counter()
    for _ in range(max_tokens):
        nxt = int(logits.argmax())
        out.append(nxt)
        if nxt == llm.cfg.eos_token_id or len(out) == max_tokens:
            break
        logits = llm.extend([torch.tensor([nxt])], [state])[0][-1]
    t3 = time.perf_counter()
    click.echo(f"output: {tokenizer.decode(out)!r}")
    click.echo(f"prefill {len(ids)} tok in {(t2 - t1) * 1e3:.1f} ms; decode {len(out)} tok at "
               f"{len(out) / max(t3 - t2, 1e-9):.1f} tok/s; state {state.nbytes() / 1024:.1f} KiB")


@cli.command("generate", help="Generate with continuous batching (the LLM API) for one or more prompts.")
@click.option("--model", default=None, help="checkpoint dir or hub id (default: the embedded tiny model)")
@click.option("--prompt", "prompts", multiple=True, required=True, help="a prompt (repeat for several)")
@click.option("--max-tokens", default=32, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=-1, show_default=True, type=int)
@click.option("--n", default=1, show_default=True, type=int)
@click.option("--seed", default=None, type=int, help="per-request seed (reproducible draws)")
@click.option("--device", default=None, help="cpu, cuda, cuda:N (default: $DEEPINFER_ACCELERATOR, else cpu)")
@click.option("--dtype", default="float32", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON line per prompt")
def generate_cmd(model, prompts, max_tokens, temperature, top_p, top_k, n, seed, device, dtype, as_json) -> None:
    import json

    from .llm import LLM
    from .sampling import SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=n, seed=seed)
    llm = LLM(model=model, device=device, dtype=dtype)
    for out in llm.generate(list(prompts), sp, use_tqdm=False):
        if as_json:
            click.echo(json.dumps({"prompt": out.prompt, "outputs": [
                {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason} for o in out.outputs],
                "ttft_s": out.metrics[0].ttft}))
        else:
            for o in out.outputs:
                click.echo(f"{out.prompt!r} -> {o.text!r} ({o.finish_reason})")


def main() -> None:
    run_cli(cli)
