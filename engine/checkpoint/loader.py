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

from deepinfer.kernels.quant import dequantize_fp4, dequantize_fp8_blocks

from ..errors import CheckpointError
from ..models.engram import dequantize_engram_rows
from ..models.layers import Linear, QuantizedWeight
from .names import V41, EXPERTS_HF, checkpoint_tensors, ds_to_hf, hf_to_ds, is_vision_tensor, split_expert_name
from .random_init import ENGRAM_ROW_BLOCK, is_engram_table

log = logging.getLogger("deepinfer")

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
FP4_BLOCK = 32
QUANT_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.uint8)
SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.float32, torch.bfloat16)


def shard_map(ckpt_dir: Path) -> dict[str, list[str]]:
    """shard file name -> tensor names it holds, from the index (or the single file)."""
    index = ckpt_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict) and weight_map
            assert all(isinstance(shard, str) and shard for shard in weight_map.values())
        except (json.JSONDecodeError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a non-empty 'weight_map' "
                                  f"object of tensor name -> shard file); re-download or re-export the checkpoint"
                                  ) from None
        except OSError as err:
            raise CheckpointError(f"{index} could not be read ({err.strerror or err}); check its permissions") from None
        shards: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(shard, []).append(name)
    elif (ckpt_dir / SINGLE_FILE).is_file():
        shards = {SINGLE_FILE: None}
    else:
        raise CheckpointError(f"{ckpt_dir} has neither {INDEX_FILE} nor {SINGLE_FILE}: not a safetensors checkpoint")
    for shard in shards:
        if not (ckpt_dir / shard).is_file():
            raise CheckpointError(f"shard {ckpt_dir / shard} listed in {INDEX_FILE} is missing; "
                                  f"download the complete checkpoint")
    return shards


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
        self.block = model.cfg.quant.weight_block_size if model.cfg.quant else (128, 128)
        self.expected = self._expected_names()
        self.seen: set[str] = set()
        self._dequantized: set[str] = set()
        self.pending: dict[str, _Pending] = {}

    def _expected_names(self) -> set[str]:
        """Every tensor (DeepSeek spelling, experts per index, no scales except FP4-resident experts') the
        model needs."""
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
                names.update(f"{base}.{j}.{w}.{leaf}" for j in range(t.shape[0]))
            else:
                names.add(name)
        return names

    def load(self) -> None:
        shards = shard_map(self.ckpt_dir)
        device = str(self.model.device)
        hf_scheme = None
        for shard, listed in shards.items():
            path = self.ckpt_dir / shard
            try:
                with safe_open(str(path), framework="pt", device=device) as f:
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
                        self._take(key, f.get_tensor(key), hf, path)
            except SafetensorError as err:
                raise CheckpointError(f"shard {path} is corrupt or truncated ({err}); re-download it") from None
            except (OSError, RuntimeError) as err:
                raise CheckpointError(f"shard {path} could not be read ({err}); re-download it") from None
        if self.vision_skipped:
            log.info("skipped %d vision tensors (text-only model)", self.vision_skipped)
        self._drop_float_engram_scales()
        if self.pending:
            self._report_pending()
        missing = sorted(self.expected - self.seen)
        if missing:
            raise CheckpointError(f"checkpoint {self.ckpt_dir} is missing {len(missing)} tensor(s) the config needs, "
                                  f"e.g. {missing[:3]}; check config.json matches the weights")

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
                stem = name.rsplit(".", 1)[-1]
                if stem in EXPERTS_HF:
                    return self._take_hf_experts(name, key, tensor, path)
                return self._assign(name, tensor, key, path)
            key = name   # V4.1: DeepSeek's names behind the prefix; quantized tensors as below
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
        experts FP4-resident (expert_storage="fp4"); else None."""
        expert = split_expert_name(key)
        if expert is None or expert[3] not in ("weight", "scale"):
            return None
        buf = self.targets.get(f"{expert[0]}.{expert[2]}_{'fp4' if expert[3] == 'weight' else 'scale'}")
        return None if buf is None else (buf, expert[1])

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
        with torch.no_grad():
            buf[j].copy_(tensor.view(torch.uint8))
        self.seen.add(key)

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
        self._assign(name, value, name, path, quantized)
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
        self._assign(name, dequantize_engram_rows(p.weight, p.scale, self.dtype, block), name, path)
        self._dequantized.add(name)

    def _target_shape(self, name: str, path: Path) -> tuple[int, ...]:
        expert = split_expert_name(name)
        param = self.targets.get(f"{expert[0]}.{expert[2]}" if expert else name)
        if param is None:
            raise CheckpointError(f"{path}: unexpected tensor {name} (not part of this model's config)")
        return tuple(param.shape[1:]) if expert else tuple(param.shape)

    def _assign(self, name: str, value: torch.Tensor, key: str, path: Path,
                quantized: QuantizedWeight | None = None) -> None:
        expert = split_expert_name(name)
        param = self.targets.get(f"{expert[0]}.{expert[2]}" if expert else name)
        if param is None or name not in self.expected:
            raise CheckpointError(f"{path}: unexpected tensor {key} (not part of this model's config; "
                                  f"check config.json matches the weights)")
        dest = param[expert[1]] if expert else param
        if tuple(value.shape) != tuple(dest.shape):
            raise CheckpointError(f"{path}: tensor {key} has shape {tuple(value.shape)}, expected {tuple(dest.shape)}")
        if param.dtype.is_floating_point != value.dtype.is_floating_point or (
                value.dtype.is_floating_point and value.dtype not in FLOAT_DTYPES):
            want = ("bfloat16/float16/float32 (or float8_e4m3fn / int8-packed FP4 with a .scale)"
                    if param.dtype.is_floating_point else f"an integer dtype ({param.dtype})")
            raise CheckpointError(f"{path}: tensor {key} has dtype {value.dtype}, expected {want}")
        if name in self.seen:
            raise CheckpointError(f"{path}: tensor {key} appears twice in the checkpoint")
        if name.endswith("tid2eid"):
            self._check_tid2eid(value, key, path)
        with torch.no_grad():
            dest.copy_(value)
        self.seen.add(name)
        if quantized is not None:
            self._attach(name, expert, quantized)

    def _check_tid2eid(self, value: torch.Tensor, key: str, path: Path) -> None:
        """Hash routing indexes experts with these ids: out-of-range ids would only fail (or read garbage)
        at run time, so reject them here."""
        n_experts = self.model.cfg.n_routed_experts
        if value.numel() and (int(value.min()) < 0 or int(value.max()) >= n_experts):
            raise CheckpointError(f"{path}: tensor {key} holds expert ids in {int(value.min())}..{int(value.max())}, "
                                  f"outside 0..{n_experts - 1} (n_routed_experts); the checkpoint does not match "
                                  f"config.json")

    def _attach(self, name: str, expert, quantized: QuantizedWeight) -> None:
        if expert:
            module = self.model.get_submodule(expert[0])
            module.quantized.setdefault(expert[2], {})[expert[1]] = quantized
        else:
            module = self.model.get_submodule(name.rsplit(".", 1)[0])
            if isinstance(module, Linear):
                module.quantized = quantized

    def _take_hf_experts(self, name: str, key: str, tensor: torch.Tensor, path: Path) -> None:
        """`...experts.gate_up_proj` [E, 2I, D] -> w1 (first I rows), w3; `down_proj` [E, D, I] -> w2."""
        base, stem = name.rsplit(".", 1)
        parts = EXPERTS_HF[stem]
        pieces = tensor.chunk(len(parts), dim=1) if len(parts) > 1 else (tensor,)
        param = self.targets.get(f"{base}.{parts[0]}")
        if param is None or tensor.shape[0] != param.shape[0]:
            raise CheckpointError(f"{path}: tensor {key} has shape {tuple(tensor.shape)}, which does not fit "
                                  f"{'no experts' if param is None else param.shape[0]} experts of this config")
        for part, piece in zip(parts, pieces):
            for j in range(piece.shape[0]):
                self._assign(f"{base}.{j}.{part}.weight", piece[j], key, path)


def load_checkpoint(model: torch.nn.Module, ckpt_dir: str | Path, keep_quantized: bool = False) -> None:
    CheckpointLoader(model, Path(ckpt_dir), keep_quantized).load()


__all__ = ["load_checkpoint", "shard_map", "ds_to_hf"]
