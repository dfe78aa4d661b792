"""make-checkpoint: a seeded random model of a preset, written in the real on-disk layout."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..config.presets import preset_config
from ..models import build_model
from .random_init import init_random_weights
from .writer import check_out_dir, write_checkpoint


def random_model(arch: str, preset: str, seed: int, layers: int | None = None, device: str = "cpu",
                 dtype: torch.dtype = torch.bfloat16, qat_fake_quant: bool = True) -> torch.nn.Module:
    """Build a preset model on `device` and fill it from `seed` (no files involved).
    bf16 loses nothing: every stored value is bf16-representable (FP8/FP4 dequantize exactly)."""
    model = build_model(preset_config(arch, preset, layers), device, dtype, qat_fake_quant)
    init_random_weights(model, seed)
    return model


def make_checkpoint(arch: str, preset: str, fmt: str, seed: int, out: str | Path, layers: int | None = None,
                    overwrite: bool = False) -> Path:
    check_out_dir(out, fmt, overwrite)  # fail before building a possibly huge model
    model = random_model(arch, preset, seed, layers)
    return write_checkpoint(model, out, fmt, overwrite=overwrite)


def embedded_tiny_dir(arch: str = "deepseek_v4", seed: int = 0) -> Path:
    """The embedded default model: the tiny preset, built once into the user cache."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deepinfer" / "models"
    out = cache / f"{arch}-tiny-seed{seed}"
    if not (out / "config.json").is_file():
        make_checkpoint(arch, "tiny", "deepseek", seed, out, overwrite=True)
    return out
