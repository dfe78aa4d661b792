"""make-checkpoint: write a model's weights in the real on-disk layout (DeepSeek or transformers names).

The DeepSeek format is quantized like the release (FP8 blocks of the config's weight_block_size with
e8m0 scales for dense projections, FP4 e2m1 experts with one e8m0 scale per 32 along K; V4.1 also
stores its engram tables as FP8 rows with one e8m0 scale per 32 channels); the HF format holds the
same values dequantized (V4: transformers' renamed, stacked-expert names; V4.1: `model.` + DeepSeek's
names, `lm_head`, experts per expert, and an all-ones `engram.embed.scale` so transformers' strict
load finds every parameter; it ignores the scale of a float table, and so do we). Everything is written into a temporary sibling directory that is renamed into
place at the end, so an interrupted run never leaves a complete-looking checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from deepinfer.kernels.quant import dequantize_fp4, quantize_fp4, quantize_fp8_blocks

from ..errors import DeepInferError
from .loader import INDEX_FILE
from .names import checkpoint_tensors, ds_to_hf, hf_experts_prefix
from .random_init import ENGRAM_ROW_BLOCK, is_engram_table, is_fp32_tensor, is_fp8_weight
from .tokenizer import write_tokenizer

SHARD_BYTES = 1 << 20  # small shards so tiny checkpoints exercise the multi-shard path


def _per_expert(model: torch.nn.Module, keep_fp4: bool = False):
    """(name, tensor, kind) in name order, stacked experts split into DeepSeek's `experts.{j}.w*.weight`.
    kind: "expert", "plain", or "raw" (FP4-resident expert bytes passed through as stored, keep_fp4=True;
    without it they are dequantized and yielded as "expert")."""
    tensors = checkpoint_tensors(model)
    for name in sorted(tensors):
        t = tensors[name].detach()
        if ".ffn.experts.w" not in name:
            yield name, t, "plain"
            continue
        base, w = name.rsplit(".", 1)
        if w.endswith("_scale"):
            continue                                   # written with its packed weights below
        if w.endswith("_fp4"):
            w = w[: -len("_fp4")]
            scale = tensors[f"{base}.{w}_scale"].detach()
            for j in range(t.shape[0]):
                if keep_fp4:
                    yield f"{base}.{j}.{w}.weight", t[j].view(torch.int8), "raw"
                    yield f"{base}.{j}.{w}.scale", scale[j].view(torch.float8_e8m0fnu), "raw"
                else:
                    yield f"{base}.{j}.{w}.weight", dequantize_fp4(t[j], scale[j], 32, torch.float32), "expert"
            continue
        for j in range(t.shape[0]):
            yield f"{base}.{j}.{w}.weight", t[j], "expert"


def deepseek_tensors(model: torch.nn.Module):
    """Yield (name, tensor) in DeepSeek names and release dtypes (quantized when the config says so)."""
    quant, family = model.cfg.quant, model.cfg.model_type
    keep_fp4 = quant is not None and quant.expert_dtype == "fp4"
    for name, t, kind in _per_expert(model, keep_fp4):
        if kind == "raw":
            yield name, t
        else:
            yield from _stored(name, t, quant, family, expert=kind == "expert")


def _stored(name: str, t: torch.Tensor, quant, family: str, expert: bool):
    if not t.dtype.is_floating_point:
        yield name, t
    elif quant is not None and expert and quant.expert_dtype == "fp4":
        packed, scale = quantize_fp4(t.float())
        yield name, packed
        yield name[: -len(".weight")] + ".scale", scale
    elif quant is not None and (expert or is_fp8_weight(name, family)):
        w, scale = quantize_fp8_blocks(t.float(), quant.weight_block_size, quant.scale_fmt)
        yield name, w
        yield name[: -len(".weight")] + ".scale", scale
    elif quant is not None and family == "deepseek_v41" and is_engram_table(name):
        w, scale = quantize_fp8_blocks(t.float(), ENGRAM_ROW_BLOCK, quant.scale_fmt)   # [rows, head_dim / 32]
        yield name, w
        yield name[: -len(".weight")] + ".scale", scale
    else:
        yield name, _float(t, name, family)


def _float(t: torch.Tensor, name: str, family: str) -> torch.Tensor:
    """An unquantized floating tensor in its release dtype (F32 or BF16)."""
    return t.float() if is_fp32_tensor(name, family) else t.to(torch.bfloat16)


def hf_tensors(model: torch.nn.Module):
    """Yield (name, tensor) in transformers' names: V4 experts stacked as gate_up_proj / down_proj."""
    if model.cfg.model_type == "deepseek_v41":
        yield from _hf_tensors_v41(model)
        return
    tensors = checkpoint_tensors(model)
    for name in sorted(tensors):
        t = tensors[name].detach()
        if ".ffn.experts.w" in name:
            base, w = name.rsplit(".", 1)
            if w == "w3":
                continue
            hf_base = hf_experts_prefix(base)
            if w == "w1":
                yield f"{hf_base}.gate_up_proj", torch.cat([t, tensors[f"{base}.w3"]], dim=1).to(torch.bfloat16)
            else:
                yield f"{hf_base}.down_proj", t.to(torch.bfloat16)
            continue
        hf = ds_to_hf(name)
        assert hf is not None, name
        yield hf, t if not t.dtype.is_floating_point else (t.float() if is_fp32_tensor(name) else t.to(torch.bfloat16))


def _hf_tensors_v41(model: torch.nn.Module):
    """V4.1 in transformers' names: `model.` + DeepSeek's, `lm_head`, experts per expert, dequantized."""
    family = model.cfg.model_type
    for name, t, kind in _per_expert(model):
        if kind == "expert":
            yield ds_to_hf(name, family), t.to(torch.bfloat16)
            continue
        yield ds_to_hf(name, family), t if not t.dtype.is_floating_point else _float(t, name, family)
        if is_engram_table(name):
            rows, dim = t.shape
            scale = torch.ones(rows, dim // ENGRAM_ROW_BLOCK[1], dtype=torch.bfloat16, device=t.device)
            yield ds_to_hf(name[: -len(".weight")] + ".scale", family), scale


def write_shards(tensors, out_dir: Path, shard_bytes: int = SHARD_BYTES) -> None:
    """Group tensors into shards of about `shard_bytes`, writing each as soon as it is full (a large model
    is never held twice); then name them `model-i-of-n` and write the index."""
    written, current, size = [], {}, 0

    def flush():
        tmp_name = f".shard-{len(written):05d}.safetensors"
        save_file(current, str(out_dir / tmp_name), metadata={"format": "pt"})
        written.append((tmp_name, {k: v.numel() * v.element_size() for k, v in current.items()}))

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > shard_bytes:
            flush()
            current, size = {}, 0
        current[name] = t.contiguous().cpu()
        size += nbytes
    if current:
        flush()
    weight_map, total = {}, 0
    for i, (tmp_name, sizes) in enumerate(written):
        fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(out_dir / tmp_name, out_dir / fname)
        for name, nbytes in sizes.items():
            weight_map[name] = fname
            total += nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))


def check_out_dir(out: str | Path, fmt: str, overwrite: bool) -> Path:
    """Refuse a bad --format or --out before any work is done."""
    if fmt not in ("deepseek", "hf"):
        raise DeepInferError(f"--format must be 'deepseek' or 'hf', got {fmt!r}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DeepInferError(f"{out} exists and is not a directory; choose another --out")
    try:
        non_empty = out.exists() and any(out.iterdir())
    except OSError as err:
        raise DeepInferError(f"cannot list {out} ({err.strerror}); choose another --out") from None
    if non_empty and not overwrite:
        raise DeepInferError(f"{out} already exists and is not empty; choose another --out or pass --overwrite")
    if non_empty and not (out / "config.json").is_file():
        # --overwrite deletes the directory: only ever do that to something that is a checkpoint.
        raise DeepInferError(f"{out} is not empty and holds no config.json, so it is not a checkpoint; "
                             f"--overwrite only replaces checkpoint directories: choose another --out")
    return out


def write_checkpoint(model: torch.nn.Module, out: str | Path, fmt: str, overwrite: bool = False,
                     shard_bytes: int = SHARD_BYTES, tokenizer=None) -> Path:
    """Write config.json, shards + index, tokenizer into `out` (atomically: temp dir, then rename).
    `tokenizer` (a tokenizers.Tokenizer): the one to write; default: the deterministic one trained for the
    config's vocab_size (the one a V4.1 model's engram hashes with, see make.random_model)."""
    out = check_out_dir(out, fmt, overwrite)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as err:
        raise DeepInferError(f"cannot write to {out.parent} ({err.strerror}); choose a writable --out") from None
    try:
        cfg = model.cfg
        config = cfg.to_deepseek_dict() if fmt == "deepseek" else cfg.to_hf_dict()
        if fmt == "hf":
            config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_shards(deepseek_tensors(model) if fmt == "deepseek" else hf_tensors(model), tmp, shard_bytes)
        write_tokenizer(tmp, cfg.vocab_size, model_max_length=cfg.max_position_embeddings, tokenizer=tokenizer)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
