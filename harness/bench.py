"""The one bench runner: a bench's config gives its points, each point is measured into one row, rows go to the
run folder as they finish (harness/rows.py: the store that never loses a finished row).

    folder = RunFolder(run_dir, "step.json", resume=resume)
    done = folder.check(compare)                       # before anything is built: refuses or resumes
    ... build the engine ...
    with run_dir_guard(run_dir):
        store = folder.open(settings_text, env)
        ident = identity(env, METHOD_VERSION, model=..., ...)
        for point in todo:
            record_point(store, ident, key, fields, lambda: measure(point), on_error=OnError(...))

A run folder holds the bench's settings file (step.json, sweep.yaml, ...), env.json and rows.jsonl. A new run
refuses a folder that has rows; a resumed one (resumable benches, --resume) checks the stored settings against
its own and skips the points that finished ok. A point that raises is a failure row (`status: failed`, `error`);
the run then stops with one line naming the point and the row, unless it goes on past failures."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from deepinfer.env import settings
from deepinfer.errors import DeepInferError

from .rows import RowStore, atomic_write_text, done_keys, read_rows, refuse_existing_rows, utc_now


@dataclass(frozen=True)
class RunFolder:
    """A bench run's directory: `settings` (its settings file's name; None: it keeps none), new or resumed."""
    path: Path
    settings: str | None
    resume: bool = False
    resumable: bool = True

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @property
    def settings_path(self) -> Path:
        return self.path / self.settings

    def check(self, compare: Callable[[str], str | None] | None = None, bench: str = "bench") -> set[str]:
        """Before anything is written or built: a new run may not reuse a folder with rows; a resumed one needs
        the stored settings file and compare(its text) -> None (or the one line saying what differs). Returns
        the keys of the points already done."""
        if self.resume:
            if not self.settings_path.exists():
                raise DeepInferError(f"--resume: no {bench} run {self.path} (no {self.settings} there); check "
                                     f"--run-id / --out")
            why = compare(self.settings_path.read_text()) if compare is not None else None
            if why:
                raise DeepInferError(why)
            self._check_engine_env()
        else:
            refuse_existing_rows(self.path, self.resumable)
        return done_keys(read_rows(self.path))       # a corrupt row stops here, before the model loads

    def _check_engine_env(self) -> None:
        """A resumed run keeps the DEEPINFER_* switches its rows were taken under (env.json; runs from before
        rows recorded them are not checked)."""
        env_path = self.path / "env.json"
        stored = json.loads(env_path.read_text()).get("engine_env") if env_path.exists() else None
        now = settings()
        if stored is not None and stored != now:
            raise DeepInferError(f"--resume: {self.path} was run with DEEPINFER_* switches {stored or 'none'}, this "
                                 f"process has {now or 'none'}; set the same, or start a new --run-id")

    def open(self, settings_text: str | None = None, env: dict | None = None) -> RowStore:
        """Once the engine is built: the folder, its settings file and (for a new run, or a resumed one without
        it) env.json; returns its row store."""
        store = RowStore(self.path)
        if settings_text is not None:
            atomic_write_text(self.settings_path, settings_text)
        env_path = self.path / "env.json"
        if env is not None and not (self.resume and env_path.exists()):
            atomic_write_text(env_path, json_text(env))
        return store


def json_text(value) -> str:
    """A settings or environment file's text: indented, keys sorted, one newline at the end."""
    return json.dumps(value, indent=1, sort_keys=True) + "\n"


def error_text(e: BaseException) -> str:
    """A failure row's `error`: a DeepInferError's own line, else the exception's type and message."""
    return str(e) if isinstance(e, DeepInferError) else f"{type(e).__name__}: {e}"


def first_line(text: str) -> str:
    """The first line of an error (CUDA errors run over lines: the row keeps them all)."""
    return (text.strip().splitlines() or [""])[0]


@dataclass(frozen=True)
class OnError:
    """What a failed point does after its failure row: go on (continue_on_error, or an exception of the
    `keep_going` types), else stop the run with one line; `rerun`: the advice in that line; `describe`: the
    row's error text of an exception."""
    continue_on_error: bool = False
    keep_going: tuple = ()
    rerun: str = "rerun with --resume (and --continue-on-error to go on past failures)"
    describe: Callable[[BaseException], str] = error_text


def record_point(store: RowStore | None, identity: dict, key: str, fields: dict, measure: Callable[[], dict],
                 on_error: OnError = OnError(), echo: Callable[[str], None] | None = None) -> dict:
    """One point's row: identity, key, the point's fields and started, then measure()'s fields, status and
    finished; appended to `store` (None: a rank that does not write). measure() returns the row fields, or
    (fields, raw): raw is the point's vLLM-bench-compatible result, written to raw/<key>.json first. A point
    that raises is a failure row."""
    row = {**identity, "key": key, **fields, "started": utc_now()}
    try:
        measured = measure()
    except Exception as e:          # noqa: BLE001  a failed point is recorded, never silently lost
        error = on_error.describe(e)
        failed = {**row, "status": "failed", "error": error, "finished": utc_now()}
        if store is not None:
            store.append(failed)
        if echo is not None:
            echo(f"  {key}: failed ({first_line(error)})")
        if on_error.continue_on_error or isinstance(e, on_error.keep_going):
            return failed
        where = store.path if store is not None else "rank 0's rows.jsonl"
        raise DeepInferError(f"point {key} failed ({first_line(error)}); its failure row is in {where}; "
                             f"{on_error.rerun}") from e
    if isinstance(measured, tuple):
        measured, raw = measured
        if store is not None:
            store.write_raw(key, raw)
    done = {**row, **measured, "status": "ok", "finished": utc_now()}
    if store is not None:
        store.append(done)
    return done
