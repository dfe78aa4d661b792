"""Where a decode step's torch launches come from: `deepinfer-bench ops`.

The GPU trace (`deepinfer-bench step`, `gpu_trace`) counts a step's kernels and names the costly ones, but a
torch elementwise kernel's name does not say which line of the engine launched it. This census runs decode steps
on the CPU under a TorchDispatchMode and files every aten op that launches work (views and metadata ops left out)
under the engine source line that issued it, or under the `kernels/` op it ran inside (those are the op table's
business: on CUDA the Triton sets replace most of them with one launch). The lines outside `kernels/` are what the
model and the cache still launch as torch ops on any backend: the list to fuse from. The census also counts the
step's calls of each kernels/ op (one launch or more each in the Triton sets), so the two counts together say what a
step launches before the Triton sets' own extra launches. Counts are per decode step (prefill steps are not
counted) and depend on the model's layer kinds, not on its widths, so the tiny models stand in for the released
ones.

Under Triton's interpreter (TRITON_INTERPRET=1) the census can run a Triton set on the CPU (`--kernel-backend
triton`): it then counts each Triton kernel launch too, and the torch ops inside the ops are the Triton wrappers'
own (prefix sums, casts, the torch paths of ops without a kernel), so kernels + ops inside + ops outside is the
step's launch count on a GPU, before what cuBLAS splits a GEMM into (its split-K reduce kernels).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.errors import DeepInferError

PROMPT_LEN = 32             # each census prompt's tokens
NEW_TOKENS = 6              # tokens each prompt generates: the prefill's, then NEW_TOKENS - 1 decode steps
RESERVED_IDS = 5            # the lowest ids are special tokens: prompts use ids from here up

# aten ops that make no kernel (views, aliases, metadata, host reads); `to` / `contiguous` / `flatten` dispatch
# their real work as _to_copy / clone / copy_, counted as those
NO_LAUNCH = frozenset({
    "aten.detach.default", "aten.detach_.default", "aten.alias.default", "aten.view.default",
    "aten._unsafe_view.default", "aten.t.default", "aten.unsqueeze.default", "aten.squeeze.dim",
    "aten.squeeze.dims", "aten.squeeze.default", "aten.expand.default", "aten.slice.Tensor", "aten.select.int",
    "aten.permute.default", "aten.transpose.int", "aten.as_strided.default", "aten.reshape.default",
    "aten.split.Tensor", "aten.unbind.int", "aten.split_with_sizes.default", "aten.lift_fresh.default",
    "aten.unflatten.int", "aten.chunk.default", "aten.diagonal.default", "aten.view_as_real.default",
    "aten.view_as_complex.default", "aten.unfold.default", "aten._reshape_alias.default", "aten.is_nonzero.default",
    "aten._local_scalar_dense.default", "aten.to.dtype", "aten.to.device", "aten.to.dtype_layout",
    "aten.flatten.using_ints", "aten.contiguous.default", "aten.view.dtype", "aten.sym_size.int",
    "aten.sym_stride.int", "aten.sym_numel.default", "aten.dim.default", "aten.size.default", "aten.stride.default",
    "aten.numel.default", "aten.is_contiguous.default", "aten.item.default", "aten.empty_like.default",
    "aten.empty.memory_format", "aten.empty_strided.default",
    "aten.resolve_conj.default", "aten.resolve_neg.default"})      # copies only for complex / negated views


@dataclass
class Census:
    """Ops per decode step: `lines` {(engine source 'file:line function', aten op): count}, `kernel_ops`
    {kernels/ entry: aten ops inside it}, `op_calls` {kernels/ op name: calls}, over `steps` decode steps."""
    steps: int = 0
    lines: collections.Counter = field(default_factory=collections.Counter)
    kernel_ops: collections.Counter = field(default_factory=collections.Counter)
    op_calls: collections.Counter = field(default_factory=collections.Counter)
    kernels: collections.Counter = field(default_factory=collections.Counter)   # Triton kernel name: launches

    @property
    def per_step(self) -> float:
        return sum(self.lines.values()) / max(self.steps, 1)

    @property
    def calls_per_step(self) -> float:
        return sum(self.op_calls.values()) / max(self.steps, 1)

    @property
    def launches_per_step(self) -> float:
        """Triton kernels + torch ops inside and outside the ops (a Triton set under the interpreter)."""
        return (sum(self.kernels.values()) + sum(self.kernel_ops.values())) / max(self.steps, 1) + self.per_step

    def top(self, n: int) -> list[tuple[str, str, float]]:
        return [(where, op, c / max(self.steps, 1)) for (where, op), c in self.lines.most_common(n)]


class _Recorder(TorchDispatchMode):
    def __init__(self, census: Census, engine: Path, kernels: Path):
        super().__init__()
        self.census, self.engine, self.kernels, self.on = census, engine, kernels, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if self.on and name not in NO_LAUNCH:
            self._file(name)
        return func(*args, **(kwargs or {}))

    def _file(self, op: str) -> None:
        inside = None
        for frame in reversed(traceback.extract_stack()[:-2]):
            path = _resolved(frame.filename)
            if self.kernels in path.parents:
                inside = f"kernels/{path.relative_to(self.kernels)}:{frame.name}"   # the outermost kernels/ frame
                continue
            if self.engine not in path.parents:
                continue
            if inside is not None:
                self.census.kernel_ops[inside] += 1
            else:
                self.census.lines[(f"{path.relative_to(self.engine.parent)}:{frame.lineno} {frame.name}",
                                   op.removeprefix("aten."))] += 1
            return


class _CountedCalls:
    """A kernel table's functions by op, counting each lookup while the recorder is on: every kernels/ op entry
    looks its function up once per call (kernels/registry.py `call`)."""

    def __init__(self, fns, census: Census, recorder: _Recorder):
        self.fns, self.census, self.recorder = fns, census, recorder

    def __getitem__(self, op: str):
        if self.recorder.on:
            self.census.op_calls[op] += 1
        return self.fns[op]


@contextlib.contextmanager
def _counting_calls(llm, census: Census, recorder: _Recorder):
    """Inside: the engine's kernel table counts op calls into `census` (the table is the engine's own: restored
    after), and interpreted Triton kernels count their launches, the interpreter's own tensor copies out of the
    torch-op count."""
    table = llm.engine.kernels
    fns, table.fns = table.fns, _CountedCalls(table.fns, census, recorder)
    interpreted = _interpreter() if table.name.startswith("triton") else None
    run = interpreted.run if interpreted is not None else None

    def counted(self, *args, **kwargs):
        on = recorder.on
        if on and not kwargs.get("warmup"):
            census.kernels[self.fn.__name__] += 1
        recorder.on = False
        try:
            return run(self, *args, **kwargs)
        finally:
            recorder.on = on

    if interpreted is not None:
        interpreted.run = counted
    try:
        yield
    finally:
        table.fns = fns
        if interpreted is not None:
            interpreted.run = run


def _interpreter():
    """Triton's interpreted kernel class (TRITON_INTERPRET=1: what triton.jit makes)."""
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction


@functools.lru_cache(maxsize=None)
def _resolved(filename: str) -> Path:
    return Path(filename).resolve()      # the roots are resolved: a symlinked checkout still matches


def check_census(model: str, kernel_backend: str | None, batch: int) -> str:
    """Before anything is built: the model's form, --batch against the engine's step budget (every decoding
    sequence needs a token of each step) and --kernel-backend against the CPU (a Triton set: under Triton's
    interpreter) and DEEPINFER_BATCH_INVARIANT. Returns the backend set the engine will run."""
    from deepinfer.validate import check_model_spec

    from .limits import check_concurrency, check_invariant_backend, check_kernel_backend, default_step_budget
    check_model_spec(model)
    check_concurrency("--batch", [batch], default_step_budget())
    if kernel_backend is not None and kernel_backend.startswith("triton"):
        import os
        from deepinfer.kernels.registry import triton_installed
        if os.environ.get("TRITON_INTERPRET") != "1" or not triton_installed():
            raise DeepInferError(f"--kernel-backend {kernel_backend} runs on the CPU under Triton's interpreter only: "
                                 f"install triton and set TRITON_INTERPRET=1 (the census then counts each kernel "
                                 f"launch), or use --kernel-backend reference or invariant")
        from deepinfer.kernels import gather_triton
        if not gather_triton.INTERPRETED:
            raise DeepInferError("Triton was imported before TRITON_INTERPRET=1 was set, so its kernels would not be "
                                 "interpreted: set it before the process starts")
        check_invariant_backend(kernel_backend)
        return kernel_backend
    return check_kernel_backend(kernel_backend, "cpu")


def build_census_engine(model: str, kernel_backend: str | None, batch: int):
    """An eager CPU engine with a seat for each of `batch` sequences, positions for the census prompts (the count
    per step does not depend on either: the tiny V4.1 gives 311 at batch 4 with 256 seats x 4096 positions and
    with 4 x 39). Refused in one line when the state memory seats fewer than --batch."""
    from deepinfer import LLM
    from deepinfer.api import resolve_model
    from deepinfer.kernels.table import KernelTable
    interpreted = kernel_backend is not None and kernel_backend.startswith("triton")    # check_census: interpreter
    # the engine refuses a Triton set off CUDA: it is built with the torch set of the same invariance (which sets its
    # fixed shapes), then runs the Triton table, whose kernels the interpreter runs here
    built = ("invariant" if kernel_backend == "triton_invariant" else "reference") if interpreted else kernel_backend
    llm = LLM(resolve_model(model, "cpu", "float32"), device="cpu", kernel_backend=built, enforce_eager=True,
              async_scheduling=False, max_num_seqs=batch, max_model_len=PROMPT_LEN + NEW_TOKENS + 1)
    if interpreted:
        llm.engine.kernels = KernelTable(kernel_backend)
    if llm.engine.num_seats < batch:
        raise DeepInferError(f"--batch {batch}: the CPU state memory seats {llm.engine.num_seats} sequences of "
                             f"this model, so fewer would decode together; use --batch <= {llm.engine.num_seats}")
    return llm


def census_prompts(batch: int, prompt_len: int, vocab_size: int) -> list[dict]:
    """`batch` distinct prompts of consecutive ids (prompt i starts at id RESERVED_IDS + i), wrapping inside the
    vocabulary so any batch stays in it (past vocab_size - RESERVED_IDS prompts, starts repeat)."""
    span = vocab_size - RESERVED_IDS
    return [{"prompt_token_ids": [RESERVED_IDS + (i + j) % span for j in range(prompt_len)]} for i in range(batch)]


def _new_census() -> tuple[Census, _Recorder]:
    """An empty census and its recorder (off until a caller switches it on), filing ops under the engine's and the
    kernels' source roots."""
    import deepinfer
    import deepinfer.kernels
    census = Census()
    return census, _Recorder(census, Path(deepinfer.__file__).resolve().parent,
                             Path(deepinfer.kernels.__file__).resolve().parent)


def run_census(llm, batch: int = 4, prompt_len: int = PROMPT_LEN, new_tokens: int = NEW_TOKENS) -> Census:
    """Generate `new_tokens` for `batch` prompts twice on `llm` (an eager LLM); the second run's decode steps
    (every scheduled piece one token) are counted."""
    from deepinfer import SamplingParams
    census, recorder = _new_census()

    def observe(batch) -> None:             # the engine calls it with each step's plan, before the launch
        recorder.on = bool(batch) and all(s.n == 1 for s in batch)
        census.steps += recorder.on

    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    prompts = census_prompts(batch, prompt_len, llm.model.cfg.vocab_size)
    llm.generate(prompts, sp, use_tqdm=False)                      # warm: first-call paths out of the count
    observers = llm.engine.step_observers
    observers.append(observe)
    try:
        with recorder, _counting_calls(llm, census, recorder):
            llm.generate(prompts, sp, use_tqdm=False)
    finally:
        observers.remove(observe)
        recorder.on = False
    if census.steps == 0:
        raise DeepInferError(f"deepinfer-bench ops: no decode step ran ({new_tokens} new tokens for {batch} "
                             f"prompts); give at least 2 new tokens")
    return census


def run_graph_census(llm, batch: int = 4, context: int = PROMPT_LEN) -> Census:
    """The ops of the decode step a CUDA graph captures: `batch` one-row segments at position `context` of seeded
    state (a StepProbe) through the runner's static step (`static_logits`, uniform segments: the forward a decode
    graph records), counted once after a warm call. The eager census above goes through the ragged batch instead,
    whose index arithmetic differs; on CUDA the graph's ops are what every decode step replays."""
    from deepinfer.runner.probe import StepProbe
    census, recorder = _new_census()
    probe = StepProbe(llm, batch, context)
    try:
        probe.run_static()                                   # first-call paths out of the count
        recorder.on, census.steps = True, 1
        try:
            with recorder, _counting_calls(llm, census, recorder):
                probe.run_static()
        finally:
            recorder.on = False
    finally:
        probe.close()
    return census


def table(census: Census, top: int) -> list[str]:
    counted = f"{census.steps} steps counted" if census.steps != 1 else "1 step counted"
    out = [f"{census.per_step:.0f} torch ops per decode step outside kernels/ ({counted})",
           f"{'per step':>9}  {'op':24s} source"]
    out += [f"{c:9.1f}  {op:24s} {where}" for where, op, c in census.top(top)]
    out.append(f"{'per step':>9}  inside kernels/ ops (their reference implementations)")
    out += [f"{c / max(census.steps, 1):9.1f}  {k}" for k, c in census.kernel_ops.most_common(top)]
    out.append(f"{census.calls_per_step:.0f} kernels/ op calls per decode step (one launch or more each in the "
               f"Triton sets)")
    out += [f"{c / max(census.steps, 1):9.1f}  {op}" for op, c in census.op_calls.most_common(top)]
    if census.kernels:
        kernels = sum(census.kernels.values()) / max(census.steps, 1)
        inside = sum(census.kernel_ops.values()) / max(census.steps, 1)
        out.append(f"{census.launches_per_step:.0f} launches per decode step: {kernels:.0f} Triton kernels + "
                   f"{inside:.0f} torch ops inside ops + {census.per_step:.0f} outside (before cuBLAS's split-K "
                   f"reduces)")
        out += [f"{c / max(census.steps, 1):9.1f}  {k}" for k, c in census.kernels.most_common(top)]
    return out
