"""A bench's own options against the limits of the model and the engine, before anything is built.

Each bench turns its options into engine arguments (max_model_len = --isl + --osl + slack, max_num_seqs = the
largest --batch, a kernel backend of its own choosing). Left to the engine, a bad value would be refused in the
engine's words ("max_model_len=100077 must be in 1..4096"), naming an argument the user never gave, and often after
minutes of model build. The checks here read the model's config alone (no weights) and say which bench option
to change, and to what."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deepinfer.errors import DeepInferError

INVARIANT_VAR = "DEEPINFER_BATCH_INVARIANT"
POSITION_SLACK = 8        # positions the benches' max_model_len keeps beyond isl + osl (+ drafts)


@dataclass(frozen=True)
class ModelLimits:
    positions: int      # max_position_embeddings: the ceiling of max_model_len
    vocab_size: int     # token ids run 0 .. vocab_size - 1


def model_limits(spec) -> ModelLimits | None:
    """The limits of a checked model spec, from its config alone: a random:ARCH:PRESET:LAYERS preset, the embedded
    tiny model's preset, a directory's (or DEEPINFER_HF_MODEL_DIR's) config.json, a hub id's config.json when the
    hub cache has it. None when the config is not here yet (a hub id still to download): the engine checks its
    arguments once the model loads."""
    cfg = _model_config(spec)
    return None if cfg is None else ModelLimits(cfg.max_position_embeddings, cfg.vocab_size)


def _model_config(spec):
    from deepinfer.config import load_model_config
    from deepinfer.config.presets import preset_config
    from deepinfer.validate import EMBEDDED, parse_random_spec
    if not isinstance(spec, (str, Path)):
        return getattr(spec, "cfg", None)                          # a built model
    if isinstance(spec, str) and spec.startswith("random:"):
        rs = parse_random_spec(spec)
        return preset_config(rs.arch, rs.preset, rs.layers)
    if spec == EMBEDDED:
        return preset_config("deepseek_v41", "tiny")               # checkpoint/make.embedded_tiny_dir's preset
    from deepinfer.checkpoint.hub import locate_model
    where = locate_model(spec)
    if isinstance(where, Path):
        return load_model_config(where)
    from huggingface_hub import try_to_load_from_cache
    cached = try_to_load_from_cache(where, "config.json")
    return load_model_config(cached) if isinstance(cached, str) else None


@dataclass(frozen=True)
class Term:
    """One bench option's share of a sequence's positions: `per` x value (per: positions per unit)."""
    option: str
    value: int
    minimum: int = 1
    per: int = 1

    @property
    def positions(self) -> int:
        return self.per * self.value

    def __str__(self) -> str:
        return f"{self.option} {self.value}" + (f" (x{self.per})" if self.per != 1 else "")


def check_positions(model: str, limits: ModelLimits | None, terms: list[Term], reserved: int = 0) -> None:
    """The positions a bench sizes max_model_len to (sum of its terms + what it reserves) against the model's;
    refused naming the options, with the largest one's highest value that fits (or every option, when no value
    of that one would)."""
    needed = sum(t.positions for t in terms) + reserved
    if limits is None or needed <= limits.positions:
        return
    given = " + ".join(map(str, terms)) + (f" + {reserved} the bench reserves" if reserved else "")
    largest = max(terms, key=lambda t: t.positions)
    room = (limits.positions - (needed - largest.positions)) // largest.per
    advice = f"use {largest.option} <= {room}" if room >= largest.minimum else \
        f"lower {' / '.join(t.option for t in terms)}"
    raise DeepInferError(f"{given} needs {needed} positions, but --model {model} has {limits.positions} "
                         f"(max_position_embeddings): {advice}")


def default_step_budget() -> int:
    """The engine's default max_num_batched_tokens (a step's token budget), which the benches that do not size it
    build with."""
    from deepinfer.llm import ENGINE_DEFAULTS
    return ENGINE_DEFAULTS["max_num_batched_tokens"]


def check_concurrency(option: str, values, budget: int) -> None:
    """Every running sequence needs a token of each step's budget, so a concurrency above it cannot run at once."""
    if not values:
        raise DeepInferError(f"{option}: give at least one value")
    worst = max(values)
    if worst > budget:
        raise DeepInferError(f"{option} {worst}: each of that many sequences needs a token of every step, and the "
                             f"engine's step budget is {budget} tokens (max_num_batched_tokens): use {option} <= "
                             f"{budget}")


def batch_invariant_env() -> bool:
    """DEEPINFER_BATCH_INVARIANT's value (engine/env.py reads and checks it)."""
    from deepinfer.env import read
    return bool(read(INVARIANT_VAR))


def check_kernel_backend(requested: str | None, device: str) -> str:
    """The backend set a bench's engine will run: --kernel-backend when given (checked here against the device and
    DEEPINFER_BATCH_INVARIANT, naming the option), else the engine's own choice (DEEPINFER_KERNEL_BACKEND, the
    device's default, its batch-invariant partner under DEEPINFER_BATCH_INVARIANT=1)."""
    from deepinfer.env import default_backend, kernel_backend
    check_invariant_backend(requested)
    if requested is not None and requested.startswith("triton") and default_backend(device) != "triton":
        raise DeepInferError(f"--kernel-backend {requested} needs a CUDA device with compute capability >= 8.9 and "
                             f"Triton; on {device} use --kernel-backend reference or invariant")
    return kernel_backend(requested, device)


def check_invariant_backend(requested: str | None) -> None:
    """--kernel-backend against DEEPINFER_BATCH_INVARIANT=1: a set that is not batch-invariant is one error line."""
    from deepinfer.kernels.registry import INVARIANT_OF
    if requested is not None and batch_invariant_env() and INVARIANT_OF[requested] != requested:
        raise DeepInferError(f"--kernel-backend {requested} is not batch-invariant but {INVARIANT_VAR}=1 asks for "
                             f"batch-invariant kernels: use --kernel-backend {INVARIANT_OF[requested]}, leave "
                             f"--kernel-backend out, or unset {INVARIANT_VAR}")


def bench_backend(name: str) -> str:
    """A kernel backend a bench picks itself (not the user's --kernel-backend): its batch-invariant partner under
    DEEPINFER_BATCH_INVARIANT=1, as the engine does with its own default."""
    from deepinfer.kernels.registry import INVARIANT_OF
    return INVARIANT_OF[name] if batch_invariant_env() else name


def check_model(spec: str, expert_storage: str = "dense") -> None:
    """The model's form (deepinfer.validate) and, for random:ARCH:PRESET:LAYERS, that the preset has that many
    layers, without building anything (one error line if it is wrong)."""
    from deepinfer.validate import check_expert_storage, check_model_spec
    check_model_spec(spec)
    if spec.startswith("random:"):
        check_expert_storage(expert_storage, spec.split(":")[1])
        from deepinfer.config.presets import preset_config
        _, arch, preset, layers = spec.split(":")
        preset_config(arch, preset, int(layers))


def check_expert_parallel(spec, sizes: tuple[int, ...], redundant: int) -> None:
    """--ep / --eplb-redundant against the model's routed experts, from its config alone: every EP size must divide
    the experts (plus the redundant slots) of each MoE layer."""
    cfg = _model_config(spec) if sizes else None
    if cfg is None:
        return
    slots = cfg.n_routed_experts + redundant
    bad = [n for n in sizes if slots % n]
    if bad:
        what = f"{cfg.n_routed_experts} routed experts" + (f" + {redundant} redundant slots" if redundant else "")
        raise DeepInferError(f"--ep {','.join(map(str, bad))}: the model's {what} per layer do not divide over "
                             f"{bad[0]} ranks; use EP sizes that divide {slots}")
