"""make-checkpoint: a seeded random model of a preset, written in the real on-disk layout.

DeepSeek-V4.1 needs its tokenizer before its weights: the engram hashes compressed token ids, and
`engram_compressed_vocab_size` (which every hash multiplier depends on) is a property of the tokenizer.
So for V4.1 the tokenizer is trained first (deterministic, vocab = cfg.vocab_size), its compressed
vocabulary is written into the config, and the model is built from that config and bound to it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from ..config.presets import preset_config
from ..errors import DeepInferError
from ..models import build_model
from .random_init import init_random_weights
from .routers import CALIBRATION_VERSION, calibrate_routers, routed_gates
from .tokenizer import train_tokenizer
from .writer import SHARD_BYTES, check_out_dir, write_checkpoint

LARGE_SHARD_BYTES = 4 << 30


def bind_config_to_tokenizer(cfg, tokenizer):
    """A V4.1 config with engram_compressed_vocab_size (and engram_num_embeddings) taken from `tokenizer`."""
    from ..models.deepseek_v41.engram import compressed_token_map, engram_num_embeddings

    _, size = compressed_token_map(tokenizer)
    cfg = dataclasses.replace(cfg, engram_compressed_vocab_size=size)
    return dataclasses.replace(cfg, engram_num_embeddings=tuple(engram_num_embeddings(cfg)))


def preset_model_config(arch: str, preset: str, layers: int | None = None, engram_vocab_size: int | None = None):
    """(config, tokenizer) of a preset: V4.1 gets its tokenizer trained and its compressed vocab filled in;
    V4 returns tokenizer None (the writer trains the same deterministic one)."""
    cfg = preset_config(arch, preset, layers, engram_vocab_size=engram_vocab_size)
    if cfg.model_type != "deepseek_v41":
        return cfg, None
    tokenizer = train_tokenizer(cfg.vocab_size)
    return bind_config_to_tokenizer(cfg, tokenizer), tokenizer


TWIN_MAX_PARAMETERS = 500_000_000   # models up to this size calibrate on a float32 dense CPU twin (below)


def _drawn_model(cfg, tokenizer, seed: int, device: str, dtype: torch.dtype, qat_fake_quant: bool, **options):
    model = build_model(cfg, device, dtype, qat_fake_quant, **options)
    init_random_weights(model, seed)
    if tokenizer is not None and cfg.engram_layer_ids:
        model.bind_tokenizer(tokenizer)
    return model


def _random_model(cfg, tokenizer, seed: int, device: str, dtype: torch.dtype, qat_fake_quant: bool,
                  router_skew: float = 0.0, **options):
    """Weights drawn from `seed`, then the routers' selection biases calibrated (balanced, or to `router_skew`):
    docs/bench.md, routing of random models. The biases must be a property of (config, seed, skew) like every
    other weight, so a model's bf16 / fp32 / FP8-projection builds on one device and its checkpoint (built on the
    CPU) are one model: up to TWIN_MAX_PARAMETERS they are fitted on a float32, dense, QAT twin drawn from the same
    seed on the same device (the drawn values are bf16-representable, so the twin holds the same weights; draws
    differ between devices, so a CUDA build is its own model, as its weights are) and copied in. Larger models
    (flash widths, too big for a float32 twin) are fitted on their own forward, in their own dtype."""
    model = _drawn_model(cfg, tokenizer, seed, device, dtype, qat_fake_quant, **options)
    canonical = dtype == torch.float32 and qat_fake_quant and not options
    size = sum(t.numel() for t in (*model.parameters(), *model.buffers()))   # FP4-resident experts are buffers
    if canonical or size > TWIN_MAX_PARAMETERS:
        calibrate_routers(model, seed, router_skew)
        return model
    twin = _drawn_model(cfg, tokenizer, seed, device, torch.float32, True)
    calibrate_routers(twin, seed, router_skew)
    fitted = dict(routed_gates(twin))
    with torch.no_grad():
        for name, gate in routed_gates(model):
            gate.bias.copy_(fitted[name].bias)
    return model


def random_model(arch: str, preset: str, seed: int, layers: int | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, qat_fake_quant: bool = True,
                 engram_vocab_size: int | None = None, router_skew: float = 0.0, **options) -> torch.nn.Module:
    """Build a preset model on `device` and fill it from `seed` (no files involved; a V4.1 model comes bound to its
    tokenizer), its routers balanced (or skewed by `router_skew`, routers.py). bf16 loses nothing: every stored
    value is bf16-representable (FP8/FP4 dequantize exactly). `options` go to build_model (projection_storage="fp8")
    and the model class (V4.1: expert_storage="fp4")."""
    cfg, tokenizer = preset_model_config(arch, preset, layers, engram_vocab_size)
    return _random_model(cfg, tokenizer, seed, device, dtype, qat_fake_quant, router_skew, **options)


def make_checkpoint(arch: str, preset: str, fmt: str, seed: int, out: str | Path, layers: int | None = None,
                    overwrite: bool = False, engram_vocab_size: int | None = None, router_skew: float = 0.0) -> Path:
    check_out_dir(out, fmt, overwrite)  # fail before building a possibly huge model
    cfg, tokenizer = preset_model_config(arch, preset, layers, engram_vocab_size)
    options, shard_bytes = {}, SHARD_BYTES
    if preset != "tiny":
        # Released dims: V4.1's routed experts stay FP4-packed in memory (27 GB per layer dense in bf16, 7.6 GB
        # packed) and shards are release-sized. The tiny preset keeps dense experts and 1 MiB shards, so the
        # multi-shard path is exercised and its values match random_model's exactly.
        shard_bytes = LARGE_SHARD_BYTES
        if cfg.model_type == "deepseek_v41" and cfg.quant is not None and cfg.quant.expert_dtype == "fp4":
            options["expert_storage"] = "fp4"
    model = _random_model(cfg, tokenizer, seed, "cpu", torch.bfloat16, True, router_skew, **options)
    return write_checkpoint(model, out, fmt, overwrite=overwrite, tokenizer=tokenizer, shard_bytes=shard_bytes)


def embedded_tiny_dir(arch: str = "deepseek_v41", seed: int = 0) -> Path:
    """The embedded default model: the tiny preset, built once into the user cache. The directory name
    carries the preset's config hash and the router calibration's version, so a changed preset or calibration
    builds afresh instead of reusing a stale copy."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deepinfer" / "models"
    tag = f"{preset_config(arch, 'tiny').config_hash()[:8]}-r{CALIBRATION_VERSION}"   # r: router calibration
    out = cache / f"{arch}-tiny-seed{seed}-{tag}"
    if not (out / "config.json").is_file():
        try:
            make_checkpoint(arch, "tiny", "deepseek", seed, out, overwrite=True)
        except (DeepInferError, OSError):
            if not (out / "config.json").is_file():   # else another process finished the same build first
                raise
    return out


def random_preset_model(spec: str, device: str, dtype: str, expert_storage: str = "dense", qat: bool = True,
                        projection_storage: str = "dense"):
    """random:ARCH:PRESET:LAYERS[:skew=S] -> a model with seed-0 random weights built on the device, its routers
    calibrated (balanced, or skewed by S) (V4.1: engram tables reduced to 1000 rows), its tokenizer written to a
    temporary directory (LLM reads tokenizer.json from model.checkpoint_dir). For benchmarks of released widths
    without writing a checkpoint."""
    import tempfile

    from ..validate import parse_dtype, parse_random_spec
    from .tokenizer import write_tokenizer
    rs = parse_random_spec(spec)
    options = {"expert_storage": expert_storage} if rs.arch == "deepseek_v41" else {}
    options["projection_storage"] = projection_storage
    engram = {"engram_vocab_size": 1000} if rs.arch == "deepseek_v41" else {}
    model = random_model(rs.arch, rs.preset, 0, rs.layers, device, parse_dtype(dtype), qat, router_skew=rs.skew,
                         **engram, **options)
    cfg, tokenizer = preset_model_config(rs.arch, rs.preset, rs.layers, **engram)
    model.checkpoint_dir = Path(tempfile.mkdtemp(prefix="deepinfer-tok-"))
    write_tokenizer(model.checkpoint_dir, cfg.vocab_size, cfg.max_position_embeddings, tokenizer=tokenizer)
    return model
