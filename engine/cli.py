"""The `deepinfer` command: make-checkpoint, run."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import traceback

import click

from .errors import DeepInferError
from .text import check_text, read_text_file
from .api import resolve_model
from .validate import ARCHS, DTYPE_NAMES, EMBEDDED, EXPERT_STORAGE, MAX_ROUTER_SKEW, PRESETS, PROJECTION_STORAGE


def run_cli(entry) -> None:
    """Invoke a click group (or a plain function, e.g. an example's main) under the error contract
    (docs/errors.md): the DEEPINFER_* environment is checked first; a DeepInferError (bad SamplingParams
    included), a usage error or an OS error on a path the user named becomes one `error:` line on stderr and
    exit status 2; Ctrl-C exits 130. A rank of a torchrun launch leaves through `leave_launch`."""
    if _launch_size() == 1:
        _guarded(entry)
        return
    try:
        _guarded(entry)
        code = 0
    except SystemExit as done:
        code = _exit_code(done.code)
    except BaseException:                # noqa: BLE001  printed here: os._exit would swallow it
        traceback.print_exc()
        code = 1
    leave_launch(code)


def _guarded(entry) -> None:
    from .env import check_environment
    try:
        check_environment()
        entry(standalone_mode=False) if isinstance(entry, click.Command) else entry()
    except DeepInferError as err:
        _fail(str(err))
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        ctx = getattr(err, "ctx", None)
        hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
        _fail(f"{err.format_message()}{hint}", err.exit_code)
    except OSError as err:            # a path the user gave: unreadable, read-only, full disk, busy mount point
        where = f"{err.filename}: " if err.filename else ""
        _fail(f"{where}{err.strerror or err}; check the path and its permissions")
    except KeyboardInterrupt:
        click.echo("aborted", err=True)
        sys.exit(130)


def _launch_size() -> int:
    """The processes of this torchrun launch (1 when not launched by torchrun)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _exit_code(code) -> int:
    """sys.exit's argument as the status Python would give it (a message is printed, status 1)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def leave_launch(code: int) -> None:
    """End a torchrun rank once its command is done (every collective met, rank 0's files closed): streams and log
    handlers flushed, then os._exit. The interpreter's teardown is skipped because gloo's threads, torn down by the
    destructors at exit, can abort a finished rank under load ("terminate called without an active exception",
    SIGABRT), even with the process group destroyed first, failing a launch whose rows were all written
    (docs/parallel.md, "How a rank ends"). A flush that fails (a closed pipe) still ends the rank with `code`; C
    stdio buffers (NCCL's lines on a piped stdout) are flushed too, since os._exit skips the C library's exit."""
    try:
        with contextlib.suppress(Exception):     # nothing may keep the rank from leaving with its code
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            import ctypes
            ctypes.CDLL(None).fflush(None)
    finally:
        os._exit(code)


def _fail(message: str, code: int = 2) -> None:
    click.echo("error: " + " ".join(message.split()), err=True)
    sys.exit(code)


@click.group(help="deepinfer: run DeepSeek-V4-family models (V4.1-Flash first) offline.", epilog="""Examples:

\b
  deepinfer run                      # greedy-decode a prompt on the embedded tiny model (CPU)
  deepinfer generate --prompt hi     # the LLM API: continuous batching, sampling
  deepinfer make-checkpoint --out /tmp/tiny   # a seeded random checkpoint in the release layout""")
def cli() -> None:
    """Command group; the subcommands below do the work."""


MAKE_EXAMPLES = """Examples:

\b
  deepinfer make-checkpoint --out /tmp/tiny-v41                      # tiny V4.1, DeepSeek layout (seconds)
  deepinfer make-checkpoint --arch deepseek_v4 --format hf --seed 3 --out /tmp/tiny-v4-hf
  deepinfer make-checkpoint --preset flash --layers 4 --out /data/v41-flash-4l   # released widths, 4 layers
  deepinfer make-checkpoint --preset flash --layers 4 --router-skew 0.8 --out /data/v41-hot   # hot experts

Routers are calibrated after the weights are drawn: balanced across experts like a trained model's, or with
--router-skew S a Zipf-like hot-expert load (share ~ rank^-S; docs/bench.md has the curve)."""

RUN_EXAMPLES = """Examples:

\b
  deepinfer run                                            # the embedded tiny V4.1 model on CPU
  deepinfer run --arch deepseek_v4 --prompt "Hello" --max-tokens 16
  deepinfer run --model /data/DeepSeek-V4.1-Flash --device cuda --dtype bfloat16 --expert-storage fp4

The embedded model is untrained (random weights): its text is random; it exists to exercise the engine."""

GENERATE_EXAMPLES = """Examples:

\b
  deepinfer generate --prompt "The capital of France is" --max-tokens 8
  deepinfer generate --model tiny --prompt a --prompt b --temperature 0.8 --seed 1 --n 2 --json
  deepinfer generate --prompt "Phone:" --so-regex "[0-9]{3}-[0-9]{4}"
  deepinfer generate --prompt "A user as JSON:" --so-json user.schema.json --max-tokens 200"""

MODEL_HELP = "checkpoint dir, hub id, tiny or random:ARCH:PRESET:LAYERS[:skew=S] [default: the embedded tiny model]"
DEVICE_HELP = "cpu, cuda or cuda:N [default: $DEEPINFER_ACCELERATOR, else cpu]"


@cli.command("make-checkpoint", epilog=MAKE_EXAMPLES,
             help="Write a seeded random model in the real on-disk layout.")
@click.option("--arch", type=click.Choice(ARCHS), default="deepseek_v41", show_default=True, help="HF model_type")
@click.option("--preset", type=click.Choice(PRESETS), default="tiny", show_default=True,
              help="tiny (CPU seconds) or flash (released dims)")
@click.option("--format", "fmt", type=click.Choice(["deepseek", "hf"]), default="deepseek", show_default=True)
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0))
@click.option("--layers", default=None, type=click.IntRange(1), help="reduced depth (N layers of the preset)")
@click.option("--engram-vocab-size", default=None, type=click.IntRange(1),
              help="deepseek_v41: smaller engram tables (bucket primes start here; the release uses 16000000)")
@click.option("--router-skew", default=0.0, show_default=True, type=click.FloatRange(0, MAX_ROUTER_SKEW),
              help="hot-expert skew of the calibrated routers: expert of rank r gets a load share ~ r^-S (0: balanced)")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="output directory")
@click.option("--overwrite", is_flag=True, help="replace a non-empty --out")
def make_checkpoint_cmd(arch, preset, fmt, seed, layers, engram_vocab_size, router_skew, out, overwrite) -> None:
    from .checkpoint.make import make_checkpoint
    if engram_vocab_size is not None and arch != "deepseek_v41":
        raise DeepInferError(f"--engram-vocab-size sizes V4.1's engram tables; {arch} has none: drop it")
    t0 = time.perf_counter()
    path = make_checkpoint(arch, preset, fmt, seed, out, layers, overwrite, engram_vocab_size=engram_vocab_size,
                           router_skew=router_skew)
    click.echo(f"wrote {arch}/{preset} seed {seed} ({fmt} format) to {path} in {time.perf_counter() - t0:.1f}s")


@cli.command("run", epilog=RUN_EXAMPLES, help="Greedy-decode one prompt on the engine, with timing and progress.")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--arch", type=click.Choice(ARCHS), default=None,
              help="which embedded tiny model (without --model, or with --model tiny) [default: deepseek_v41]; "
                   "with a checkpoint it must match its config.json")
@click.option("--prompt", default="The quick brown fox", show_default=True)
@click.option("--max-tokens", default=32, show_default=True, type=click.IntRange(1))
@click.option("--device", default=None, help=DEVICE_HELP)
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default="float32", show_default=True)
@click.option("--no-qat", is_flag=True, help="turn off the reference's QAT fake-quant steps")
@click.option("--expert-storage", type=click.Choice(EXPERT_STORAGE), default="dense", show_default=True,
              help="fp4: keep V4.1 routed experts packed as stored (0.56 B/weight), dequantized per use")
@click.option("--projection-storage", type=click.Choice(PROJECTION_STORAGE), default="dense", show_default=True,
              help="fp8: keep the FP8 projections as stored and run them W8A8 (fp8_linear)")
@click.option("--no-progress", is_flag=True, help="no progress bar")
def run_cmd(model, arch, prompt, max_tokens, device, dtype, no_qat, expert_storage, projection_storage,
            no_progress) -> None:
    from .llm import LLM
    from .sampling import SamplingParams
    from .validate import check_checkpoint_arch, check_model_spec
    check_text("--prompt", prompt, from_bytes=True)
    model = check_model_spec(model)
    if model is None or model == EMBEDDED:
        from .checkpoint.make import embedded_tiny_dir
        model = embedded_tiny_dir(arch or "deepseek_v41")
    elif arch is not None and isinstance(model, str) and model.startswith("random:"):
        check_checkpoint_arch(arch, model, model.split(":")[1])
    sized = {}
    if not (isinstance(model, str) and model.startswith("random:")):
        sized = _sized_to(_check_prompt_first(model, arch, [prompt]), max_tokens)
    t0 = time.perf_counter()
    llm = LLM(model=model, device=device, dtype=dtype, qat_fake_quant=not no_qat, expert_storage=expert_storage,
              projection_storage=projection_storage, max_num_seqs=1, **sized)
    cfg = llm.model.cfg
    check_checkpoint_arch(arch, llm.model.checkpoint_dir, cfg.model_type)
    ids = llm.tokenizer.encode(prompt).ids
    click.echo(f"loaded {cfg.model_type} ({cfg.num_hidden_layers} layers) from {llm.model.checkpoint_dir} "
               f"in {time.perf_counter() - t0:.1f}s; prompt {len(ids)} tokens")
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    bar = None if no_progress else _token_bar(llm, len(ids) + max_tokens)
    try:
        out = llm.generate(prompt, sp, use_tqdm=False)[0]
    finally:
        if bar is not None:
            bar.close()
    done, m = out.outputs[0], out.metrics[0]
    n, decode_s = len(done.token_ids), m.token_times[-1] - m.first_token_time
    click.echo(f"output: {done.text!r} ({done.finish_reason})")
    click.echo(f"prefill {len(ids)} tok, first token after {m.ttft * 1e3:.1f} ms; decode {n - 1} more tok at "
               f"{(n - 1) / decode_s if n > 1 and decode_s > 0 else float('nan'):.1f} tok/s; "
               f"{llm.stats.steps} engine steps")


def _check_prompt_first(model, arch, prompts: list[str]) -> tuple[int, int]:
    """Before the weights load (minutes at released widths): the checkpoint's config and tokenizer decide whether
    --arch fits and the prompt is empty or too long, with the checks LLM.generate makes. Returns (the longest
    prompt's tokens, the model's positions)."""
    from .checkpoint.hub import resolve_model_dir
    from .checkpoint.tokenizer import read_tokenizer
    from .config import load_model_config
    from .validate import check_checkpoint_arch, encode_prompt
    ckpt = resolve_model_dir(model)
    cfg = load_model_config(ckpt)
    check_checkpoint_arch(arch, ckpt, cfg.model_type)
    tokenizer = read_tokenizer(ckpt, "this command needs to encode --prompt")
    longest = max(len(encode_prompt(i, p, tokenizer, cfg.vocab_size, cfg.max_position_embeddings)[1])
                  for i, p in enumerate(prompts))
    return longest, cfg.max_position_embeddings


def _sized_to(prompt_and_limit: tuple[int, int], max_tokens: int) -> dict:
    """The engine sized to the command's one request batch: max_model_len = the longest prompt + max_tokens (at
    most the model's positions). Start-up work that scales with it (the speculative step-rate profile, the state
    pools) then does what the run can use: the default 4096 positions x 256 sequences took minutes on a CPU."""
    longest, limit = prompt_and_limit
    return {"max_model_len": min(longest + max_tokens, limit)}


def _token_bar(llm, total: int):
    """A tqdm bar over the tokens the engine feeds (prompt chunks, then one per decode step), fed by a step
    observer; shown on stderr, only when it is a terminal (tqdm's default)."""
    from tqdm.auto import tqdm
    bar = tqdm(total=total, desc="run", unit="tok", leave=False, disable=None)
    llm.engine.step_observers.append(lambda batch: bar.update(sum(s.n for s in batch)))
    return bar


@cli.command("generate", epilog=GENERATE_EXAMPLES,
             help="Generate with continuous batching (the LLM API) for one or more prompts.")
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--prompt", "prompts", multiple=True, required=True, help="a prompt (repeat for several)")
@click.option("--max-tokens", default=32, show_default=True, type=int)
@click.option("--temperature", default=0.0, show_default=True, type=float)
@click.option("--top-p", default=1.0, show_default=True, type=float)
@click.option("--top-k", default=-1, show_default=True, type=int)
@click.option("--n", default=1, show_default=True, type=int)
@click.option("--seed", default=None, type=int, help="per-request seed (reproducible draws)")
@click.option("--device", default=None, help=DEVICE_HELP)
@click.option("--dtype", type=click.Choice(DTYPE_NAMES), default="float32", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="one JSON line per prompt")
@click.option("--so-json", "so_json", default=None, type=click.Path(dir_okay=False),
              help="structured output: a JSON-schema file the output must follow")
@click.option("--so-regex", "so_regex", default=None, help="structured output: a regex the output must match")
@click.option("--so-ebnf", "so_ebnf", default=None, type=click.Path(dir_okay=False),
              help="structured output: an EBNF (GBNF) grammar file, rule root first")
def generate_cmd(model, prompts, max_tokens, temperature, top_p, top_k, n, seed, device, dtype, as_json, so_json,
                 so_regex, so_ebnf) -> None:
    import json

    from .llm import ENGINE_DEFAULTS, LLM
    from .sampling import SamplingParams
    from .validate import check_model_spec
    for i, p in enumerate(prompts):
        check_text("--prompt" if len(prompts) == 1 else f"--prompt {i + 1}", p, from_bytes=True)
    so_args = _so_args_option(so_json, so_regex, so_ebnf)
    sp = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=n, seed=seed,
                        so_args=so_args)
    model = check_model_spec(model)
    sized = {"max_num_seqs": min(len(prompts) * sp.n, ENGINE_DEFAULTS["max_num_seqs"])}   # beyond it: queued
    if not (isinstance(model, str) and model.startswith("random:")):
        sized |= _sized_to(_check_prompt_first(resolve_model(model, "cpu", "float32") if model in (None, EMBEDDED)
                                               else model, None, list(prompts)), max_tokens)
    llm = LLM(model=model, device=device, dtype=dtype, **sized)
    for out in llm.generate(list(prompts), sp, use_tqdm=False):
        if as_json:
            click.echo(json.dumps({"prompt": out.prompt, "outputs": [
                {"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason} for o in out.outputs],
                "ttft_s": out.metrics[0].ttft}))
        else:
            for o in out.outputs:
                click.echo(f"{out.prompt!r} -> {o.text!r} ({o.finish_reason})")


def _so_args_option(so_json: str | None, so_regex: str | None, so_ebnf: str | None) -> dict | None:
    """At most one of --so-json / --so-regex / --so-ebnf as so_args; a file that cannot be read is one line."""
    given = [(k, v) for k, v in (("json", so_json), ("regex", so_regex), ("ebnf", so_ebnf)) if v is not None]
    if len(given) > 1:
        raise click.UsageError("give at most one of --so-json, --so-regex, --so-ebnf")
    if not given:
        return None
    (kind, value), = given
    if kind == "regex":
        return {"schema_type": "regex", "schema": value}
    try:
        text = read_text_file(f"--so-{kind}", value)
    except OSError as err:
        raise click.UsageError(f"--so-{kind} {value}: cannot read it ({err.strerror})") from None
    return {"schema_type": kind, "schema": text}


def main() -> None:
    run_cli(cli)
