"""Result rows of a benchmark run: identity and environment, and a store that never loses a finished row.

A run directory holds `rows.jsonl` (one JSON object per finished point, appended and fsync'd as each point
finishes) and `raw/<key>.json` (the vLLM-bench-compatible raw result of each point, written atomically: temp
file, then rename). A row is durable once its newline is: a last line without its newline is a torn write (a
kill -9 mid-append), which readers skip and the writer cuts off when it reopens the run. A newline-terminated
line that is not a JSON row (invalid JSON, not an object, no key / status) is corruption, wherever it is: one
`CorruptRowError` line naming file:line and what to do; nothing drops it. Resume reads the keys of the complete
rows and skips those points; failure rows (`"status": "failed"`) are kept but not counted as done, so a resumed
run retries them.

Run directories are made only once a run's checks have passed (`run_dir_guard` removes one this invocation
made when the run fails before its first row)."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from deepinfer.env import settings
from deepinfer.errors import DeepInferError

from .traffic import traffic_warning

SCHEMA_VERSION = "1"      # the row layout
METHOD_VERSION = "2"      # how points are measured (2: request clocks = client send times)
PACKAGES = ("deepinfer", "torch", "transformers", "tokenizers", "numpy", "safetensors")


class ReportDirError(DeepInferError):
    """The report directory cannot be created or written."""


class CorruptRowError(DeepInferError):
    """A complete line of rows.jsonl is not a JSON row (`path`, `line`: where)."""

    def __init__(self, path: Path, line: int, why: str):
        self.path, self.line, self.why = Path(path), line, why
        super().__init__(f"{path}:{line}: not a JSON row ({why}); repair or remove that line (the run's other "
                         f"rows are intact), then rerun")

    @property
    def short(self) -> str:
        """'rows.jsonl:7 is not a JSON row', for listings."""
        return f"{self.path.name}:{self.line} is not a JSON row"


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


def run_dir_for(report_dir: str | os.PathLike, run_id: str | None, out: str | os.PathLike | None, name: str) -> Path:
    """A bench's run directory: `out` as given, else report_dir/<schema>/<run_id or name-time>."""
    if out is not None:
        return Path(out)
    return Path(report_dir) / SCHEMA_VERSION / run_id_for(run_id or f"{name}-{_dt.datetime.now():%Y%m%d-%H%M%S}", name)


# what `dirty` looks at: the whole checkout but reports/ (results are data, not the code that ran)
CODE_PATHSPEC = ("--", ":(top)", ":(top,exclude)reports")


def git_state(cwd: str | os.PathLike | None = None) -> dict:
    """{"sha": commit or None, "dirty": bool or None} of the checkout holding this package (or cwd): the code
    that ran, so changes under reports/ do not make it dirty. Git's output never reaches the terminal."""
    where = cwd or Path(__file__).resolve().parent
    try:
        sha = (_git(["rev-parse", "HEAD"], where) or "").strip() or None
        status = _git(["status", "--porcelain", "--untracked-files=no", *CODE_PATHSPEC], where) if sha else None
    except (OSError, subprocess.SubprocessError):
        sha, status = None, None
    return {"sha": sha, "dirty": None if status is None else bool(status.strip())}


def _git(args: list[str], cwd) -> str | None:
    """stdout of `git ARGS` in cwd, or None when it fails (stderr captured, never printed)."""
    out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=cwd,
                         stdin=subprocess.DEVNULL)
    return out.stdout if out.returncode == 0 else None


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
    return {"git": git_state(), "packages": package_versions(), "hardware": hardware(), "time": utc_now(),
            "engine_env": settings()}


def identity(env: dict, method_version: str, *, packages: bool = True, hardware_info: bool = False,
             **fields) -> dict:
    """The fields every row of a run carries: the row layout and measuring method, where it ran (hardware, the
    code's git state and, unless packages=False, package versions; hardware_info: the whole hardware dict), the
    DEEPINFER_* switches set (engine_env) and the bench's own `fields` (model, device, settings). `env`:
    environment() of the run."""
    row = {"schema_version": SCHEMA_VERSION, "method_version": method_version,
           "hardware": env["hardware"]["gpu"] or env["hardware"]["cpu"], "git_sha": env["git"]["sha"],
           "git_dirty": env["git"]["dirty"], "engine_env": env.get("engine_env", {})}
    if packages:
        row["packages"] = env["packages"]
    if hardware_info:
        row["hardware_info"] = env["hardware"]
    return {**row, **fields}


def kernel_fields(llm) -> dict:
    """The kernel backend set an engine runs, the backend each op resolved to, and how its FP4 experts are laid out
    ("rows": our kernel's; "hopper_mx": triton_kernels' matmul_ogs reads them, kernels/experts_ogs.py; None: no FP4
    experts)."""
    from deepinfer.models.common.moe import expert_layout
    stats = llm.stats
    return {"kernel_backend": stats.kernel_backend, "kernel_backends": dict(stats.kernel_backends),
            "expert_layout": expert_layout(llm.model)}


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
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """atomic_write_text's bytes twin (a PNG chart)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise ReportDirError(f"cannot write {path}: {e.strerror or e}; check that its folder is writable") from None


def _complete_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """(the newline-terminated lines, the torn tail after the last newline: b"" when there is none)."""
    cut = data.rfind(b"\n") + 1
    return data[:cut].split(b"\n")[:-1], data[cut:]


def _parse_rows(path: Path, lines: list[bytes]) -> list[dict]:
    """Every complete line as a row (blank lines carry nothing and are skipped); CorruptRowError otherwise."""
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            why = "not UTF-8" if isinstance(e, UnicodeDecodeError) else "invalid JSON"
            raise CorruptRowError(path, n, why) from None
        if not isinstance(row, dict):
            raise CorruptRowError(path, n, f"a JSON {type(row).__name__}, not an object")
        if "key" not in row or "status" not in row:
            raise CorruptRowError(path, n, "an object without 'key' and 'status'")
        rows.append(row)
    return rows


def read_rows(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of a run, read only (a sweep may be appending): a last line without its newline is not a row
    yet and is skipped; any complete line that is not a JSON row is a CorruptRowError naming file and line."""
    path = Path(run_dir) / "rows.jsonl"
    if not path.exists():
        return []
    return _parse_rows(path, _complete_lines(path.read_bytes())[0])


def check_writable(run_dir: str | os.PathLike) -> None:
    """Before a run makes anything: its directory can be made there (the nearest existing folder on the way is a
    directory we may write); one ReportDirError line otherwise."""
    run_dir = there = Path(run_dir)
    while not there.exists() and there != there.parent:
        there = there.parent
    why = "is not a directory" if not there.is_dir() else \
        "is not writable" if not os.access(there, os.W_OK | os.X_OK) else None
    if why:
        raise ReportDirError(f"cannot write the run directory {run_dir}: {there} {why}; choose a writable "
                             f"directory (--report-dir / --out)")


def refuse_existing_rows(run_dir: str | os.PathLike, resumable: bool = True) -> None:
    """A new run may not reuse a run directory that has rows (one line saying what to do instead); the directory
    must be one that can be written (check_writable)."""
    check_writable(run_dir)
    if (Path(run_dir) / "rows.jsonl").exists():
        how = "pass --resume to continue it, or a new --run-id" if resumable else "choose a new --run-id"
        raise DeepInferError(f"run {run_dir} already has rows: {how}")


def has_rows(run_dir: str | os.PathLike) -> bool:
    """Whether anything was ever appended to the run's rows.jsonl (a failure row, even a torn one, counts)."""
    path = Path(run_dir) / "rows.jsonl"
    return path.is_file() and path.stat().st_size > 0


@contextlib.contextmanager
def run_dir_guard(run_dir: str | os.PathLike):
    """Around a run that may create `run_dir`: when the run raises (Ctrl-C included) before its first row, the
    directories this invocation created (run_dir and any parents that were missing) are removed. A folder that
    existed before (a --resume run's) or one holding rows stays: failure rows are results."""
    run_dir = Path(run_dir)
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]    # deepest first
    try:
        yield
    except BaseException:
        if created and not has_rows(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
            for parent in created[1:]:
                with contextlib.suppress(OSError):     # rmdir: only while empty (another run may be there now)
                    parent.rmdir()
        raise


class RowStore:
    """The rows of one run directory (created if missing). Opening checks every complete row and cuts a torn
    tail; a corrupt complete line is a CorruptRowError, and the file is left as it is."""

    def __init__(self, run_dir: str | os.PathLike):
        self.dir = Path(run_dir)
        self.path = self.dir / "rows.jsonl"
        self._cut_torn_tail()
        try:
            (self.dir / "raw").mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".write-test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as e:
            raise ReportDirError(f"cannot write the report directory {self.dir}: {e.strerror or e}; choose a "
                                 f"writable --report-dir") from None

    def rows(self) -> list[dict]:
        return read_rows(self.dir)

    def done_keys(self) -> set[str]:
        """Keys of points that finished (failed points are retried on resume)."""
        return done_keys(self.rows())

    def append(self, row: dict) -> None:
        """Append one finished point's row and make it durable before returning."""
        if "key" not in row or "status" not in row:
            raise ValueError("a row needs 'key' and 'status'")
        line = json.dumps(json_safe(row), sort_keys=True, allow_nan=False) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        warning = traffic_warning(row)
        if warning:
            print(warning, file=sys.stderr)

    def write_raw(self, key: str, raw: dict) -> Path:
        path = self.dir / "raw" / f"{key.replace('/', '__')}.json"
        atomic_write_text(path, json.dumps(json_safe(raw), indent=1, sort_keys=True, allow_nan=False) + "\n")
        return path

    def _cut_torn_tail(self) -> None:
        """Check the complete rows (CorruptRowError, file untouched), then cut a torn last line (no newline)."""
        if not self.path.is_file():
            return
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise ReportDirError(f"cannot read {self.path}: {e.strerror or e}; check the run directory") from None
        lines, torn = _complete_lines(data)
        _parse_rows(self.path, lines)
        if torn:
            with open(self.path, "r+b") as f:
                f.truncate(len(data) - len(torn))
                f.flush()
                os.fsync(f.fileno())


def done_keys(rows: list[dict]) -> set[str]:
    """Keys of the rows that finished ok."""
    return {r["key"] for r in rows if r.get("status") == "ok"}
