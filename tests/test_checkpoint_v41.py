"""DeepSeek-V4.1 checkpoints: make-checkpoint (DeepSeek and HF formats) loads back to the in-memory random
model's exact logits; the release's formats (FP8 32x32, FP4 experts, FP8 engram rows) dequantize exactly;
vision tensors are skipped; tokenizer, shard and config faults are one CheckpointError line; the CLI.

One tiny checkpoint per format is written per session (the DeepSeek one through embedded_tiny_dir, from a
clean cache); each test that changes files works on its own copy.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import deepinfer
from deepinfer.checkpoint.loader import INDEX_FILE, shard_map
from deepinfer.checkpoint.writer import write_checkpoint
from deepinfer.checkpoint.make import embedded_tiny_dir, make_checkpoint, preset_model_config, random_model
from deepinfer.errors import CheckpointError, ConfigError, DeepInferError
from deepinfer.kernels.quant import (dequantize_fp4, dequantize_fp8_blocks, e8m0_to_float, quantize_fp4,
                                     quantize_fp8_blocks)
from deepinfer.reference import compute_logits
from tests.helpers import deepinfer_exe

SEED = 0
FP8_W, FP8_S = "layers.0.attn.wq_b.weight", "layers.0.attn.wq_b.scale"     # [384, 48]: a ragged 32x32 block
FP4_W, FP4_S = "layers.3.ffn.experts.5.w2.weight", "layers.3.ffn.experts.5.w2.scale"
ENGRAM_W, ENGRAM_S = "layers.4.engram.embed.weight", "layers.4.engram.embed.scale"


@pytest.fixture(scope="session")
def v41(tmp_path_factory):
    """{"deepseek": the embedded tiny dir (built from an empty cache), "hf": the same model in HF format,
    "ids": a prompt batch, "logits": the in-memory random model's logits for it}."""
    root = tmp_path_factory.mktemp("v41")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))
        ds = embedded_tiny_dir("deepseek_v41", SEED)
    hf = make_checkpoint("deepseek_v41", "tiny", "hf", SEED, root / "hf")
    model = random_model("deepseek_v41", "tiny", SEED, dtype=torch.float32)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    return {"deepseek": ds, "hf": hf, "cache": root / "cache", "ids": ids, "logits": compute_logits(model, ids)}


@pytest.fixture
def ds_copy(v41, tmp_path) -> Path:
    return Path(shutil.copytree(v41["deepseek"], tmp_path / "ckpt"))


# ----------------------------------------------------------------------------- file helpers

def index(d: Path) -> dict:
    return json.loads((d / INDEX_FILE).read_text())["weight_map"]


def tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in shard_map(d):
        out.update(load_file(str(d / shard)))
    return out


def edit(d: Path, name: str, value: torch.Tensor | None) -> str:
    """Replace (value) or remove (None) tensor `name` in its shard (and the index)."""
    weight_map = index(d)
    shard = weight_map[name]
    data = load_file(str(d / shard))
    if value is None:
        del data[name], weight_map[name]
    else:
        data[name] = value
    save_file(data, str(d / shard), metadata={"format": "pt"})
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shard


def drop(d: Path, prefix: str) -> None:
    """Remove every tensor whose name starts with `prefix`, one rewrite per shard."""
    weight_map = index(d)
    for shard in shard_map(d):
        data = load_file(str(d / shard))
        save_file({k: v for k, v in data.items() if not k.startswith(prefix)}, str(d / shard),
                  metadata={"format": "pt"})
    weight_map = {k: v for k, v in weight_map.items() if not k.startswith(prefix)}
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def add(d: Path, new: dict[str, torch.Tensor]) -> str:
    weight_map = index(d)
    shard = sorted(set(weight_map.values()))[0]
    data = load_file(str(d / shard)) | new
    save_file(data, str(d / shard), metadata={"format": "pt"})
    weight_map.update({k: shard for k in new})
    (d / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shard


def text_config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())["text_config"]


def set_text_config(d: Path, **kw) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"].update(kw)
    (d / "config.json").write_text(json.dumps(cfg))


def load_error(path: Path, *fragments) -> str:
    with pytest.raises(CheckpointError) as info:
        deepinfer.load_model(path)
    msg = str(info.value)
    assert msg and "\n" not in msg, msg
    for fragment in fragments:
        assert str(fragment) in msg, (fragment, msg)
    return msg


def param(model, name: str) -> torch.Tensor:
    return model.state_dict()[name]


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("fmt", ["deepseek", "hf"])
def test_exports_load_to_the_in_memory_models_logits(v41, fmt):
    model = deepinfer.load_model(v41[fmt])
    assert model.cfg.model_type == "deepseek_v41" and model.hasher is not None
    assert torch.equal(compute_logits(model, v41["ids"]), v41["logits"])


def test_both_formats_hold_the_same_model(v41):
    a, b = deepinfer.load_model(v41["deepseek"]), deepinfer.load_model(v41["hf"])
    assert dataclasses.replace(a.cfg, quant=None) == b.cfg      # the HF export is dequantized
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_config_carries_the_tokenizers_compressed_vocab(v41):
    from tokenizers import Tokenizer
    from deepinfer.models.deepseek_v41.engram import compressed_token_map
    for fmt in ("deepseek", "hf"):
        _, size = compressed_token_map(Tokenizer.from_file(str(v41[fmt] / "tokenizer.json")))
        cfg = text_config(v41[fmt])
        assert cfg["engram_compressed_vocab_size"] == size
        assert 0 <= cfg["dspark_noise_token_id"] < cfg["vocab_size"]
    raw = json.loads((v41["deepseek"] / "config.json").read_text())
    assert raw["quantization_config"]["weight_block_size"] == [32, 32] and "engram_pad_token_id" in raw["text_config"]
    assert "quantization_config" not in json.loads((v41["hf"] / "config.json").read_text())


def test_deepseek_export_is_stored_like_the_release(v41):
    dtypes, shapes = {}, {}
    for shard in shard_map(v41["deepseek"]):
        with safe_open(str(v41["deepseek"] / shard), "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k)
                dtypes[k], shapes[k] = t.dtype, tuple(t.shape)
    fp8, e8m0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
    for name in ("layers.0.attn.wq_a", "layers.0.attn.wq_b", "layers.2.attn.wkv", "layers.0.attn.wo_a",
                 "layers.0.attn.wo_b", "layers.2.attn.indexer.wq_b", "layers.0.ffn.shared_experts.w2",
                 "layers.1.engram.wkv", "mtp.0.main_proj", "mtp.1.attn.wq_a"):
        assert (dtypes[f"{name}.weight"], dtypes[f"{name}.scale"]) == (fp8, e8m0), name
        rows, cols = shapes[f"{name}.weight"]
        assert shapes[f"{name}.scale"] == (-(-rows // 32), -(-cols // 32)), name
    assert dtypes[FP4_W] == torch.int8 and dtypes[FP4_S] == e8m0
    assert shapes[FP4_S] == (shapes[FP4_W][0], shapes[FP4_W][1] * 2 // 32)
    assert dtypes[ENGRAM_W] == fp8 and dtypes[ENGRAM_S] == e8m0 and shapes[ENGRAM_S] == (shapes[ENGRAM_W][0], 1)
    for name in ("embed.weight", "head.weight", "norm.weight", "layers.2.attn.compressor.wkv.weight",
                 "layers.2.attn.indexer.wk.weight", "layers.2.attn.indexer.weights_proj.weight",
                 "layers.1.engram.q_weight", "layers.1.engram.k_weight", "mtp.2.markov_head.embed.weight",
                 "mtp.2.confidence_head.proj.weight", "mtp.0.main_norm.weight"):
        assert dtypes[name] == torch.bfloat16, name
    for name in ("layers.0.hc_attn_fn", "layers.0.hc_ffn_base", "layers.0.attn.attn_sink", "layers.0.ffn.gate.bias",
                 "layers.0.ffn.gate.bias_vl", "mtp.0.ffn.gate.bias_vl"):
        assert dtypes[name] == torch.float32, name
    assert "layers.2.attn.compressor.wkv.scale" not in dtypes


def test_hf_export_names(v41):
    model = random_model("deepseek_v41", "tiny", SEED, dtype=torch.float32)
    want = {"lm_head.weight"}
    for name, t in model.state_dict().items():
        if ".ffn.experts.w" in name:
            base, w = name.rsplit(".", 1)
            want |= {f"model.{base}.{j}.{w}.weight" for j in range(t.shape[0])}
        elif name != "head.weight":
            want.add(f"model.{name}")
            if name.endswith("engram.embed.weight"):
                want.add(f"model.{name[:-len('.weight')]}.scale")   # all ones: transformers' parameter
    assert set(index(v41["hf"])) == want


def test_hf_checkpoint_without_mtp_loads_without_draft_stages(v41, tmp_path):
    d = Path(shutil.copytree(v41["hf"], tmp_path / "hf"))
    drop(d, "model.mtp.")
    model = deepinfer.load_model(d)
    assert model.cfg.num_nextn_predict_layers == 0
    assert not any(k.startswith("mtp.") for k in model.state_dict())
    assert torch.equal(compute_logits(model, v41["ids"]), v41["logits"])


# ----------------------------------------------------------------------------- formats, exact

def test_fp8_fp4_and_engram_rows_dequantize_exactly(ds_copy):
    """Fresh random on-disk values: the loaded parameters equal the kernels' dequantization (FP8 in the
    config's 32x32 blocks, FP4 per 32 along K) and the engram rows' per-32-channel scaling."""
    g = torch.Generator().manual_seed(5)
    disk = tensors(ds_copy)
    w8, s8 = quantize_fp8_blocks(torch.randn(disk[FP8_W].shape, generator=g) * 3, (32, 32), "ue8m0")
    w4, s4 = quantize_fp4(torch.randn(disk[FP4_W].shape[0], disk[FP4_W].shape[1] * 2, generator=g) * 0.1)
    rows, dim = disk[ENGRAM_W].shape
    we = (torch.randn(rows, dim, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    se = torch.randint(110, 135, (rows, dim // 32), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    for name, value in ((FP8_W, w8), (FP8_S, s8), (FP4_W, w4), (FP4_S, s4), (ENGRAM_W, we), (ENGRAM_S, se)):
        edit(ds_copy, name, value)
    model = deepinfer.load_model(ds_copy)
    assert torch.equal(param(model, FP8_W), dequantize_fp8_blocks(w8, s8, (32, 32), torch.float32))
    assert torch.equal(param(model, "layers.3.ffn.experts.w2")[5], dequantize_fp4(w4, s4, 32, torch.float32))
    by_hand = we.float() * e8m0_to_float(se).repeat_interleave(32, dim=1)
    assert torch.equal(param(model, ENGRAM_W), by_hand)


def test_keep_quantized_keeps_fp8_and_fp4(v41):
    model = deepinfer.load_model(v41["deepseek"], keep_quantized=True)
    wq_b = model.layers[0].attn.wq_b
    q = wq_b.quantized
    assert q.fmt == "fp8" and q.block == (32, 32) and q.data.dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize_fp8_blocks(q.data, q.scale, q.block, torch.float32), wq_b.weight)
    assert model.layers[1].engram.wkv.quantized.fmt == "fp8"
    assert model.layers[2].attn.compressor.wkv.quantized is None          # BF16 on disk
    experts = model.layers[3].ffn.experts
    e = experts.quantized["w2"][5]
    assert e.fmt == "fp4" and torch.equal(dequantize_fp4(e.data, e.scale, 32, torch.float32), experts.w2[5])


# ----------------------------------------------------------------------------- vision, tokenizer

@pytest.mark.parametrize("prefix", ["", "model."], ids=["deepseek-names", "hf-names"])
def test_vision_tensors_are_skipped_with_one_log_line(ds_copy, caplog, prefix):
    vision = {f"{prefix}vision.blocks.0.attn.wqkv.weight": torch.zeros(12, 4, dtype=torch.bfloat16),
              f"{prefix}vision.patch_embed.weight": torch.zeros(4, 6, dtype=torch.bfloat16),
              f"{prefix}aligner.fc1.weight": torch.zeros(4, 4, dtype=torch.float8_e4m3fn),
              f"{prefix}image_start": torch.zeros(64), f"{prefix}image_end": torch.zeros(64),
              f"{prefix}image_newline": torch.zeros(64)}
    add(ds_copy, vision)
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        deepinfer.load_model(ds_copy)
    lines = [r.getMessage() for r in caplog.records if "vision" in r.getMessage()]
    assert lines == ["skipped 6 vision tensors (text-only model)"]


def test_missing_tokenizer_json(ds_copy):
    (ds_copy / "tokenizer.json").unlink()
    load_error(ds_copy, "tokenizer.json", str(ds_copy), "engram")


def test_corrupt_tokenizer_json(ds_copy):
    (ds_copy / "tokenizer.json").write_text("{not json")
    load_error(ds_copy, "tokenizer.json", "re-download")


def test_compressed_vocab_mismatch(ds_copy):
    size = text_config(ds_copy)["engram_compressed_vocab_size"]
    set_text_config(ds_copy, engram_compressed_vocab_size=size + 1)
    load_error(ds_copy, "engram_compressed_vocab_size", str(size + 1), "tokenizer.json")


# ----------------------------------------------------------------------------- shards and tensors

def test_missing_shard(ds_copy):
    shard = index(ds_copy)[ENGRAM_W]
    (ds_copy / shard).unlink()
    load_error(ds_copy, shard, "missing", INDEX_FILE)


def test_truncated_shard(ds_copy):
    shard = index(ds_copy)[ENGRAM_W]
    data = (ds_copy / shard).read_bytes()
    (ds_copy / shard).write_bytes(data[: len(data) // 2])
    load_error(ds_copy, shard, "corrupt or truncated")


@pytest.mark.parametrize("name", [ENGRAM_W, "layers.1.engram.q_weight", "layers.0.ffn.gate.bias_vl",
                                  "mtp.2.markov_head.embed.weight"])
def test_missing_tensor(ds_copy, name):
    edit(ds_copy, name, None)
    if name == ENGRAM_W:
        load_error(ds_copy, ENGRAM_S, "no quantized weight")
    else:
        load_error(ds_copy, name, "missing")


def test_engram_table_without_scale(ds_copy):
    shard = edit(ds_copy, ENGRAM_S, None)
    load_error(ds_copy, ENGRAM_W, shard, "no scale")


@pytest.mark.parametrize("which", ["scale", "weight"])
def test_engram_table_wrong_shape(ds_copy, which):
    disk = tensors(ds_copy)
    name = ENGRAM_S if which == "scale" else ENGRAM_W
    shard = edit(ds_copy, name, disk[name][:-1].contiguous())
    load_error(ds_copy, ENGRAM_W, shard, "shape" if which == "weight" else "scale")


def test_wrong_shape_of_a_32x32_scale(ds_copy):
    shard = edit(ds_copy, FP8_S, torch.ones(3, 3).to(torch.float8_e8m0fnu))
    load_error(ds_copy, FP8_S, shard, "(3, 3)", "(12, 2)", "32x32")


# ----------------------------------------------------------------------------- make-checkpoint options, CLI

def test_layers_and_engram_vocab_size_pass_through():
    from deepinfer.models.deepseek_v41.engram import engram_layout
    cfg, tok = preset_model_config("deepseek_v41", "tiny", layers=6, engram_vocab_size=70)
    assert cfg.num_hidden_layers == 6 and cfg.engram_vocab_size == 70
    assert cfg.engram_num_embeddings == tuple(sum(map(sum, layer)) for layer in engram_layout(cfg))
    assert tok.get_vocab_size() == cfg.vocab_size
    with pytest.raises(ConfigError, match="engram_vocab_size"):
        preset_model_config("deepseek_v4", "tiny", engram_vocab_size=70)


def test_cli_make_checkpoint_v41(tmp_path, v41):
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_HF_MODEL_DIR"}
    out = tmp_path / "ck"
    proc = subprocess.run([deepinfer_exe(), "make-checkpoint", "--arch", "deepseek_v41", "--preset", "tiny",
                           "--format", "deepseek", "--seed", str(SEED), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "deepseek_v41/tiny" in proc.stdout
    assert index(out) == index(v41["deepseek"])     # same model as the embedded one
    assert (out / "tokenizer.json").read_bytes() == (v41["deepseek"] / "tokenizer.json").read_bytes()


def _main(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    from deepinfer.cli import main
    monkeypatch.setattr(sys, "argv", ["deepinfer", *args])
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args,fragment", [
    (("--preset", "huge"), "'huge' is not one of 'tiny', 'flash'"),
    (("--arch", "deepseek_v4", "--engram-vocab-size", "70"), "--engram-vocab-size sizes V4.1's engram tables"),
], ids=["bad-preset", "engram-size-for-v4"])
def test_cli_make_checkpoint_errors_are_one_line(monkeypatch, capsys, tmp_path, args, fragment):
    code, _, err = _main(monkeypatch, capsys, "make-checkpoint", "--arch", "deepseek_v41", *args,
                         "--out", str(tmp_path / "x"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
    assert not (tmp_path / "x").exists()


def test_cli_run_defaults_to_the_v41_tiny_model(monkeypatch, capsys, v41):
    monkeypatch.setenv("XDG_CACHE_HOME", str(v41["cache"]))       # the session's (already built) cache
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    code, out, err = _main(monkeypatch, capsys, "run", "--max-tokens", "4")
    assert code == 0, err
    assert "loaded deepseek_v41 (10 layers)" in out and "output: " in out



def test_fp4_resident_experts_load_and_write_the_release_bytes(v41, tmp_path):
    """expert_storage="fp4": the packed e2m1 bytes and e8m0 scales go into the model as stored, give the
    dense model's logits, and write back byte for byte; a bf16 (HF) checkpoint is refused in one line."""
    resident = deepinfer.load_model(v41["deepseek"], expert_storage="fp4")
    assert torch.equal(compute_logits(resident, v41["ids"]), v41["logits"])
    write_checkpoint(resident, tmp_path / "again", "deepseek")
    before, after = tensors(v41["deepseek"]), tensors(tmp_path / "again")
    experts = [k for k in before if ".ffn.experts." in k]
    assert experts and all(torch.equal(before[k].view(torch.uint8), after[k].view(torch.uint8)) for k in experts)
    with pytest.raises(CheckpointError, match="FP4-resident.*expert_storage='dense'") as info:
        deepinfer.load_model(v41["hf"], expert_storage="fp4")
    assert "\n" not in str(info.value)
    with pytest.raises(DeepInferError, match="'fp8' is not supported for deepseek_v41; use 'dense' or 'fp4'"):
        deepinfer.load_model(v41["deepseek"], expert_storage="fp8")
