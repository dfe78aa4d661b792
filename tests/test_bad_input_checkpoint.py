"""Bad input to make-checkpoint and to checkpoint loading (issue 13): one `error:` line (exit 2) or one
DeepInferError line, never a traceback, and nothing written or left half-written.

Table-driven: every case is a row; the tiny deepseek_v4 checkpoint (conftest.py) is copied per test and
corrupted. Filesystem failures that need privileges (read-only mounts, mount points, full disks, busy
directories) are injected by monkeypatching the one call that would fail, so the tests run anywhere;
the same paths were probed by hand on real tmpfs mounts (read-only, 600 KiB, mount point).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import deepinfer
import deepinfer.checkpoint.writer as writer
from deepinfer.checkpoint.loader import INDEX_FILE
from deepinfer.checkpoint.make import make_checkpoint
from deepinfer.cli import cli
from deepinfer.errors import CheckpointError, DeepInferError
from tests.bad_input import refuse_api, refuse_cli

ARCH = ["--arch", "deepseek_v4"]       # the cheaper tiny model (no tokenizer-first V4.1 path)
FP8_W = "layers.0.attn.wq_a.weight"
FP8_S = "layers.0.attn.wq_a.scale"
FP4_W = "layers.2.ffn.experts.3.w2.weight"
FP4_S = "layers.2.ffn.experts.3.w2.scale"
BF16 = "layers.1.attn_norm.weight"
FP32 = "layers.0.hc_attn_fn"
TID2EID = "layers.0.ffn.gate.tid2eid"


# ----------------------------------------------------------------------------- helpers

def weight_map(d: Path) -> dict:
    return json.loads((d / INDEX_FILE).read_text())["weight_map"]


def edit_tensor(d: Path, name: str, edit) -> str:
    """Rewrite the shard holding `name` after `edit(tensor)` changed it in place; returns the shard name."""
    shard = weight_map(d)[name]
    tensors = load_file(str(d / shard))
    edit(tensors[name])
    save_file(tensors, str(d / shard), metadata={"format": "pt"})
    return shard


def set_bytes(index, value):
    """An edit writing raw byte `value` at flat byte position(s) `index` (FP8 codes, e8m0 scales)."""
    return lambda t: t.view(torch.uint8).view(-1).__setitem__(index, value)


def set_value(index, value):
    return lambda t: t.view(-1).__setitem__(index, value)


def raising_for(paths, exc, real):
    """A stand-in for `real(path, ...)` that raises `exc` for the given paths and is `real` elsewhere."""
    paths = {os.fspath(p) for p in paths}

    def fake(path, *args, **kwargs):
        if os.fspath(path) in paths or any(os.fspath(path).startswith(p + os.sep) for p in paths):
            raise exc
        return real(path, *args, **kwargs)
    return fake


# ----------------------------------------------------------------------------- 1. make-checkpoint --out

def _read_only_chmod(tmp_path, monkeypatch):
    if os.geteuid() == 0:
        pytest.skip("root ignores directory permissions")
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o555)
    return parent / "ck", [], "is not writable.*Permission denied"


def _read_only_filesystem(tmp_path, monkeypatch):
    parent = tmp_path / "rofs"
    parent.mkdir()
    monkeypatch.setattr(os, "mkdir", raising_for([parent], OSError(errno.EROFS, os.strerror(errno.EROFS)), os.mkdir))
    return parent / "deeper" / "ck", [], "rofs is not writable.*Read-only file system.*writable filesystem"


def _mount_point(tmp_path, monkeypatch):
    out = tmp_path / "mnt"
    out.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: os.fspath(p) == str(out) or real(p))
    return out, [], "is a mount point.*use a directory inside it"


def _disk_full_mid_write(tmp_path, monkeypatch):
    """The second shard fails with ENOSPC (safetensors' own error text); the first is already written."""
    calls = []
    real = writer.save_file

    def fake(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, metadata=metadata)
    monkeypatch.setattr(writer, "save_file", fake)
    return tmp_path / "new" / "parents" / "ck", [], "No space left on device; free some space"


def _disk_full_overwrite(tmp_path, monkeypatch):
    """--overwrite of an existing checkpoint, disk full while writing the new one: the old one stays."""
    out = Path(shutil.copytree(tmp_path / "seed-ckpt", tmp_path / "old"))
    monkeypatch.setattr(writer, "save_file", lambda *a, **k: (_ for _ in ()).throw(
        SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")))
    return out, ["--overwrite"], "old: No space left on device"


def _busy_on_replace(tmp_path, monkeypatch):
    """--overwrite where renaming the old checkpoint aside fails (EBUSY): the old one stays, temp dir gone."""
    out = Path(shutil.copytree(tmp_path / "seed-ckpt", tmp_path / "busy"))
    monkeypatch.setattr(os, "rename", raising_for([out], OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(out)),
                                                  os.rename))
    return out, ["--overwrite"], r"busy \(.*busy\): Device or resource busy; .*use a directory inside it"


def _empty_out(tmp_path, monkeypatch):
    return "", [], "--out is empty"


MAKE_CASES = {
    "read-only-dir": _read_only_chmod,
    "read-only-fs": _read_only_filesystem,
    "mount-point": _mount_point,
    "disk-full-mid-write": _disk_full_mid_write,
    "disk-full-overwrite": _disk_full_overwrite,
    "busy-on-replace": _busy_on_replace,
    "empty-out": _empty_out,
}


@pytest.mark.parametrize("case", list(MAKE_CASES))
def test_make_checkpoint_refuses_an_unwritable_out(case, tmp_path, monkeypatch, tiny_checkpoint_dir):
    shutil.copytree(tiny_checkpoint_dir, tmp_path / "seed-ckpt")
    out, extra, match = MAKE_CASES[case](tmp_path, monkeypatch)
    old = Path(out) / "config.json" if out else None
    old_inode = old.stat().st_ino if old is not None and old.is_file() else None
    refuse_cli(cli, ["make-checkpoint", *ARCH, "--out", str(out), *extra], match=match, watch=[tmp_path])
    if old_inode is not None:                    # the very same old checkpoint, not a rewritten one
        assert old.stat().st_ino == old_inode
    assert not [p for p in tmp_path.rglob(".*") if ".tmp-" in p.name or ".old-" in p.name or ".probe-" in p.name]


def test_checks_before_building_the_model(tmp_path, monkeypatch):
    """Mount point and unwritable parent are refused before any model is built (a released width takes minutes)."""
    import deepinfer.checkpoint.make as make

    monkeypatch.setattr(make, "_random_model", lambda *a, **k: pytest.fail("model built before the --out check"))
    for setup in (_mount_point, _read_only_filesystem):
        out, _, match = setup(tmp_path, monkeypatch)
        refuse_api(lambda: make_checkpoint("deepseek_v4", "tiny", "deepseek", 0, out), DeepInferError, match,
                   watch=[tmp_path])


# ----------------------------------------------------------------------------- 2. file modes follow the umask

@pytest.mark.parametrize("umask,dir_mode,file_mode", [(0o022, 0o755, 0o644), (0o027, 0o750, 0o640)],
                         ids=["umask-022", "umask-027"])
@pytest.mark.parametrize("fmt", ["deepseek", "hf"])
def test_written_checkpoint_follows_the_umask(tmp_path, umask, dir_mode, file_mode, fmt):
    old = os.umask(umask)
    try:
        out = make_checkpoint("deepseek_v4", "tiny", fmt, 0, tmp_path / "ck")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == dir_mode
    files = sorted(out.iterdir())
    assert {p.name for p in files} >= {"config.json", INDEX_FILE, "tokenizer.json", "tokenizer_config.json"}
    assert any(p.suffix == ".safetensors" for p in files)
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == file_mode, (p.name, oct(p.stat().st_mode))


# ----------------------------------------------------------------------------- 3. non-finite weights

NONFINITE_CASES = {
    # id: (tensor edited, edit, tensor named in the error, non-finite count)
    "nan-bf16": (BF16, set_value(3, float("nan")), BF16, 1),
    "inf-fp32": (FP32, set_value(0, float("-inf")), FP32, 1),
    "nan-fp8-code": (FP8_W, set_bytes(5, 0x7F), FP8_W, 1),                  # e4m3fn NaN encoding
    "inf-fp8-dequantized": (FP8_S, set_bytes(slice(None), 254), FP8_W, None),  # 2^127 x fp8 overflows to inf
    "nan-e8m0-fp8-scale": (FP8_S, set_bytes(0, 0xFF), FP8_W, None),
    "nan-e8m0-fp4-scale": (FP4_S, set_bytes(0, 0xFF), FP4_W, 32),          # one scale = 32 weights along K
}


@pytest.mark.parametrize("case", list(NONFINITE_CASES))
def test_non_finite_weights_are_refused(tiny_checkpoint_copy, case):
    edited, edit, named, count = NONFINITE_CASES[case]
    shard = edit_tensor(tiny_checkpoint_copy, edited, edit)
    count = r"\d+" if count is None else str(count)
    refuse_api(lambda: deepinfer.load_model(tiny_checkpoint_copy), CheckpointError,
               rf"{re.escape(shard)}: tensor {re.escape(named)}: {count} of its \d+ .*non-finite.*re-download or "
               rf"re-export", watch=[tiny_checkpoint_copy])


def test_non_finite_weights_through_the_cli(tiny_checkpoint_copy):
    edit_tensor(tiny_checkpoint_copy, BF16, set_value(0, float("nan")))
    refuse_cli(cli, ["run", "--model", str(tiny_checkpoint_copy), "--max-tokens", "1"],
               match=rf"tensor {re.escape(BF16)}: 1 of its", watch=[tiny_checkpoint_copy])


@pytest.fixture(scope="module")
def v41_two_layers(tmp_path_factory) -> Path:
    return make_checkpoint("deepseek_v41", "tiny", "deepseek", 0, tmp_path_factory.mktemp("v41") / "ck", layers=2)


def test_nan_scale_of_fp4_resident_experts(v41_two_layers, tmp_path):
    """expert_storage="fp4" keeps e2m1 bytes (no NaN possible) and e8m0 scales: the scale byte 0xFF is checked."""
    d = Path(shutil.copytree(v41_two_layers, tmp_path / "ck"))
    name = "layers.1.ffn.experts.0.w1.scale"
    shard = edit_tensor(d, name, set_bytes(2, 0xFF))
    refuse_api(lambda: deepinfer.load_model(d, expert_storage="fp4"), CheckpointError,
               rf"{re.escape(shard)}: tensor {re.escape(name)}: 1 of its \d+ e8m0 scales are NaN", watch=[d])


# ----------------------------------------------------------------------------- 4. tid2eid rows repeat an expert

@pytest.mark.parametrize("token,slot", [(0, 1), (5, 1), (511, 1)], ids=["first-token", "token-5", "last-token"])
def test_tid2eid_repeated_expert(tiny_checkpoint_copy, token, slot):
    def repeat(t):
        t[token, slot] = t[token, 0]
    shard = edit_tensor(tiny_checkpoint_copy, TID2EID, repeat)
    refuse_api(lambda: deepinfer.load_model(tiny_checkpoint_copy), CheckpointError,
               rf"{re.escape(shard)}: tensor {re.escape(TID2EID)} routes token id {token} to expert \d+ more than "
               rf"once \(row \[(\d+), \1\]\)", watch=[tiny_checkpoint_copy])


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_random_init_tid2eid_rows_are_distinct(seed):
    from deepinfer.checkpoint.names import checkpoint_tensors
    from deepinfer.checkpoint.random_init import init_random_weights
    from deepinfer.config.presets import TINY_V4
    from deepinfer.models import build_model

    model = build_model(TINY_V4, "cpu", torch.float32)
    init_random_weights(model, seed)
    tables = {n: t for n, t in checkpoint_tensors(model).items() if n.endswith("tid2eid")}
    assert tables
    for name, t in tables.items():
        rows = t.sort(dim=-1).values
        assert not (rows[:, 1:] == rows[:, :-1]).any(), name
        assert t.min() >= 0 and t.max() < TINY_V4.n_routed_experts


# ----------------------------------------------------------------------------- 5. the index and its shards

def _point_shard(target):
    def edit(d: Path) -> str:
        index = json.loads((d / INDEX_FILE).read_text())
        first = sorted(set(index["weight_map"].values()))[0]
        index["weight_map"] = {k: (target(d) if v == first else v) for k, v in index["weight_map"].items()}
        (d / INDEX_FILE).write_text(json.dumps(index))
        return "not a file name inside"
    return edit


def _shard_is_a_dir(d: Path) -> str:
    shard = sorted(set(weight_map(d).values()))[0]
    (d / shard).unlink()
    (d / shard).mkdir()
    return f"{re.escape(shard)} listed in .* is a directory"


def _index_is_a_dir(d: Path) -> str:
    (d / INDEX_FILE).unlink()
    (d / INDEX_FILE).mkdir()
    return f"{re.escape(INDEX_FILE)} is a directory, not a file"


def _index_not_an_object(d: Path) -> str:
    (d / INDEX_FILE).write_text('"weight_map"')
    return "not a valid safetensors index"


INDEX_CASES = {
    "shard-absolute-path": _point_shard(lambda d: str(d.parent / "elsewhere.safetensors")),
    "shard-outside-dir": _point_shard(lambda d: "../elsewhere.safetensors"),
    "shard-is-a-dir": _shard_is_a_dir,
    "index-is-a-dir": _index_is_a_dir,
    "index-not-an-object": _index_not_an_object,
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_bad_index_entries(tiny_checkpoint_copy, case):
    shutil.copy(next(tiny_checkpoint_copy.glob("*.safetensors")), tiny_checkpoint_copy.parent / "elsewhere.safetensors")
    match = INDEX_CASES[case](tiny_checkpoint_copy)
    refuse_api(lambda: deepinfer.load_model(tiny_checkpoint_copy), CheckpointError, match,
               watch=[tiny_checkpoint_copy.parent])


@pytest.mark.parametrize("exact", [True, False])
def test_tensor_stored_in_another_float_dtype_is_said_once(tiny_checkpoint_copy, exact, caplog):
    """A bf16 tensor stored as float32 loads (the values go into the model's dtype either way) with one warning
    line naming it, the dtypes, and whether its values were bf16 values exactly."""
    def widen(d: Path):
        shard = weight_map(d)[BF16]
        tensors = load_file(str(d / shard))
        t = tensors[BF16].float()
        if not exact:
            t.view(-1)[0] += 2 ** -20 * max(float(t.view(-1)[0].abs()), 1.0)        # below bf16's resolution
        tensors[BF16] = t
        save_file(tensors, str(d / shard), metadata={"format": "pt"})
    widen(tiny_checkpoint_copy)
    with caplog.at_level("WARNING", logger="deepinfer"):
        deepinfer.load_model(tiny_checkpoint_copy)
    lines = [r.getMessage() for r in caplog.records if "another float dtype" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "1 tensor(s) in another float dtype" in lines[0] and BF16 in lines[0]
    assert "1 stored as float32 where the release stores bfloat16" in lines[0]
    assert ("all hold values of the release dtype exactly" in lines[0]) == exact
    assert ("1 hold values the release dtype cannot represent" in lines[0]) == (not exact)


def test_release_dtypes_load_without_the_warning(tiny_checkpoint_dir, caplog):
    with caplog.at_level("WARNING", logger="deepinfer"):
        deepinfer.load_model(tiny_checkpoint_dir)
    assert not [r for r in caplog.records if "another float dtype" in r.getMessage()]
