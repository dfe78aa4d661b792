"""Load sharded safetensors (DeepSeek or transformers names; bf16/fp32, FP8 blocks, FP4 experts) into a model.

Shards are read one at a time straight onto the target device; each tensor is dequantized to the
compute dtype and copied into the (already materialized, empty) parameter, so the model never exists
twice. With keep_quantized the on-disk FP8/FP4 tensors stay attached to their modules for fast kernels.

DeepSeek-V4.1 adds: engram tables (`engram.embed.weight` FP8 rows + `engram.embed.scale` e8m0 per 32
channels, folded into the module's dequantized table; a float table's scale is ignored, as transformers
does), transformers' spelling (`model.` + DeepSeek's names, `lm_head`), and vision tensors, which the
text model skips with one log line.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from deepinfer.kernels.quant import dequantize_fp4, dequantize_fp8_blocks, scale_to_float

from ..errors import CheckpointError
from ..models.deepseek_v41.engram import dequantize_engram_rows
from ..models.common.layers import Fp8Linear, Linear, QuantizedWeight
from .held_experts import held_experts
from .names import V41, EXPERTS_HF, checkpoint_tensors, ds_to_hf, hf_to_ds, is_vision_tensor, split_expert_name
from .random_init import ENGRAM_ROW_BLOCK, is_engram_table, is_fp32_tensor

log = logging.getLogger("deepinfer")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
FP4_BLOCK = 32
QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.float32, torch.bfloat16)
# tensors screened by their bytes: kind -> the NaN bytes (e8m0: 0xFF; e4m3fn, which has no inf: x111 1111)
NAN_BYTES = {"e8m0": lambda b: b == 0xFF, "fp8": lambda b: (b & 0x7F) == 0x7F}


def shard_map(ckpt_dir: Path) -> dict[str, list[str]]:
    """shard file name -> tensor names it holds, from the index (or the single file)."""
    index = ckpt_dir / INDEX_FILE
    for name in (INDEX_FILE, SINGLE_FILE):
        if (ckpt_dir / name).is_dir():
            raise CheckpointError(f"{ckpt_dir / name} is a directory, not a file; re-download the checkpoint")
    if index.is_file():
        bad = (f"{index} is not a valid safetensors index (needs a non-empty 'weight_map' object of tensor name "
               f"-> shard file); re-download or re-export the checkpoint")
        try:
            raw = json.loads(index.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(bad) from None
        except OSError as err:
            raise CheckpointError(f"{index} could not be read ({err.strerror or err}); check its permissions") from None
        # Explicit checks, not asserts: `python -O` strips those.
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(shard, str) and shard for shard in weight_map.values()):
            raise CheckpointError(bad)
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, []).append(name)
    elif (ckpt_dir / SINGLE_FILE).is_file():
        shards = {SINGLE_FILE: None}
    else:
        raise CheckpointError(f"{ckpt_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}: not a safetensors checkpoint")
    for shard in shards:
        _check_shard_path(ckpt_dir, shard)
    return shards


def _check_shard_path(ckpt_dir: Path, shard: str) -> None:
    """An index entry must name a file inside the checkpoint directory: not an absolute path, not `..`
    (safetensors would open whatever it points at), not a directory, not missing."""
    path = ckpt_dir / shard
    parts = Path(shard).parts
    if Path(shard).is_absolute() or ".." in parts or "\0" in shard:
        raise CheckpointError(f"{ckpt_dir / INDEX_FILE} lists shard {shard!r}, which is not a file name inside "
                              f"{ckpt_dir}; re-download or re-export the checkpoint")
    if path.is_dir():
        raise CheckpointError(f"shard {path} listed in {INDEX_FILE} is a directory, not a safetensors file; "
                              f"re-download the checkpoint")
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "is missing"
        raise CheckpointError(f"shard {path} listed in {INDEX_FILE} {what}; download the complete checkpoint")


@dataclass
class _Pending:
    """A quantized weight waiting for its `.scale` companion (which may live in another shard)."""
    weight: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    path: Path | None = None     # the shard that held the first of the two


class CheckpointLoader:
    def __init__(self, model: torch.nn.Module, ckpt_dir: Path, keep_quantized: bool = False):
        self.model, self.ckpt_dir, self.keep_quantized = model, Path(ckpt_dir), keep_quantized
        self.dtype = model.dtype
        self.family = model.cfg.model_type
        self.vision_skipped = 0
        self.targets = checkpoint_tensors(model)
        self.held = held_experts(model)       # experts stack -> its held experts (expert parallelism: this rank's)
        self.held_elsewhere = 0               # expert tensors left to the ranks that hold them (never read here)
        self.block = model.cfg.quant.weight_block_size if model.cfg.quant else (128, 128)
        self.expected = self._expected_names()
        self.seen: set[str] = set()
        self._dequantized: set[str] = set()
        self.pending: dict[str, _Pending] = {}
        self._nonfinite: torch.Tensor | None = None          # this shard's screen (a sum), on the model's device
        self._nan_scales: torch.Tensor | None = None         # this shard's count of NaN bytes: FP4-resident
                                                             # experts' e8m0 scales, FP8-resident weights' e4m3
        self._finite_checked: list[tuple[str, torch.Tensor, str]] = []   # (key, loaded tensor, kind)
        # unquantized floats stored in another dtype than the release's (F32 for its F32 tensors, else
        # config.json's dtype): (key, stored dtype, release dtype, values exact in the release dtype)
        self.release_dtype = getattr(torch, str(model.cfg.torch_dtype), torch.bfloat16)
        self.off_dtype: list[tuple[str, torch.dtype, torch.dtype, bool]] = []

    def _expected_names(self) -> set[str]:
        """Every tensor (DeepSeek spelling, experts per index, no scales except FP4-resident experts') the
        model needs: every expert of a layer, held here or not, so that a missing one is one line on every rank."""
        names = set()
        for name, t in self.targets.items():
            if ".ffn.experts.w" in name:
                base, w = name.rsplit(".", 1)
                for suffix, leaf in (("_fp4", "weight"), ("_scale", "scale")):   # FP4-resident experts
                    if w.endswith(suffix):
                        w = w[: -len(suffix)]
                        break
                else:
                    leaf = "weight"
                names.update(f"{base}.{j}.{w}.{leaf}" for j in range(self.held[base].n_experts))
            else:
                names.add(name)
        return names

    def load(self) -> None:
        shards = shard_map(self.ckpt_dir)
        hf_scheme = None
        for shard, listed in shards.items():
            path = self.ckpt_dir / shard
            try:
                with safe_open(str(path), framework="pt") as f:      # memory-mapped; each read lands on the host
                    keys = list(f.keys())
                    if listed is not None and set(listed) - set(keys):
                        missing = sorted(set(listed) - set(keys))[:3]
                        raise CheckpointError(f"shard {path} lacks tensors its index lists, e.g. {missing}; "
                                              f"the shard is incomplete: re-download it")
                    if hf_scheme is None and keys:
                        hf_scheme = any(k.startswith(("model.", "lm_head.")) for k in keys)
                    for key in keys:
                        if self.family == V41 and is_vision_tensor(key):
                            self.vision_skipped += 1     # the image tower is not built: never read it
                            continue
                        # V4.1's two spellings differ by a prefix only: decide per tensor.
                        hf = key.startswith(("model.", "lm_head.")) if self.family == V41 else hf_scheme
                        self._read(f, key, hf, path)
                self._check_finite(path)
            except SafetensorError as err:
                raise CheckpointError(f"shard {path} is corrupt or truncated ({err}); re-download it") from None
            except (OSError, RuntimeError) as err:
                raise CheckpointError(f"shard {path} could not be read ({err}); re-download it") from None
        if self.vision_skipped:
            log.info("skipped %d vision tensors (text-only model)", self.vision_skipped)
        if self.held_elsewhere:
            log.info("left %d routed-expert tensors unread: other expert-parallel ranks hold them", self.held_elsewhere)
        self._drop_float_engram_scales()
        if self.pending:
            self._report_pending()
        if self.off_dtype:
            self._report_off_dtype()
        missing = sorted(self.expected - self.seen)
        if missing:
            raise CheckpointError(f"checkpoint {self.ckpt_dir} is missing {len(missing)} tensor(s) the config needs, "
                                  f"e.g. {missing[:3]}; check config.json matches the weights")

    def _read(self, f, key: str, hf: bool, path: Path) -> None:
        """One tensor of an open shard: skipped unread when another rank holds its expert (it counts as present),
        read row by row for transformers' stacked V4 experts (only the held rows), else read whole onto the device
        of the tensor it fills (the model's; the host for host-resident engram tables)."""
        name = hf_to_ds(key, self.family) if hf else key
        expert = split_expert_name(name) if name is not None else None
        held = self.held.get(expert[0]) if expert is not None else None
        if held is not None and held.elsewhere(expert[1]):
            self.seen.add(name)
            self.held_elsewhere += 1
            return
        if hf and self.family != V41 and name is not None and name.rsplit(".", 1)[-1] in EXPERTS_HF:
            return self._take_hf_experts(name, key, f.get_slice(key), path)
        self._take(key, f.get_tensor(key).to(self._device_for(name)), hf, path)

    def _device_for(self, name: str | None) -> torch.device:
        """Where a read tensor is dequantized and checked: its target's device (a scale: its weight's)."""
        if name is not None and name.endswith(".scale"):
            name = name[: -len(".scale")] + ".weight"
        target = self._param_for(name) if name is not None else None
        return target.device if target is not None else self.model.device

    def _drop_float_engram_scales(self) -> None:
        """An engram table stored in a float dtype is already dequantized: its `embed.scale` (transformers
        keeps one, all ones in our HF export) is unused, as in transformers' engram embedding."""
        for name in [n for n, p in self.pending.items() if is_engram_table(n) and p.weight is None
                     and n in self.seen]:
            del self.pending[name]

    def _report_pending(self) -> None:
        """A quantized weight without its scale, or a scale without its quantized weight: one line."""
        name = sorted(self.pending)[0]
        p = self.pending[name]
        scale_name = name[: -len(".weight")] + ".scale" if name.endswith(".weight") else name + ".scale"
        if not self._is_target(name):
            raise CheckpointError(f"{p.path}: unexpected tensor {name if p.scale is None else scale_name} (not part "
                                  f"of this model's config; check config.json matches the weights)")
        if p.scale is None:
            raise CheckpointError(f"{p.path}: quantized tensor {name} ({p.weight.dtype}) has no scale tensor "
                                  f"{scale_name} in the checkpoint; re-download or re-export it")
        if name in self.seen:
            raise CheckpointError(f"{p.path}: {scale_name} is a quantization scale but {name} is stored unquantized "
                                  f"(float); drop the scale or store the weight quantized")
        raise CheckpointError(f"{p.path}: scale {scale_name} has no quantized weight {name} in the checkpoint; "
                              f"the checkpoint is incomplete: re-download it")

    def _param_for(self, name: str):
        expert = split_expert_name(name)
        return self.targets.get(f"{expert[0]}.{expert[2]}" if expert else name)

    def _is_target(self, name: str) -> bool:
        return name in self.expected and self._param_for(name) is not None

    # ---- one tensor ----
    def _take(self, key: str, tensor: torch.Tensor, hf_scheme: bool, path: Path) -> None:
        if hf_scheme:
            name = hf_to_ds(key, self.family)
            if name is None:
                raise CheckpointError(f"{path}: unexpected tensor {key} (not part of a {self.family} model)")
            if self.family != V41:
                fp8 = self._fp8_module(name)
                if fp8 is not None:
                    return self._take_fp8(name, tensor, path, fp8)
                return self._assign(name, tensor, key, path)
            key = name   # V4.1: DeepSeek's names behind the prefix; quantized tensors as below
        fp8 = self._fp8_module(key)
        if fp8 is not None:
            return self._take_fp8(key, tensor, path, fp8)
        resident = self._resident_target(key)
        if resident is not None:
            return self._take_resident(key, tensor, path, *resident)
        if key.endswith(".scale"):
            base = key[: -len(".scale")] + ".weight"
            if tensor.dtype not in SCALE_DTYPES:
                raise CheckpointError(f"{path}: scale {key} has dtype {tensor.dtype}, expected float8_e8m0fnu "
                                      f"(e8m0) or float32")
            pending = self.pending.setdefault(base, _Pending(path=path))
            if pending.scale is not None or base in self._dequantized:
                raise CheckpointError(f"{path}: tensor {key} appears twice in the checkpoint")
            pending.scale = tensor
            return self._maybe_dequant(base, path)
        param = self._param_for(key)
        if tensor.dtype in QUANT_DTYPES and (param is None or param.dtype.is_floating_point):
            pending = self.pending.setdefault(key, _Pending(path=path))
            if pending.weight is not None or key in self.seen:
                raise CheckpointError(f"{path}: tensor {key} appears twice in the checkpoint")
            pending.weight = tensor
            return self._maybe_dequant(key, path)
        self._assign(key, tensor, key, path)

    def _resident_target(self, key: str):
        """(buffer, expert index) when `key` is a routed expert's FP4 weight or scale and the model keeps
        experts FP4-resident (expert_storage="fp4"); else None. An expert index outside the layer's experts is
        left to the plain path, which calls it unexpected."""
        expert = split_expert_name(key)
        if expert is None or expert[3] not in ("weight", "scale"):
            return None
        buf = self.targets.get(f"{expert[0]}.{expert[2]}_{'fp4' if expert[3] == 'weight' else 'scale'}")
        return None if buf is None or not self.held[expert[0]].slots_of(expert[1]) else (buf, expert[1])

    def _take_resident(self, key: str, tensor: torch.Tensor, path: Path, buf: torch.Tensor, j: int) -> None:
        """Copy the on-disk bytes as they are: packed e2m1 (int8) weights, e8m0 scales."""
        is_scale = key.endswith(".scale")
        ok = (tensor.dtype in (torch.float8_e8m0fnu, torch.uint8)) if is_scale else (tensor.dtype in (torch.int8, torch.uint8))
        if not ok:
            raise CheckpointError(f"{path}: {key} is {tensor.dtype}, but the model keeps routed experts FP4-resident "
                                  f"(expert_storage='fp4'), which needs them stored as packed e2m1 with e8m0 scales "
                                  f"(DeepSeek format, expert_dtype fp4); load with expert_storage='dense'")
        if tuple(tensor.shape) != tuple(buf.shape[1:]):
            raise CheckpointError(f"{path}: tensor {key} has shape {tuple(tensor.shape)}, expected "
                                  f"{tuple(buf.shape[1:])} (packed FP4 expert)")
        if key in self.seen:
            raise CheckpointError(f"{path}: tensor {key} appears twice in the checkpoint")
        slots = self.held[split_expert_name(key)[0]].slots_of(j)
        with torch.no_grad():
            for slot in slots:                     # an EPLB replica: the same bytes in two slots
                buf[slot].copy_(tensor.view(torch.uint8))
        self.seen.add(key)
        if is_scale:
            self._count_nonfinite(key, buf[slots[0]], "e8m0")

    def _fp8_module(self, key: str) -> Fp8Linear | None:
        """The Fp8Linear (projection_storage="fp8") whose `.weight` or `.scale` `key` names, else None."""
        base, _, leaf = key.rpartition(".")
        if leaf not in ("weight", "scale") or f"{base}.weight" not in self.targets:
            return None
        module = self.model.get_submodule(base)
        return module if isinstance(module, Fp8Linear) else None

    def _take_fp8(self, key: str, tensor: torch.Tensor, path: Path, module: Fp8Linear) -> None:
        """An FP8-resident projection (projection_storage="fp8") keeps the release's bytes: the e4m3 weight as
        it is, its block scale as float32 (exact for e8m0)."""
        if key in self.seen:
            raise CheckpointError(f"{path}: tensor {key} appears twice in the checkpoint")
        if key.endswith(".scale"):
            if tensor.dtype not in SCALE_DTYPES:
                raise CheckpointError(f"{path}: scale {key} has dtype {tensor.dtype}, expected float8_e8m0fnu "
                                      f"(e8m0) or float32")
            self._copy_fp8_part(key, module.scale, tensor, path, scale_to_float(tensor), module.block)
            return
        if tensor.dtype == torch.float8_e4m3fn:
            self._copy_fp8_part(key, module.weight, tensor, path, tensor, module.block)
            return
        raise CheckpointError(f"{path}: tensor {key} has dtype {tensor.dtype}, but projection_storage='fp8' keeps "
                              f"the release's FP8 projections, which needs it stored float8_e4m3fn with a .scale; "
                              f"load with projection_storage='dense'")

    def _copy_fp8_part(self, key: str, dest: torch.Tensor, tensor: torch.Tensor, path: Path,
                       value: torch.Tensor, block: int) -> None:
        if tuple(tensor.shape) != tuple(dest.shape):
            raise CheckpointError(f"{path}: tensor {key} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                                  f" (FP8 weight [out, in] / scale per {block}x{block} block)")
        with torch.no_grad():
            dest.copy_(value)
        self.seen.add(key)
        self._count_nonfinite(key, dest, "fp8" if dest.dtype == torch.float8_e4m3fn else "float")

    def _maybe_dequant(self, name: str, path: Path) -> None:
        p = self.pending[name]
        if p.weight is None or p.scale is None:
            return
        del self.pending[name]
        target = self._target_shape(name, path)
        if is_engram_table(name):
            return self._fold_engram_table(name, p, target, path)
        if p.weight.dtype == torch.float8_e4m3fn:
            fmt, block = "fp8", self.block
            if tuple(p.weight.shape) != target:
                raise CheckpointError(f"{path}: {name} has shape {tuple(p.weight.shape)}, expected {target}")
            want = (-(-target[0] // block[0]), -(-target[1] // block[1]))
            if tuple(p.scale.shape) != want:
                raise CheckpointError(f"{path}: {name[:-7]}.scale has shape {tuple(p.scale.shape)}, expected {want} "
                                      f"for {block[0]}x{block[1]} blocks")
            value = dequantize_fp8_blocks(p.weight, p.scale, block, self.dtype)
        else:
            fmt, block = "fp4", (1, FP4_BLOCK)
            want_w, want_s = (target[0], target[1] // 2), (target[0], target[1] // FP4_BLOCK)
            if tuple(p.weight.shape) != want_w or tuple(p.scale.shape) != want_s:
                raise CheckpointError(f"{path}: FP4 tensor {name} has shapes {tuple(p.weight.shape)} / scale "
                                      f"{tuple(p.scale.shape)}, expected {want_w} / {want_s} (packed e2m1)")
            value = dequantize_fp4(p.weight, p.scale, FP4_BLOCK, self.dtype)
        quantized = QuantizedWeight(p.weight, p.scale, fmt, block) if self.keep_quantized else None
        self._assign(name, value, name, path, quantized, tensor_was_quantized=True)
        self._dequantized.add(name)

    def _fold_engram_table(self, name: str, p: _Pending, target: tuple[int, ...], path: Path) -> None:
        """FP8 e4m3 rows [R, head_dim] x e8m0 scale [R, head_dim / 32] -> the module's dequantized table."""
        block = ENGRAM_ROW_BLOCK[1]
        want_s = (target[0], -(-target[1] // block))
        if p.weight.dtype != torch.float8_e4m3fn or tuple(p.weight.shape) != target \
                or tuple(p.scale.shape) != want_s:
            raise CheckpointError(f"{path}: engram table {name} is {p.weight.dtype} {tuple(p.weight.shape)} with scale "
                                  f"{tuple(p.scale.shape)}, expected float8_e4m3fn {target} with scale {want_s} "
                                  f"(one e8m0 scale per {block} channels of a row)")
        self._assign(name, dequantize_engram_rows(p.weight, p.scale, self.dtype, block), name, path,
                     tensor_was_quantized=True)
        self._dequantized.add(name)

    def _target_shape(self, name: str, path: Path) -> tuple[int, ...]:
        expert = split_expert_name(name)
        param = self.targets.get(f"{expert[0]}.{expert[2]}" if expert else name)
        if param is None:
            raise CheckpointError(f"{path}: unexpected tensor {name} (not part of this model's config)")
        return tuple(param.shape[1:]) if expert else tuple(param.shape)

    def _assign(self, name: str, value: torch.Tensor, key: str, path: Path,
                quantized: QuantizedWeight | None = None, tensor_was_quantized: bool = False) -> None:
        expert = split_expert_name(name)
        param = self.targets.get(f"{expert[0]}.{expert[2]}" if expert else name)
        if param is None or name not in self.expected:
            raise CheckpointError(f"{path}: unexpected tensor {key} (not part of this model's config; "
                                  f"check config.json matches the weights)")
        slots = self.held[expert[0]].slots_of(expert[1]) if expert else ()
        if expert and not slots:
            raise CheckpointError(f"{path}: unexpected tensor {key} (not part of this model's config; "
                                  f"check config.json matches the weights)")
        dest = param[slots[0]] if expert else param
        if tuple(value.shape) != tuple(dest.shape):
            raise CheckpointError(f"{path}: tensor {key} has shape {tuple(value.shape)}, expected {tuple(dest.shape)}")
        if param.dtype.is_floating_point != value.dtype.is_floating_point or (
                value.dtype.is_floating_point and value.dtype not in FLOAT_DTYPES):
            want = ("bfloat16/float16/float32/float64 (or float8_e4m3fn / int8-packed FP4 with a .scale)"
                    if param.dtype.is_floating_point else f"an integer dtype ({param.dtype})")
            raise CheckpointError(f"{path}: tensor {key} has dtype {value.dtype}, expected {want}")
        if name in self.seen:
            raise CheckpointError(f"{path}: tensor {key} appears twice in the checkpoint")
        if value.dtype.is_floating_point and not tensor_was_quantized:
            release = torch.float32 if is_fp32_tensor(name, self.family) else self.release_dtype
            if value.dtype != release:
                exact = bool(torch.equal(value.to(release).to(value.dtype), value))
                self.off_dtype.append((key, value.dtype, release, exact))
        if name.endswith("tid2eid"):
            self._check_tid2eid(value, key, path)
        with torch.no_grad():
            for slot in slots[1:]:                 # an EPLB replica held twice on this rank
                param[slot].copy_(value)
            dest.copy_(value)
        self.seen.add(name)
        if dest.dtype.is_floating_point:
            self._count_nonfinite(key, dest, "dequantized" if tensor_was_quantized else "float")
        if quantized is not None:
            self._attach(name, expert, quantized)

    def _report_off_dtype(self) -> None:
        """One line for every tensor stored in another float dtype than the release's (values are loaded either
        way, into the model's dtype): whether they are the release dtype's values exactly, or were rounded."""
        name = lambda d: str(d).removeprefix("torch.")                     # noqa: E731
        kinds: dict[tuple, int] = {}
        for _, stored, release, _ in self.off_dtype:
            kinds[stored, release] = kinds.get((stored, release), 0) + 1
        how = ", ".join(f"{n} stored as {name(s)} where the release stores {name(r)}" for (s, r), n in kinds.items())
        inexact = sum(not exact for *_, exact in self.off_dtype)
        values = ("all hold values of the release dtype exactly" if not inexact else
                  f"{inexact} hold values the release dtype cannot represent (the release would have rounded them)")
        log.warning("checkpoint %s: %d tensor(s) in another float dtype than the release's (config.json's dtype, or "
                    "F32 for its F32 tensors): %s, e.g. %s; %s; loaded into the model's %s", self.ckpt_dir,
                    len(self.off_dtype), how, self.off_dtype[0][0], values, name(self.dtype))

    def _check_tid2eid(self, value: torch.Tensor, key: str, path: Path) -> None:
        """Hash routing indexes experts with these ids: out-of-range ids would only fail (or read garbage)
        at run time, so reject them here. A row must also name distinct experts: with a repeat the reference
        model sums both slots while the decode path keeps one, so the two disagree (no released table repeats)."""
        n_experts = self.model.cfg.n_routed_experts
        if value.numel() and (int(value.min()) < 0 or int(value.max()) >= n_experts):
            raise CheckpointError(f"{path}: tensor {key} holds expert ids in {int(value.min())}..{int(value.max())}, "
                                  f"outside 0..{n_experts - 1} (n_routed_experts); the checkpoint does not match "
                                  f"config.json")
        if value.dim() == 2 and value.shape[1] > 1 and value.shape[0]:
            ordered = value.sort(dim=-1).values
            repeats = (ordered[:, 1:] == ordered[:, :-1]).any(dim=-1)
            if bool(repeats.any()):
                token = int(repeats.nonzero()[0, 0])
                row = value[token].tolist()
                expert = next(e for e in row if row.count(e) > 1)
                raise CheckpointError(f"{path}: tensor {key} routes token id {token} to expert {expert} more than "
                                      f"once (row {row}); hash routing needs distinct experts per token: "
                                      f"re-download or re-export the checkpoint")

    # ---- non-finite weights
    def _count_nonfinite(self, key: str, loaded: torch.Tensor, kind: str) -> None:
        """Screen a just-loaded tensor for NaN/inf, as the model holds it (after dequantization, so FP8 NaN
        codes, NaN e8m0 scales and scales that overflow all show up). kind "e8m0": FP4-resident expert
        scales, kept as bytes (e2m1 weights have no NaN/inf; a scale byte 0xFF is NaN); kind "fp8": FP8-resident
        projection weights, screened by their bytes (e4m3fn has no inf; NaN is x111 1111), their fp32 scales as
        "float".

        Cost, the choice made: the screen is the tensor's plain sum (one reduction kernel, no temporary; a sum
        is non-finite whenever any term is), added to a per-shard total that stays on the device. The total
        is read once per shard (`_check_finite`), so a GPU load of thousands of tensors adds one host sync
        per shard, not one per tensor. Only a non-finite total (a bad tensor, or, harmlessly, finite sums
        overflowing) makes `_check_finite` count each of that shard's tensors exactly to name the culprit."""
        if kind in NAN_BYTES:    # uint8 ops only: every device has them for any byte tensor
            term = NAN_BYTES[kind](loaded.view(torch.uint8)).sum().to(self.model.device)   # host tables: one device
            self._nan_scales = term if self._nan_scales is None else self._nan_scales + term
        else:
            term = loaded.sum(dtype=torch.float64 if loaded.dtype == torch.float64 else torch.float32
                              ).to(self.model.device)
            self._nonfinite = term if self._nonfinite is None else self._nonfinite + term
        self._finite_checked.append((key, loaded, kind))

    def _check_finite(self, path: Path) -> None:
        """End of a shard: one host sync; if the screen tripped, one CheckpointError line naming the first
        tensor that really holds non-finite values (none: the sums merely overflowed, and the shard is fine)."""
        total, nan_scales, checked = self._nonfinite, self._nan_scales, self._finite_checked
        self._nonfinite, self._nan_scales, self._finite_checked = None, None, []
        ok = [torch.isfinite(total)] if total is not None else []
        ok += [nan_scales == 0] if nan_scales is not None else []
        if not ok or bool(torch.stack(ok).all()):      # the one host sync of this shard
            return
        for key, loaded, kind in checked:
            n = int(_nonfinite_count(loaded, kind))
            if n:
                if kind == "e8m0":
                    what = f"{n} of its {loaded.numel()} e8m0 scales are NaN (byte 0xFF)"
                elif kind == "fp8":
                    what = f"{n} of its {loaded.numel()} e4m3 values are NaN (byte 0x7F / 0xFF)"
                elif kind == "dequantized":
                    scale = key[: -len(".weight")] + ".scale" if key.endswith(".weight") else key + ".scale"
                    what = f"{n} of its {loaded.numel()} values are non-finite (NaN/inf) once dequantized with {scale}"
                else:
                    what = f"{n} of its {loaded.numel()} values are non-finite (NaN/inf)"
                raise CheckpointError(f"shard {path}: tensor {key}: {what}; the checkpoint is corrupt: "
                                      f"re-download or re-export it")

    def _attach(self, name: str, expert, quantized: QuantizedWeight) -> None:
        if expert:
            module = self.model.get_submodule(expert[0])
            module.quantized.setdefault(expert[2], {})[expert[1]] = quantized
        else:
            module = self.model.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(module, Linear):
                module.quantized = quantized

    def _take_hf_experts(self, name: str, key: str, stacked, path: Path) -> None:
        """`...experts.gate_up_proj` [E, 2I, D] -> w1 (first I rows), w3; `down_proj` [E, D, I] -> w2. `stacked`:
        the shard's slice handle; only the held experts' rows are read (expert parallelism: this rank's)."""
        base, stem = name.rsplit(".", 1)
        parts = EXPERTS_HF[stem]
        shape = tuple(stacked.get_shape())
        held = self.held.get(base)
        if held is None or shape[0] != held.n_experts:
            raise CheckpointError(f"{path}: tensor {key} has shape {shape}, which does not fit "
                                  f"{'no experts' if held is None else held.n_experts} experts of this config")
        for j in sorted(held.slots):
            rows = stacked[j:j + 1][0].to(self._device_for(f"{base}.{parts[0]}"))      # [len(parts) * I | D, ...]
            pieces = rows.chunk(len(parts), dim=0) if len(parts) > 1 else (rows,)
            for part, piece in zip(parts, pieces):
                self._assign(f"{base}.{j}.{part}.weight", piece, key, path)
        self.held_elsewhere += len(parts) * (held.n_experts - len(held.slots))
        self.seen.update(f"{base}.{j}.{part}.weight" for j in range(held.n_experts) if held.elsewhere(j)
                         for part in parts)


def _nonfinite_count(t: torch.Tensor, kind: str = "float") -> int:
    """Exact number of NaN/inf values of `t` (a kind in NAN_BYTES: of its NaN bytes); only run to locate a bad
    tensor."""
    if kind in NAN_BYTES:
        return int(NAN_BYTES[kind](t.view(torch.uint8)).sum())
    return int(t.numel() - torch.isfinite(t).sum())


def load_checkpoint(model: torch.nn.Module, ckpt_dir: str | Path, keep_quantized: bool = False) -> None:
    CheckpointLoader(model, Path(ckpt_dir), keep_quantized).load()


__all__ = ["load_checkpoint", "shard_map", "ds_to_hf"]
