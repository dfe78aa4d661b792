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

import errno
import json
import logging
import os
import re
import secrets
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from deepinfer.kernels.quant import dequantize_fp4, quantize_fp4, quantize_fp8_blocks

from ..errors import DeepInferError
from .loader import INDEX_FILE
from .names import checkpoint_tensors, ds_to_hf, hf_experts_prefix
from .random_init import ENGRAM_ROW_BLOCK, is_engram_table, is_fp32_tensor, is_fp8_weight
from .tokenizer import write_tokenizer

log = logging.getLogger("deepinfer")

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
    is never held twice); then name them `model-i-of-n` and write the index. A failed write raises OSError
    (safetensors' own I/O errors are turned into one, with the shard's path)."""
    written, current, size = [], {}, 0

    def flush():
        tmp_name = f".shard-{len(written):05d}.safetensors"
        _save_file(current, out_dir / tmp_name)
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


def _save_file(tensors: dict, path: Path) -> None:
    """safetensors' save_file, with its I/O failures ("... (os error 28)") raised as the OSError they are, and
    the file mode of a normal write (0o666 & ~umask)."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as err:
        code = re.search(r"os error (\d+)", str(err))
        if code is None:
            raise
        raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
    os.chmod(path, 0o666 & ~_umask())     # safetensors creates its files 0o600


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# ---- the output directory: checked before any work, replaced atomically, nothing left behind on failure

_ADVICE = {
    errno.ENOSPC: "free some space on that disk or choose another --out",
    errno.EDQUOT: "free some space (your disk quota is used up) or choose another --out",
    errno.EROFS: "choose an --out on a writable filesystem",
    errno.EACCES: "choose an --out you can write to, or fix its permissions",
    errno.EPERM: "choose an --out you can write to, or fix its permissions",
    errno.EBUSY: "it is a mount point or in use by another process: use a directory inside it or choose another --out",
    errno.ENOTDIR: "part of the path is not a directory: choose another --out",
    errno.ENAMETOOLONG: "choose a shorter --out",
    errno.ENOTEMPTY: "another process wrote it meanwhile: choose another --out or pass --overwrite",
    errno.EEXIST: "another process wrote it meanwhile: choose another --out or pass --overwrite",
}


def os_error_line(err: OSError, what: str, hide: Path | None = None) -> str:
    """One line for an OSError met while doing `what` (e.g. "cannot write the checkpoint to /x"): the path
    (left out when it lies under `hide`, a temporary directory that no longer exists), the system's reason
    and what to do."""
    name = os.fsdecode(err.filename) if err.filename else ""
    if hide is not None and name and (name == str(hide) or name.startswith(f"{hide}{os.sep}")):
        name = ""
    where = f" ({name})" if name else ""
    reason = err.strerror or str(err) or type(err).__name__
    advice = _ADVICE.get(err.errno, "check the path and its permissions, or choose another --out")
    return f"{what}{where}: {reason}; {advice}"


def _unique_name(parent: Path, prefix: str) -> Path:
    while True:
        path = parent / f"{prefix}{secrets.token_hex(4)}"
        if not os.path.lexists(path):
            return path


def _fresh_dir(parent: Path, prefix: str) -> Path:
    """A new directory `parent/prefix<random>` with the mode any mkdir gets (0o777 & ~umask), unlike
    tempfile.mkdtemp's 0o700, so the checkpoint it becomes is readable like any other directory."""
    while True:
        path = _unique_name(parent, prefix)
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue


def _nearest_existing(path: Path) -> Path:
    while not os.path.lexists(path) and path.parent != path:
        path = path.parent
    return path


def check_out_dir(out: str | Path, fmt: str, overwrite: bool) -> Path:
    """Refuse a bad --format or --out before any work is done: a file, a non-empty directory (without
    --overwrite, or one that holds no checkpoint), a mount point (it can't be renamed into place), a place
    that can't be written (read-only filesystem, permissions: probed by making and removing an empty
    directory where the temporary one will go), or an old checkpoint whose files can't be deleted."""
    if fmt not in ("deepseek", "hf"):
        raise DeepInferError(f"--format must be 'deepseek' or 'hf', got {fmt!r}")
    if not str(out).strip():
        raise DeepInferError("--out is empty; give the directory to write the checkpoint to")
    out = Path(out)
    if out.is_symlink() and out.is_dir():
        out = Path(os.path.realpath(out))     # write where it points; the link itself stays
    if out.exists() and not out.is_dir():
        raise DeepInferError(f"{out} exists and is not a directory; choose another --out")
    if out.is_dir() and os.path.ismount(out):
        raise DeepInferError(f"{out} is a mount point, which make-checkpoint cannot replace (it writes a temporary "
                             f"sibling and renames it into place); use a directory inside it, e.g. --out "
                             f"{out / 'checkpoint'}")
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
    base = _nearest_existing(out.parent)
    if not base.is_dir():
        raise DeepInferError(f"cannot create {out}: {base} is not a directory; choose another --out")
    try:
        os.rmdir(_fresh_dir(base, f".{out.name}.probe-"))
    except OSError as err:
        raise DeepInferError(os_error_line(err, f"cannot write the checkpoint to {out}: {base} is not writable",
                                           hide=base)) from None
    if non_empty and not os.access(out, os.W_OK | os.X_OK):
        raise DeepInferError(f"cannot replace {out}: its files cannot be deleted (no write permission on the "
                             f"directory); fix its permissions or choose another --out")
    return out


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished `tmp` to `out`. An existing `out` is renamed aside first and deleted only once the
    new one is in place; if the move fails it is put back, so a failed --overwrite keeps the old checkpoint."""
    if not os.path.lexists(out):
        os.rename(tmp, out)
        return
    aside = _unique_name(out.parent, f".{out.name}.old-")
    os.rename(out, aside)
    try:
        os.rename(tmp, out)
    except BaseException as err:
        try:
            os.rename(aside, out)
        except OSError:
            raise DeepInferError(f"cannot write the checkpoint to {out} ({err}), and the old checkpoint, moved "
                                 f"aside to {aside}, could not be moved back: rename it to {out} by hand") from None
        raise
    if os.path.islink(aside):
        os.unlink(aside)
    else:
        shutil.rmtree(aside, ignore_errors=True)
    if os.path.lexists(aside):
        log.warning("wrote %s but could not delete the old checkpoint moved aside to %s; remove it by hand",
                    out, aside)


def write_checkpoint(model: torch.nn.Module, out: str | Path, fmt: str, overwrite: bool = False,
                     shard_bytes: int = SHARD_BYTES, tokenizer=None) -> Path:
    """Write config.json, shards + index, tokenizer into `out` (atomically: temp dir, then rename).
    `tokenizer` (a tokenizers.Tokenizer): the one to write; default: the deterministic one trained for the
    config's vocab_size (the one a V4.1 model's engram hashes with, see make.random_model).

    The directory and files get the modes of any normal write (0o777 / 0o666 & ~umask). Any OSError (disk
    full, read-only, permissions, busy) is one DeepInferError line naming the path; the temporary directory
    and any parent directories made for `out` are removed, and an existing `out` (--overwrite) is kept."""
    from ..models import projection_storage_of
    if projection_storage_of(model) != "dense":
        raise DeepInferError("write_checkpoint: this model keeps its FP8 projections resident "
                             "(projection_storage='fp8'); export a model built with projection_storage='dense'")
    out = check_out_dir(out, fmt, overwrite)
    made, parent = [], out.parent
    while not os.path.lexists(parent):
        made.append(parent)
        parent = parent.parent
    tmp = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _fresh_dir(out.parent, f".{out.name}.tmp-")
        cfg = model.cfg
        config = cfg.to_deepseek_dict() if fmt == "deepseek" else cfg.to_hf_dict()
        if fmt == "hf":
            config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        write_shards(deepseek_tensors(model) if fmt == "deepseek" else hf_tensors(model), tmp, shard_bytes)
        write_tokenizer(tmp, cfg.vocab_size, model_max_length=cfg.max_position_embeddings, tokenizer=tokenizer)
        _replace_dir(tmp, out)
    except BaseException as err:
        left = []
        if tmp is not None and os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            if os.path.lexists(tmp):
                left.append(str(tmp))
        for d in made:                      # innermost first; only ever empty directories we made
            try:
                os.rmdir(d)
            except OSError:
                break
        if not isinstance(err, OSError):
            raise
        line = os_error_line(err, f"cannot write the checkpoint to {out}", hide=tmp)
        if left:
            line += f" (could not remove the partial {left[0]}: delete it by hand)"
        raise DeepInferError(line) from None
    return out
