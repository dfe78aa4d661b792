"""Result rows of a benchmark run: identity and environment, and a store that never loses a finished row.

A run directory holds `rows.jsonl` (one JSON object per finished point, appended and fsync'd as each point
finishes: a kill -9 can at most tear the line being written, which the next open drops) and `raw/<key>.json`
(the vLLM-bench-compatible raw result of each point, written atomically: temp file, then rename). Resume reads
the keys of the complete rows and skips those points; failure rows (`"status": "failed"`) are kept but not
counted as done, so a resumed run retries them."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

from deepinfer.errors import DeepInferError

SCHEMA_VERSION = "1"      # the row layout
METHOD_VERSION = "2"      # how points are measured (2: request clocks = client send times)
PACKAGES = ("deepinfer", "torch", "transformers", "tokenizers", "numpy", "safetensors")


class ReportDirError(DeepInferError):
    """The report directory cannot be created or written."""


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def run_id_for(run_id: str | None, name: str) -> str:
    """`run_id`, checked (it names a directory), or a new one: local time + `name`."""
    from .sweep_config import NAME_RE
    run_id = run_id or f"{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-{name}"
    if not NAME_RE.fullmatch(run_id):
        raise DeepInferError(f"--run-id {run_id!r}: use letters, digits and . _ - only, starting with a letter or "
                             f"digit")
    return run_id


def git_state(cwd: str | os.PathLike | None = None) -> dict:
    """{"sha": commit or None, "dirty": bool or None} of the checkout holding this package (or cwd)."""
    where = cwd or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=where).stdout.strip() or None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                text=True, timeout=10, cwd=where)
        dirty = bool(status.stdout.strip()) if status.returncode == 0 and sha else None
    except (OSError, subprocess.SubprocessError):
        sha, dirty = None, None
    return {"sha": sha, "dirty": dirty}


def package_versions() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def hardware() -> dict:
    """CPU model and core count; GPU name, count, CUDA and driver version when a GPU is visible."""
    import torch
    info = {"cpu": _cpu_model(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "gpu": None, "gpu_count": 0, "cuda": torch.version.cuda,
            "driver": None}
    if torch.cuda.is_available():
        info.update(gpu=torch.cuda.get_device_name(), gpu_count=torch.cuda.device_count(), driver=_driver())
    return info


def environment() -> dict:
    return {"git": git_state(), "packages": package_versions(), "hardware": hardware(), "time": utc_now()}


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def json_safe(value):
    """NaN / inf (a metric with no samples, e.g. TPOT of one-token outputs) become null: rows stay strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write text to path through a temp file in the same directory and a rename: readers see the old file or
    the whole new one, never a half-written one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_rows(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of a run, read only (a sweep may be appending): a last line without its newline is not a row
    yet; any other line that is not JSON is one error line naming file and line."""
    path = Path(run_dir) / "rows.jsonl"
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")[:-1]                  # what follows the last newline is still being written
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            if n == len(lines):                      # the writer cuts a torn last line when it reopens
                break
            raise DeepInferError(f"{path}:{n}: not a JSON row; repair or remove that line, then rerun") from None
    return rows


class RowStore:
    """The rows of one run directory (created if missing)."""

    def __init__(self, run_dir: str | os.PathLike):
        self.dir = Path(run_dir)
        try:
            (self.dir / "raw").mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ReportDirError(f"cannot write the report directory {self.dir}: {e.strerror or e}; choose a "
                                 f"writable --report-dir") from None
        self.path = self.dir / "rows.jsonl"
        self._drop_torn_tail()

    def rows(self) -> list[dict]:
        return read_rows(self.dir)

    def done_keys(self) -> set[str]:
        """Keys of points that finished (failed points are retried on resume)."""
        return {r["key"] for r in self.rows() if r.get("status") == "ok"}

    def append(self, row: dict) -> None:
        """Append one finished point's row and make it durable before returning."""
        if "key" not in row or "status" not in row:
            raise ValueError("a row needs 'key' and 'status'")
        line = json.dumps(json_safe(row), sort_keys=True, allow_nan=False) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

    def write_raw(self, key: str, raw: dict) -> Path:
        path = self.dir / "raw" / f"{key.replace('/', '__')}.json"
        atomic_write_text(path, json.dumps(json_safe(raw), indent=1, sort_keys=True, allow_nan=False) + "\n")
        return path

    def _drop_torn_tail(self) -> None:
        """A kill mid-append can leave a last line without its newline (or not valid JSON): cut it off."""
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        keep = data if data.endswith(b"\n") else data[:data.rfind(b"\n") + 1]
        lines = keep.splitlines(keepends=True)
        while lines:
            try:
                json.loads(lines[-1])
                break
            except ValueError:
                lines.pop()
        keep = b"".join(lines)
        if keep != data:
            with open(self.path, "wb") as f:
                f.write(keep)
                f.flush()
                os.fsync(f.fileno())
