"""`deepinfer-bench versus`: deepinfer against transformers' eager generate and against its own torch reference
backend, on the same V4 weights, in one run (docs/bench.md).

The model is a DeepSeek-V4 (transformers==5.23.0 has DeepseekV4ForCausalLM; V4.1 is not released there): a
checkpoint directory or random:deepseek_v4:PRESET:LAYERS. transformers' twin holds exactly our model's weights
(checkpoint/writer.hf_tensors), so all three run the same numbers; QAT fake-quant is off in ours, as transformers
leaves it out.

Per batch size b: b random-token prompts of `isl` tokens (seeded, the same for every engine), greedy, exactly
`osl` new tokens each (ignore_eos / min_new_tokens). Each engine first runs the same shape once untimed (kernels
compiled, CUDA graphs captured, the allocator warm), then once timed: wall time with the device synchronized,
so a row's seconds cover prefill and decode of the batch. One row per (engine, batch): seconds, output tokens,
output tok/s, ms per decode step (seconds / osl), and the greedy tokens' agreement with transformers' (bf16
near-ties in a random model split them). Order: transformers first (the twin then goes away, our model comes
back to the device), then deepinfer with the default kernels, then with the reference backend."""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from deepinfer.errors import DeepInferError
from deepinfer.validate import check_device, parse_dtype

from .bench import OnError, RunFolder, json_text, record_point
from .limits import POSITION_SLACK, Term, bench_backend, check_model, check_positions, model_limits
from .options import check_distinct, check_names
from .traffic import TRAFFIC_HEADER, traffic_cell, traffic_fields
from .rows import environment, identity, kernel_fields, read_rows, run_dir_guard

VERSUS_METHOD_VERSION = "1"
ENGINES = ("transformers", "deepinfer", "reference")


@dataclass(frozen=True)
class VersusConfig:
    model: str = "random:deepseek_v4:tiny:4"
    device: str = "cpu"
    dtype: str = "float32"
    batches: tuple[int, ...] = (1, 64)
    isl: int = 128
    osl: int = 32
    engines: tuple[str, ...] = ENGINES
    seed: int = 0

    def check(self) -> None:
        """Every option, then max_model_len (isl + osl + POSITION_SLACK) against the model's positions, before
        anything is built."""
        check_names("--engines", self.engines, ENGINES)
        check_distinct("--batch", self.batches)
        for name, v in (("--isl", self.isl), ("--osl", self.osl)):
            if v < 1:
                raise DeepInferError(f"{name} must be at least 1, got {v}")
        check_device(self.device)
        parse_dtype(self.dtype)
        check_positions(self.model, model_limits(self.model), [Term("--isl", self.isl), Term("--osl", self.osl)],
                        reserved=POSITION_SLACK)


def transformers_twin(model, dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """transformers' DeepseekV4ForCausalLM holding exactly our model's weights (eager attention), on `device`
    (default: the model's), in `dtype` except the parameters transformers' own loader keeps in fp32 at bf16 / fp16
    (`_keep_in_fp32_modules_strict`, matched in the parameter names as its loader matches them: the mHC mixes,
    sinks, the gate's bias, the norms), which our model keeps in fp32 too."""
    try:
        from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
    except ImportError as e:
        raise DeepInferError(f"the transformers side needs transformers==5.23.0 ({e}); pip install "
                             f"'deepinfer[reference]'") from None
    from deepinfer.checkpoint.writer import hf_tensors
    if model.cfg.TRANSFORMERS_CLASS != "DeepseekV4ForCausalLM":
        raise DeepInferError(f"transformers 5.23 runs deepseek_v4 only; this model is {model.cfg.model_type!r}")
    dtype = dtype or model.dtype
    d = model.cfg.to_hf_dict()
    d.pop("model_type"), d.pop("architectures")
    cfg = DeepseekV4Config(**d)
    cfg._attn_implementation = "eager"
    with torch.device(device or model.device):
        twin = DeepseekV4ForCausalLM(cfg).to(dtype).eval()
    if dtype in (torch.bfloat16, torch.float16):
        strict = tuple(getattr(twin, "_keep_in_fp32_modules_strict", None) or ())
        for name, p in twin.named_parameters():
            if any(k in name for k in strict):
                p.data = p.data.float()
    dev = next(twin.parameters()).device
    state = {k: v.to(dev) for k, v in hf_tensors(model) if not k.startswith("mtp.")}   # copied in each one's dtype
    missing, unexpected = twin.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise DeepInferError(f"internal: the transformers twin does not match our weights (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
    return twin


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _timed(device: str, fn):
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def prompts_for(cfg: VersusConfig, batch: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + batch)
    return torch.randint(5, vocab, (batch, cfg.isl), generator=g)


def run_transformers(twin, ids: torch.Tensor, cfg: VersusConfig) -> tuple[list[list[int]], float]:
    dev = next(twin.parameters()).device
    ids = ids.to(dev)
    mask = torch.ones_like(ids)

    def go():
        with torch.inference_mode():
            return twin.generate(input_ids=ids, attention_mask=mask, max_new_tokens=cfg.osl, min_new_tokens=cfg.osl,
                                 do_sample=False, pad_token_id=0)
    go()                                                                      # untimed: same shape first
    out, seconds = _timed(cfg.device, go)
    return out[:, ids.shape[1]:].tolist(), seconds


def run_deepinfer(llm, ids: torch.Tensor, cfg: VersusConfig) -> tuple[list[list[int]], float]:
    from deepinfer import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=cfg.osl, ignore_eos=True)
    prompts = [{"prompt_token_ids": row} for row in ids.tolist()]
    llm.generate(prompts, params, use_tqdm=False)                            # untimed: same shape first
    llm.engine.reset_stats()                                                 # the row's traffic: the timed run
    outs, seconds = _timed(cfg.device, lambda: llm.generate(prompts, params, use_tqdm=False))
    return [list(o.outputs[0].token_ids) for o in outs], seconds


def agreement(tokens: list[list[int]], against: list[list[int]] | None) -> dict | None:
    """Share of equal greedy tokens position by position, and of sequences whose first token agrees."""
    if against is None:
        return None
    pairs = [(a, b) for x, y in zip(tokens, against) for a, b in zip(x, y)]
    return {"tokens": sum(a == b for a, b in pairs) / len(pairs),
            "first_token": sum(x[0] == y[0] for x, y in zip(tokens, against)) / len(tokens)}


def load_versus_model(cfg: VersusConfig):
    """The V4 model every engine of the run holds (QAT fake-quant off, as transformers leaves it out)."""
    from deepinfer.api import resolve_model
    model = resolve_model(cfg.model, cfg.device, cfg.dtype, "dense", qat=False)
    if isinstance(model, (str, Path)):
        from deepinfer import load_model
        model = load_model(model, device=cfg.device, dtype=parse_dtype(cfg.dtype), qat_fake_quant=False)
    if model.cfg.TRANSFORMERS_CLASS is None:
        raise DeepInferError(f"deepinfer-bench versus compares with transformers 5.23, which runs deepseek_v4 only; "
                             f"{cfg.model} is {model.cfg.model_type!r}")
    return model


def speed_fields(tokens: list[list[int]], seconds: float, cfg: VersusConfig, against: list[list[int]] | None,
                 extra: dict) -> dict:
    """A row's measured fields: seconds, output tokens and tok/s, ms per decode step, agreement with transformers'
    greedy tokens (None for transformers' own rows)."""
    out = sum(len(t) for t in tokens)
    return {"seconds": seconds, "output_tokens": out, "output_tok_s": out / seconds,
            "ms_per_step": seconds * 1e3 / cfg.osl, "agreement_with_transformers": agreement(tokens, against),
            **extra}


def run_versus_bench(cfg: VersusConfig, run_dir: Path, echo=None) -> list[dict]:
    """Every (engine, batch) into run_dir/rows.jsonl (a new run); returns the rows."""
    echo = echo or (lambda s: None)
    cfg.check()
    check_model(cfg.model, "dense")
    folder = RunFolder(run_dir, "versus.json", resumable=False)
    folder.check()
    model = load_versus_model(cfg)
    with run_dir_guard(run_dir):
        env = environment()
        store = folder.open(json_text(asdict(cfg)))
        ident = identity(env, VERSUS_METHOD_VERSION, bench="versus", run_id=run_dir.name, model=cfg.model,
                         model_type=model.cfg.model_type, layers=model.cfg.num_hidden_layers, precision=cfg.dtype,
                         device=cfg.device, isl=cfg.isl, osl=cfg.osl, qat_fake_quant=False, seed=cfg.seed)
        on_error = OnError(rerun="rerun into a new run directory (--run-id / --out)")

        def record(engine: str, batch: int, measure) -> None:
            row = record_point(store, ident, f"{engine}/b{batch}", {"engine": engine, "batch": batch}, measure,
                               on_error, echo)
            echo(f"  {row['key']:<18} {row['seconds']:8.3f} s  {row['output_tok_s']:9.1f} tok/s  "
                 f"{row['ms_per_step']:8.2f} ms/step")

        reference_tokens = _transformers_rows(model, cfg, record) if "transformers" in cfg.engines else {}
        _deepinfer_rows(model, cfg, record, reference_tokens)
    return read_rows(run_dir)


def _transformers_rows(model, cfg: VersusConfig, record) -> dict[int, list[list[int]]]:
    """transformers' rows, its twin alone on the device; returns its greedy tokens per batch."""
    vocab, on_cpu = model.cfg.vocab_size, not cfg.device.startswith("cuda")
    if not on_cpu:
        model.to("cpu")                  # the twin alone on the device (a flash-width model twice may not fit)
        torch.cuda.empty_cache()
    twin = transformers_twin(model, parse_dtype(cfg.dtype), cfg.device)
    tokens_by_batch: dict[int, list[list[int]]] = {}

    def measure(b: int) -> dict:
        tokens, seconds = run_transformers(twin, prompts_for(cfg, b, vocab), cfg)
        tokens_by_batch[b] = tokens
        return speed_fields(tokens, seconds, cfg, None, {"transformers_attn": "eager"})
    for b in cfg.batches:
        record("transformers", b, lambda: measure(b))
    del twin
    gc.collect()
    if not on_cpu:
        torch.cuda.empty_cache()
        model.to(cfg.device)
    return tokens_by_batch


def _deepinfer_rows(model, cfg: VersusConfig, record, reference_tokens: dict) -> None:
    """deepinfer's rows with the default kernels, then with the reference backend."""
    from deepinfer import LLM
    vocab, max_len = model.cfg.vocab_size, cfg.isl + cfg.osl + POSITION_SLACK
    for engine, backend in (("deepinfer", None), ("reference", bench_backend("reference"))):
        if engine not in cfg.engines:
            continue
        args = {"kernel_backend": backend} if backend else {}
        llm = LLM(model=model, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed, qat_fake_quant=False,
                  max_num_seqs=max(cfg.batches), max_model_len=max_len,
                  max_num_batched_tokens=max(max(cfg.batches) * cfg.isl, 256), expert_traffic=True, **args)

        def measure(b: int) -> dict:
            tokens, seconds = run_deepinfer(llm, prompts_for(cfg, b, vocab), cfg)
            return speed_fields(tokens, seconds, cfg, reference_tokens.get(b),
                                {**kernel_fields(llm), "graph_replays": llm.stats.graph_replays,
                                 **traffic_fields(llm.stats)})
        for b in cfg.batches:
            record(engine, b, lambda: measure(b))
        del llm
        gc.collect()


def table(rows: list[dict]) -> list[str]:
    """Per batch: each engine's time, tok/s, ms per step, and its speed against transformers and the reference."""
    ok = {(r["engine"], r["batch"]): r for r in rows if r.get("status") == "ok"}
    lines = [f"{'engine':<13} {'batch':>5} {'seconds':>9} {'tok/s':>9} {'ms/step':>8} {'vs hf':>7} {'vs ref':>7} "
             f"{'agree':>6}  {TRAFFIC_HEADER}"]
    for (engine, b), r in sorted(ok.items(), key=lambda kv: (kv[0][1], ENGINES.index(kv[0][0]))):
        hf, ref = ok.get(("transformers", b)), ok.get(("reference", b))
        vs_hf = f"{hf['seconds'] / r['seconds']:.2f}x" if hf else "-"
        vs_ref = f"{ref['seconds'] / r['seconds']:.2f}x" if ref else "-"
        agree = r.get("agreement_with_transformers")
        lines.append(f"{engine:<13} {b:>5} {r['seconds']:>9.3f} {r['output_tok_s']:>9.1f} {r['ms_per_step']:>8.2f} "
                     f"{vs_hf:>7} {vs_ref:>7} {'-' if not agree else format(agree['tokens'], '.2f'):>6}  "
                     f"{traffic_cell(r):<24}")
    return lines
