"""deepinfer.load_model: checkpoint directory or hub id -> a model on the requested device; resolve_model: any model
spec an entry point takes -> what load_model / LLM build from."""

from __future__ import annotations

import dataclasses
import logging
import os

import torch
from safetensors import safe_open

from .checkpoint.hub import resolve_model_dir
from .checkpoint.loader import load_checkpoint, shard_map
from .config import load_model_config
from .errors import CheckpointError, DeepInferError
from .models import build_model, check_projection_storage
from .models.deepseek_v41.host_table import host_engram_tables, keep_engram_tables_on_host
from .validate import EMBEDDED, check_expert_storage, check_model_spec, parse_dtype, random_spec_arch

log = logging.getLogger("deepinfer")
# LLM arguments that place a family's own weights, passed to load_model as they are (the runtime names none)
WEIGHT_PLACEMENT_DEFAULTS = {"engram_table_device": None}


def host_resident_weights(device: str, args: dict) -> bool:
    """Whether the placement arguments put weights in host memory (their forwards read the host: no CUDA graphs);
    a bad value is one line before the model loads."""
    return host_engram_tables(device, args["engram_table_device"])


def keep_weights_on_host(model: torch.nn.Module, pin: bool) -> None:
    """A built model's host-resident weights moved to host memory (pinned: a GPU run, for faster row copies)."""
    keep_engram_tables_on_host(model, pin)

def load_model(path_or_id: str | os.PathLike | None = None, device: str | torch.device = "cpu",
               dtype: str | torch.dtype = torch.float32, qat_fake_quant: bool = True,
               keep_quantized: bool = False, expert_storage: str = "dense", projection_storage: str = "dense",
               engram_table_device: str | None = None, prepare=None, **unsupported) -> torch.nn.Module:
    """Load a deepseek_v4 / deepseek_v41 checkpoint (DeepSeek or transformers names, bf16/FP8/FP4) for inference.

    qat_fake_quant keeps DeepSeek's quantization-aware activation steps (FP8 K=V latent, FP4 indexer);
    turn it off to compare with transformers, which leaves them out. keep_quantized keeps the on-disk
    FP8/FP4 tensors attached to their modules (`.quantized`) beside the dequantized weights.
    A V4.1 model with engram layers comes bound to the checkpoint's tokenizer.json (the engram hashes
    compressed token ids); that is checked before any weight is read.
    expert_storage="fp4" (V4.1) keeps the routed experts as the checkpoint stores them (packed e2m1 + e8m0
    scales, 0.56 bytes per weight) and dequantizes each when it runs. projection_storage="fp8" keeps the
    projections the release stores as FP8 blocks in that form and runs them through `fp8_linear` (DeepSeek's W8A8
    recipe: activations quantized per 1 x block on the fly, V4 128 / V4.1 32); "dense" dequantizes them on load,
    as transformers does. engram_table_device="cpu" (V4.1) keeps the engram tables in host memory (pinned on a GPU
    run) and gathers the rows a batch needs per forward (models/deepseek_v41/host_table.py); None: on `device`.
    prepare(model) runs on the unmaterialized model before any weight is read: LLM's expert parallelism allocates
    only its rank's expert slots there, and the loader then reads only those experts' tensors.
    """
    from .env import check_environment
    from .validate import check_device, check_flag, refuse_unsupported
    check_environment()
    refuse_unsupported("load_model", unsupported, "path_or_id, device, dtype, qat_fake_quant, keep_quantized, "
                                                  "expert_storage, projection_storage, engram_table_device, prepare")
    if isinstance(path_or_id, torch.nn.Module) or (isinstance(path_or_id, str) and path_or_id.startswith("random:")):
        raise DeepInferError("load_model reads a checkpoint directory or hub id; pass random:... or a built model to "
                             "LLM instead")
    check_model_spec(path_or_id)
    device = check_device(device)
    check_flag("qat_fake_quant", qat_fake_quant)
    check_flag("keep_quantized", keep_quantized)
    check_projection_storage(projection_storage)      # a bad name is one line before anything is read
    host_tables = host_engram_tables(device, engram_table_device)
    if path_or_id == EMBEDDED:
        from .checkpoint.make import embedded_tiny_dir
        path_or_id = embedded_tiny_dir()
    ckpt_dir = resolve_model_dir(path_or_id)
    cfg = _without_absent_mtp(load_model_config(ckpt_dir), ckpt_dir)
    options = {"projection_storage": projection_storage}             # build_model checks it against cfg
    if check_expert_storage(expert_storage, cfg.model_type) != "dense":
        options["expert_storage"] = expert_storage
    model = build_model(cfg, device, parse_dtype(dtype), qat_fake_quant,
                        prepare=_preparation(prepare, host_tables, torch.device(device).type == "cuda"), **options)
    if cfg.model_type == "deepseek_v41" and cfg.engram_layer_ids:
        _bind_tokenizer(model, ckpt_dir)
    load_checkpoint(model, ckpt_dir, keep_quantized=keep_quantized)
    model.checkpoint_dir = ckpt_dir
    return model


def _preparation(prepare, host_tables: bool, pin: bool):
    """What build_model runs on the unmaterialized model: the caller's hook, then the engram tables to the host."""
    if not host_tables:
        return prepare

    def both(model):
        if prepare is not None:
            prepare(model)
        keep_engram_tables_on_host(model, pin)
    return both


def resolve_model(model, device: str, dtype, expert_storage: str = "dense", qat: bool = True,
                  projection_storage: str = "dense"):
    """A checked model spec -> what load_model / LLM build from: None or 'tiny' -> the embedded checkpoint dir
    (built once), random:ARCH:PRESET:LAYERS -> a model built on `device`, a model object or a directory / hub id
    unchanged."""
    model = check_model_spec(model)
    if model is None or (isinstance(model, str) and model == EMBEDDED):
        from .checkpoint.make import embedded_tiny_dir
        return embedded_tiny_dir()
    if isinstance(model, str) and model.startswith("random:"):
        from .checkpoint.make import random_preset_model
        check_expert_storage(expert_storage, random_spec_arch(model))
        return random_preset_model(model, device, dtype, expert_storage, qat, projection_storage)
    return model


def _bind_tokenizer(model, ckpt_dir) -> None:
    """model.bind_tokenizer(tokenizer.json of the checkpoint); every failure is one CheckpointError line."""
    from .checkpoint.tokenizer import read_tokenizer
    tok_file = ckpt_dir / "tokenizer.json"
    tokenizer = read_tokenizer(ckpt_dir, "this model's engram layers need (they hash the tokenizer's compressed "
                                         "token ids)")
    try:
        model.bind_tokenizer(tokenizer)
    except ValueError as err:
        raise CheckpointError(f"{tok_file} does not fit config.json: {' '.join(str(err).split())}") from None


def _without_absent_mtp(cfg, ckpt_dir):
    """transformers drops mtp.* when it saves: such a checkpoint loads with its MTP layers disabled
    (V4.1: without its DSpark draft stages, num_nextn_predict_layers=0)."""
    if cfg.num_nextn_predict_layers == 0:
        return cfg
    for shard, names in shard_map(ckpt_dir).items():
        if names is None:
            try:
                with safe_open(str(ckpt_dir / shard), framework="pt") as f:
                    names = list(f.keys())
            except Exception:
                return cfg  # the loader reports the unreadable shard with its own message
        if any(n.startswith(("mtp.", "model.mtp.")) for n in names):
            return cfg
    log.info("%s has no mtp.* tensors: loading without the MTP / DSpark draft layer(s)", ckpt_dir)
    return dataclasses.replace(cfg, num_nextn_predict_layers=0)
