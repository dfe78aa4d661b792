"""Every bad input to load_model / make-checkpoint / the CLI gives one DeepInferError line that names
the file or tensor at fault (and what to do), never a traceback or a half-loaded model.

One tiny checkpoint is written per session (conftest.py); each test corrupts its own copy.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import deepinfer
from deepinfer.checkpoint.loader import INDEX_FILE, load_checkpoint
from deepinfer.checkpoint.make import make_checkpoint
from deepinfer.config import load_model_config
from deepinfer.errors import CheckpointError, ConfigError, DeepInferError, ModelNotFoundError
from deepinfer.models import build_model
from tests.helpers import deepinfer_exe

# Tensors of the tiny preset used below (shapes are read from the checkpoint, not hard-coded).
FP8_W = "layers.0.attn.wq_a.weight"            # float8_e4m3fn, scale e8m0 per 128x128 block
FP8_S = "layers.0.attn.wq_a.scale"
FP4_W = "layers.2.ffn.experts.3.w2.weight"     # int8-packed e2m1, scale e8m0 per 32 along K
FP4_S = "layers.2.ffn.experts.3.w2.scale"
BF16 = "layers.1.attn_norm.weight"             # bfloat16
TID2EID = "layers.0.ffn.gate.tid2eid"          # int64 [vocab, top-k]


# ----------------------------------------------------------------------------- helpers

def read_index(d: Path) -> dict:
    return json.loads((d / INDEX_FILE).read_text())


def write_index(d: Path, index: dict) -> None:
    (d / INDEX_FILE).write_text(json.dumps(index, indent=2))


def shard_of(d: Path, name: str) -> str:
    return read_index(d)["weight_map"][name]


def edit_shard(d: Path, shard: str, edit) -> None:
    """Rewrite one shard with safetensors after `edit(tensors_dict)`."""
    tensors = load_file(str(d / shard))
    edit(tensors)
    save_file(tensors, str(d / shard), metadata={"format": "pt"})


def remove_tensor(d: Path, name: str, from_index: bool = True) -> str:
    shard = shard_of(d, name)
    edit_shard(d, shard, lambda t: t.pop(name))
    if from_index:
        index = read_index(d)
        del index["weight_map"][name]
        write_index(d, index)
    return shard


def replace_tensor(d: Path, name: str, value: torch.Tensor) -> str:
    shard = shard_of(d, name)
    edit_shard(d, shard, lambda t: t.__setitem__(name, value))
    return shard


def add_tensor(d: Path, name: str, value: torch.Tensor) -> str:
    index = read_index(d)
    shard = sorted(set(index["weight_map"].values()))[0]
    edit_shard(d, shard, lambda t: t.__setitem__(name, value))
    index["weight_map"][name] = shard
    write_index(d, index)
    return shard


def tensor(d: Path, name: str) -> torch.Tensor:
    return load_file(str(d / shard_of(d, name)))[name]


def config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def first_named(d: Path, suffix: str) -> str:
    return next(n for n in sorted(read_index(d)["weight_map"]) if n.endswith(suffix))


def load_error(exc_type, path, *fragments: str) -> str:
    """load_model(path) must raise exc_type with a one-line message containing every fragment."""
    with pytest.raises(exc_type) as info:
        deepinfer.load_model(path)
    msg = str(info.value)
    assert isinstance(info.value, DeepInferError)
    assert msg and "\n" not in msg, f"message is not one line: {msg!r}"
    for fragment in fragments:
        assert str(fragment) in msg, f"{fragment!r} not in {msg!r}"
    return msg


# ----------------------------------------------------------------------------- the baseline

def test_pristine_copy_loads(tiny_checkpoint_copy):
    model = deepinfer.load_model(tiny_checkpoint_copy)
    assert model.cfg.num_hidden_layers == config(tiny_checkpoint_copy)["num_hidden_layers"]
    assert torch.isfinite(model.embed.weight).all()


# ----------------------------------------------------------------------------- files

def test_missing_shard_file(tiny_checkpoint_copy):
    shard = shard_of(tiny_checkpoint_copy, "norm.weight")
    (tiny_checkpoint_copy / shard).unlink()
    load_error(CheckpointError, tiny_checkpoint_copy, shard, "missing", INDEX_FILE)


@pytest.mark.parametrize("text", ["{not json", "", "[1, 2]", '{"metadata": {}}', '{"weight_map": []}',
                                  '{"weight_map": {}}', '{"weight_map": {"embed.weight": 3}}'],
                         ids=["garbage", "empty", "list", "no-weight_map", "weight_map-list", "weight_map-empty",
                              "shard-not-a-string"])
def test_bad_index(tiny_checkpoint_copy, text):
    (tiny_checkpoint_copy / INDEX_FILE).write_text(text)
    load_error(CheckpointError, tiny_checkpoint_copy, INDEX_FILE, "weight_map")


def test_no_weights_at_all(tiny_checkpoint_copy):
    for f in tiny_checkpoint_copy.glob("*.safetensors*"):
        f.unlink()
    load_error(CheckpointError, tiny_checkpoint_copy, INDEX_FILE, "not a safetensors checkpoint")


@pytest.mark.parametrize("keep", [lambda n: n // 2, lambda n: 0, lambda n: 4, lambda n: n - 1],
                         ids=["half", "empty", "inside-header", "last-byte"])
def test_truncated_shard(tiny_checkpoint_copy, keep):
    shard = shard_of(tiny_checkpoint_copy, "embed.weight")
    path = tiny_checkpoint_copy / shard
    data = path.read_bytes()
    path.write_bytes(data[: keep(len(data))])
    load_error(CheckpointError, tiny_checkpoint_copy, shard, "corrupt or truncated", "re-download")


def test_garbage_shard(tiny_checkpoint_copy):
    shard = shard_of(tiny_checkpoint_copy, "embed.weight")
    (tiny_checkpoint_copy / shard).write_bytes(b"\xff" * 64)
    load_error(CheckpointError, tiny_checkpoint_copy, shard)


# ----------------------------------------------------------------------------- tensors

@pytest.mark.parametrize("name", [BF16, TID2EID, "compressor.ape", "indexer.weights_proj.weight", "head.weight"])
def test_missing_tensor(tiny_checkpoint_copy, name):
    name = name if name.startswith(("layers.", "head.")) else first_named(tiny_checkpoint_copy, name)
    remove_tensor(tiny_checkpoint_copy, name)
    load_error(CheckpointError, tiny_checkpoint_copy, name, "missing", str(tiny_checkpoint_copy))


def test_missing_quantized_tensor_and_scale(tiny_checkpoint_copy):
    remove_tensor(tiny_checkpoint_copy, FP4_W)
    remove_tensor(tiny_checkpoint_copy, FP4_S)
    load_error(CheckpointError, tiny_checkpoint_copy, FP4_W, "missing")


def test_tensor_missing_from_shard_but_listed_in_index(tiny_checkpoint_copy):
    shard = remove_tensor(tiny_checkpoint_copy, BF16, from_index=False)
    load_error(CheckpointError, tiny_checkpoint_copy, BF16, shard, "lacks")


@pytest.mark.parametrize("kind", ["bogus", "extra-layer", "extra-mtp", "extra-expert"])
def test_extra_tensor(tiny_checkpoint_copy, kind):
    cfg = config(tiny_checkpoint_copy)
    norm = tensor(tiny_checkpoint_copy, BF16)
    name, value = {
        "bogus": ("layers.0.attn.bogus.weight", torch.zeros(4, 4, dtype=torch.bfloat16)),
        "extra-layer": (f"layers.{cfg['num_hidden_layers']}.attn_norm.weight", norm),   # a layer the config lacks
        "extra-mtp": (f"mtp.{cfg['num_nextn_predict_layers']}.enorm.weight", norm),      # one MTP layer too many
        "extra-expert": (f"layers.0.ffn.experts.{cfg['n_routed_experts']}.w1.weight",   # expert E of E
                         tensor(tiny_checkpoint_copy, "layers.0.ffn.experts.0.w1.weight")),
    }[kind]
    shard = add_tensor(tiny_checkpoint_copy, name, value)
    load_error(CheckpointError, tiny_checkpoint_copy, name, shard, "unexpected")


def test_extra_scale_without_weight(tiny_checkpoint_copy):
    name = "layers.0.attn.bogus.scale"
    add_tensor(tiny_checkpoint_copy, name, torch.ones(1, 1))
    load_error(CheckpointError, tiny_checkpoint_copy, name, "unexpected")


@pytest.mark.parametrize("name,dim", [("embed.weight", 0), (BF16, 0), (TID2EID, 1), (FP8_W, 0), (FP4_W, 1)],
                         ids=["embed", "norm", "tid2eid", "fp8", "fp4"])
def test_wrong_shape(tiny_checkpoint_copy, name, dim):
    good = tensor(tiny_checkpoint_copy, name)
    bad = good.narrow(dim, 0, good.shape[dim] - 1 if good.shape[dim] > 1 else 1)
    bad = torch.cat([good, good.narrow(dim, 0, 1)], dim=dim) if bad.shape == good.shape else bad.contiguous()
    shard = replace_tensor(tiny_checkpoint_copy, name, bad)
    load_error(CheckpointError, tiny_checkpoint_copy, name, shard, "shape", tuple(bad.shape), tuple(good.shape))


@pytest.mark.parametrize("name,dtype", [
    (BF16, torch.int32), ("embed.weight", torch.bool), (TID2EID, torch.float32), (TID2EID, torch.bfloat16),
    (BF16, torch.float8_e5m2),
], ids=["int32-for-bf16", "bool-for-bf16", "float-for-tid2eid", "bf16-for-tid2eid", "e5m2-for-bf16"])
def test_wrong_dtype(tiny_checkpoint_copy, name, dtype):
    good = tensor(tiny_checkpoint_copy, name)
    shard = replace_tensor(tiny_checkpoint_copy, name, torch.ones(good.shape, dtype=dtype))
    load_error(CheckpointError, tiny_checkpoint_copy, name, shard, "dtype", dtype)


def test_int8_tid2eid_is_an_integer_tensor_not_a_quantized_weight(tiny_checkpoint_copy):
    """int8 is also FP4's storage dtype; for an integer target it must load as integers."""
    good = tensor(tiny_checkpoint_copy, TID2EID)
    replace_tensor(tiny_checkpoint_copy, TID2EID, good.to(torch.int8))
    model = deepinfer.load_model(tiny_checkpoint_copy)
    loaded = (dict(model.named_parameters()) | dict(model.named_buffers()))[TID2EID]
    assert loaded.dtype == torch.int64 and torch.equal(loaded, good)


@pytest.mark.parametrize("too_big", [True, False], ids=["too-big", "negative"])
def test_tid2eid_expert_ids_out_of_range(tiny_checkpoint_copy, too_big):
    good = tensor(tiny_checkpoint_copy, TID2EID)
    good[5, -1] = config(tiny_checkpoint_copy)["n_routed_experts"] if too_big else -1
    shard = replace_tensor(tiny_checkpoint_copy, TID2EID, good)
    load_error(CheckpointError, tiny_checkpoint_copy, TID2EID, shard, "n_routed_experts")


# ----------------------------------------------------------------------------- quantized weights and scales

@pytest.mark.parametrize("weight,scale", [(FP8_W, FP8_S), (FP4_W, FP4_S)], ids=["fp8", "fp4"])
def test_quantized_weight_without_scale(tiny_checkpoint_copy, weight, scale):
    shard = remove_tensor(tiny_checkpoint_copy, scale)
    msg = load_error(CheckpointError, tiny_checkpoint_copy, weight, scale, shard, "no scale")
    assert f"{weight}.scale" not in msg


def test_scale_missing_from_shard_but_listed_in_index(tiny_checkpoint_copy):
    shard = remove_tensor(tiny_checkpoint_copy, FP8_S, from_index=False)
    load_error(CheckpointError, tiny_checkpoint_copy, FP8_S, shard)


@pytest.mark.parametrize("weight,scale", [(FP8_W, FP8_S), (FP4_W, FP4_S)], ids=["fp8", "fp4"])
def test_scale_without_quantized_weight(tiny_checkpoint_copy, weight, scale):
    remove_tensor(tiny_checkpoint_copy, weight)
    msg = load_error(CheckpointError, tiny_checkpoint_copy, weight, scale)
    assert f"{weight}.weight" not in msg


def test_scale_beside_an_unquantized_weight(tiny_checkpoint_copy):
    """Weights dequantized to bf16 but the scales left behind: say so instead of loading them twice."""
    w = tensor(tiny_checkpoint_copy, FP8_W)
    replace_tensor(tiny_checkpoint_copy, FP8_W, w.to(torch.bfloat16))
    load_error(CheckpointError, tiny_checkpoint_copy, FP8_S, FP8_W, "unquantized")


@pytest.mark.parametrize("scale", [FP8_S, FP4_S], ids=["fp8", "fp4"])
def test_scale_wrong_shape(tiny_checkpoint_copy, scale):
    good = tensor(tiny_checkpoint_copy, scale)
    bad = torch.ones(good.shape[0] + 1, good.shape[1]).to(torch.float8_e8m0fnu)
    shard = replace_tensor(tiny_checkpoint_copy, scale, bad)
    load_error(CheckpointError, tiny_checkpoint_copy, scale.rsplit(".", 1)[0], shard, "shape",
               tuple(bad.shape), tuple(good.shape))


def test_scale_wrong_dtype(tiny_checkpoint_copy):
    good = tensor(tiny_checkpoint_copy, FP8_S)
    shard = replace_tensor(tiny_checkpoint_copy, FP8_S, torch.ones(good.shape, dtype=torch.int32))
    load_error(CheckpointError, tiny_checkpoint_copy, FP8_S, shard, "dtype", "torch.int32")


def test_failed_load_raises_instead_of_leaving_a_partial_model(tiny_checkpoint_copy):
    """The first shard loads fine, the last one is missing a tensor: load_checkpoint must raise."""
    remove_tensor(tiny_checkpoint_copy, "norm.weight")
    model = build_model(load_model_config(tiny_checkpoint_copy))
    with pytest.raises(CheckpointError, match="norm.weight"):
        load_checkpoint(model, tiny_checkpoint_copy)


# ----------------------------------------------------------------------------- config.json

def test_unknown_model_type(tiny_checkpoint_copy):
    cfg = json.loads((tiny_checkpoint_copy / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tiny_checkpoint_copy / "config.json").write_text(json.dumps(cfg))
    load_error(ConfigError, tiny_checkpoint_copy, "model_type", "'llama'", "deepseek_v4")


@pytest.mark.parametrize("text", ["{\"model_type\": \"deepseek_v4\",", "", "\xff\xfe"], ids=["cut", "empty", "bytes"])
def test_config_not_json(tiny_checkpoint_copy, text):
    (tiny_checkpoint_copy / "config.json").write_bytes(text.encode("latin-1"))
    load_error(ConfigError, tiny_checkpoint_copy, tiny_checkpoint_copy / "config.json", "not valid JSON")


def test_config_not_an_object(tiny_checkpoint_copy):
    (tiny_checkpoint_copy / "config.json").write_text("[1, 2, 3]")
    load_error(ConfigError, tiny_checkpoint_copy, "config.json", "JSON object")


def test_config_with_wrong_value_type(tiny_checkpoint_copy):
    cfg = json.loads((tiny_checkpoint_copy / "config.json").read_text())
    cfg["hidden_size"] = str(cfg["hidden_size"])
    (tiny_checkpoint_copy / "config.json").write_text(json.dumps(cfg))
    load_error(ConfigError, tiny_checkpoint_copy, "hidden_size", repr(cfg["hidden_size"]))


def test_config_does_not_match_weights(tiny_checkpoint_copy):
    cfg = json.loads((tiny_checkpoint_copy / "config.json").read_text())
    cfg["moe_intermediate_size"] *= 2
    (tiny_checkpoint_copy / "config.json").write_text(json.dumps(cfg))
    load_error(CheckpointError, tiny_checkpoint_copy, "shape", "ffn")


def test_missing_config_json(tiny_checkpoint_copy):
    (tiny_checkpoint_copy / "config.json").unlink()
    load_error(ModelNotFoundError, tiny_checkpoint_copy, tiny_checkpoint_copy, "config.json")


# ----------------------------------------------------------------------------- hub / DEEPINFER_HF_MODEL_DIR

def test_hub_id_offline(monkeypatch, tmp_path):
    import huggingface_hub.constants as hub_constants

    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)   # read at import time
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.chdir(tmp_path)   # so the id can't be taken for a local directory
    load_error(ModelNotFoundError, "deepinfer-tests/no-such-model", "'deepinfer-tests/no-such-model'",
               "DEEPINFER_HF_MODEL_DIR", "HF_HUB_OFFLINE")


def test_not_a_dir_and_not_a_hub_id(monkeypatch, tmp_path):
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    load_error(ModelNotFoundError, str(tmp_path / "nope"), str(tmp_path / "nope"), "neither a local directory")


def test_model_dir_env_empty_dir(monkeypatch, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(empty))
    load_error(ModelNotFoundError, "deepinfer-tests/no-such-model", empty, "DEEPINFER_HF_MODEL_DIR", "empty")


def test_model_dir_env_missing_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path / "gone"))       # refused with the environment
    with pytest.raises(DeepInferError, match=r"^DEEPINFER_HF_MODEL_DIR='.*gone' is not a directory; point it at one"):
        deepinfer.load_model(None)


# ----------------------------------------------------------------------------- make-checkpoint

def test_make_checkpoint_into_non_empty_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(DeepInferError) as info:
        make_checkpoint("deepseek_v4", "tiny", "deepseek", 0, out)
    msg = str(info.value)
    assert "\n" not in msg and str(out) in msg and "--overwrite" in msg
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.tmp")]   # no temp dir left


def test_make_checkpoint_overwrite_refuses_a_non_checkpoint_dir(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(DeepInferError, match="not a checkpoint") as info:
        make_checkpoint("deepseek_v4", "tiny", "deepseek", 0, out, overwrite=True)
    assert "\n" not in str(info.value) and str(out) in str(info.value)
    assert (out / "notes.txt").read_text() == "keep me"


def test_make_checkpoint_onto_a_file(tmp_path):
    out = tmp_path / "out"
    out.write_text("a file")
    with pytest.raises(DeepInferError, match="not a directory") as info:
        make_checkpoint("deepseek_v4", "tiny", "deepseek", 0, out, overwrite=True)
    assert "\n" not in str(info.value) and str(out) in str(info.value)
    assert out.read_text() == "a file"


# ----------------------------------------------------------------------------- the CLI

def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_HF_MODEL_DIR"} | env
    return subprocess.run([deepinfer_exe(), *args], capture_output=True, text=True, env=full_env, timeout=120)


def _assert_one_error_line(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_cli_run_on_a_corrupt_checkpoint(tiny_checkpoint_copy):
    shard = remove_tensor(tiny_checkpoint_copy, FP8_S)
    proc = _cli("run", "--model", str(tiny_checkpoint_copy), "--max-tokens", "1")
    _assert_one_error_line(proc, shard, FP8_S)


def test_cli_run_hub_id_offline(tmp_path):
    proc = _cli("run", "--model", "deepinfer-tests/no-such-model", "--max-tokens", "1",
                HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub-cache"), HF_HOME=str(tmp_path / "hf"))
    _assert_one_error_line(proc, "deepinfer-tests/no-such-model", "DEEPINFER_HF_MODEL_DIR")
