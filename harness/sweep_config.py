"""Sweep definitions for `deepinfer-bench sweep`: a YAML file -> a validated, frozen `SweepConfig`.

    cfg = load_sweep("sweeps/tiny-cpu.yaml")
    for point in cfg.points():          # mode x scenario x concurrency, in run order
        print(point.key)                # e.g. decode/isl1024-osl1024/c32 (stable: used to resume)

Every problem is one `SweepConfigError` line naming the file, the key path (`scenarios[1].osl`) and what
is allowed. The schema is documented in sweeps/README.md.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

from deepinfer.cache.pools import KV_CACHE_DTYPES
from deepinfer.errors import DeepInferError, did_you_mean
from deepinfer.parallel.ranks import DISPATCH_BACKENDS
from deepinfer.validate import DTYPE_NAMES as DTYPES
from deepinfer.validate import EXPERT_STORAGE, PROJECTION_STORAGE, check_model_spec

DEVICES = ("cpu", "cuda", "cuda:N")      # cuda:N: one GPU (N its index); whether it exists: validate.check_device
DEVICE_RE = re.compile(r"^(cpu|cuda|cuda:[0-9]+)$")
MODES = ("prefill", "decode", "both")
MIN_PROMPTS_PER_CONCURRENCY = 5
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

TOP_KEYS = ("name", "model", "device", "dtype", "engine_args", "mode", "scenarios", "range_ratio", "topology",
            "concurrency", "num_prompts_per_concurrency", "warmup", "warm_pass", "seed", "speculative")
REQUIRED_KEYS = ("name", "model", "device", "scenarios", "concurrency")
# engine argument -> kind: "int" (>= 1), "count" (>= 0), "util" (number in (0, 1]), "bool", "storage"
# (EXPERT_STORAGE), "projection" (PROJECTION_STORAGE), "kv_cache_dtype" (KV_CACHE_DTYPES), "dispatch" (DISPATCH_BACKENDS); the
# expert-parallel ones (EXPERT_PARALLEL_ARGS) only with a role that runs expert parallelism (topology ep > 1)
ENGINE_ARG_KINDS = {"max_num_seqs": "int", "max_num_batched_tokens": "int", "max_model_len": "int",
                    "gpu_memory_utilization": "util", "enforce_eager": "bool", "expert_storage": "storage",
                    "projection_storage": "projection", "block_size": "int", "kv_cache_dtype": "kv_cache_dtype",
                    "speculative": "speculative", "expert_dispatch": "dispatch", "enable_eplb": "bool",
                    "eplb_config": "eplb", "enable_prefix_caching": "bool",
                    "prefix_snapshot_interval": "count"}
EXPERT_PARALLEL_ARGS = ("expert_dispatch", "enable_eplb", "eplb_config")
SCENARIO_KEYS = ("isl", "osl", "shared", "turns")
TOPOLOGY_KEYS = ("prefill_ranks", "decode_ranks", "ep", "dp")
LADDER_KEYS = ("start", "stop")


class SweepConfigError(DeepInferError, ValueError):
    """A sweep file is missing, malformed or out of range (one line: file, key path, what is allowed)."""


@dataclasses.dataclass(frozen=True)
class Scenario:
    isl: int            # nominal input length; each prompt is range_ratio..1 x isl tokens
    osl: int            # output length (ignore_eos)
    shared: float = 0.0  # the fraction of isl every prompt of the point starts with (agent traffic: one system
                         # prompt and tools, a varying tail; 0: InferenceX's random prompts)
    turns: int = 1       # conversation turns: turn t resends turn t-1's prompt and output plus isl new tokens

    @property
    def label(self) -> str:
        return scenario_label(self.isl, self.osl, self.shared, self.turns)

    def to_dict(self) -> dict:
        return {"isl": self.isl, "osl": self.osl, **({"shared": self.shared} if self.shared else {}),
                **({"turns": self.turns} if self.turns > 1 else {})}


def scenario_label(isl: int, osl: int, shared: float = 0.0, turns: int = 1) -> str:
    """isl1024-osl128, with -shared90 / -turns4 for the shared-prefix workloads."""
    return (f"isl{isl}-osl{osl}" + (f"-shared{round(shared * 100)}" if shared else "")
            + (f"-turns{turns}" if turns > 1 else ""))


@dataclasses.dataclass(frozen=True)
class Topology:
    prefill_ranks: int = 1
    decode_ranks: int = 1
    ep: int = 1         # expert-parallel width inside a role, capped at that role's ranks
    dp: int = 1         # data-parallel (attention) width inside a role, capped at that role's ranks

    def ranks(self, mode: str) -> int:
        """GPUs a point of `mode` ("prefill" or "decode") runs on: the per-GPU denominator."""
        return self.prefill_ranks if mode == "prefill" else self.decode_ranks

    def ep_of(self, mode: str) -> int:
        """The role's expert-parallel width: ep capped at its ranks (1, or its ranks: checked at parse)."""
        return min(self.ep, self.ranks(mode))

    def dp_of(self, mode: str) -> int:
        """The role's attention data-parallel width: every rank runs its own attention (no tensor parallelism,
        so EP = DP x TP = DP), so it is the role's ranks whatever dp says (1 or the ranks: checked at parse)."""
        return self.ranks(mode)


@dataclasses.dataclass(frozen=True)
class SweepPoint:
    mode: str           # "prefill" or "decode"
    isl: int
    osl: int
    concurrency: int
    num_prompts: int    # num_prompts_per_concurrency x concurrency (timed requests)
    warmup: int         # warm-up requests before the timed ones, excluded from metrics
    ranks: int          # GPUs of this point's role
    spec: str = ""      # the speculative setting's label when the sweep has a `speculative` axis (key prefix)
    shared: float = 0.0  # Scenario.shared
    turns: int = 1       # Scenario.turns

    @property
    def key(self) -> str:
        head = f"{self.spec}/" if self.spec else ""
        return f"{head}{self.mode}/{scenario_label(self.isl, self.osl, self.shared, self.turns)}/c{self.concurrency}"


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    name: str
    model: str
    device: str
    scenarios: MappingProxyType       # "prefill"/"decode" -> scenarios in file order (the modes that run)
    concurrency: MappingProxyType     # "prefill"/"decode" -> ascending concurrencies (the modes that run)
    dtype: str = "float32"
    engine_args: MappingProxyType = dataclasses.field(default_factory=lambda: MappingProxyType({}))  # LLM(**it)
    mode: str = "both"
    range_ratio: float = 0.8
    topology: Topology = Topology()
    num_prompts_per_concurrency: int = MIN_PROMPTS_PER_CONCURRENCY
    warmup: int = 0
    # run every point once unrecorded first (one request per concurrency slot), so no timed request pays a kernel
    # compile that the point's own warm-up requests did not cover (a fresh machine compiles per shape)
    warm_pass: bool = False
    seed: int = 0
    # the `speculative` axis: (label, LLM's speculative value) per setting, in file order; empty: no axis
    speculative: tuple = ()
    source: str = "<dict>"

    @property
    def modes(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.mode == "both" else (self.mode,)

    @property
    def ep_ranks(self) -> int:
        """The expert-parallel width of the roles that run: 1 (none), or the ranks of the one expert-parallel
        engine a launch builds (harness/sweep.py check_topology makes every running role that engine)."""
        return max(self.topology.ep_of(m) for m in self.modes)

    def points(self) -> list[SweepPoint]:
        """Every point in run order: for each mode (prefill first), each scenario (file order), each
        concurrency (ascending). Keys are unique."""
        return [SweepPoint(mode, s.isl, s.osl, c, self.num_prompts_per_concurrency * c, self.warmup,
                           self.topology.ranks(mode), label, s.shared, s.turns)
                for label in ([lab for lab, _ in self.speculative] or [""])
                for mode in self.modes for s in self.scenarios[mode] for c in self.concurrency[mode]]

    def speculative_value(self, label: str):
        """LLM's `speculative` for a point's label ("" : the engine_args' own, if any)."""
        return dict(self.speculative).get(label, self.engine_args.get("speculative"))

    def to_dict(self) -> dict:
        """The normalized definition (defaults filled in, ladders expanded), loadable by parse_sweep."""
        def per_mode(by_mode, item):       # one value for every mode, or a mapping when the modes differ
            if len({by_mode[m] for m in self.modes}) == 1:
                return [item(v) for v in by_mode[self.modes[0]]]
            return {m: [item(v) for v in by_mode[m]] for m in self.modes}
        return {"name": self.name, "model": self.model, "device": self.device, "dtype": self.dtype,
                "engine_args": dict(self.engine_args), "mode": self.mode,
                "scenarios": per_mode(self.scenarios, Scenario.to_dict),
                "range_ratio": self.range_ratio, "topology": dataclasses.asdict(self.topology),
                "concurrency": per_mode(self.concurrency, int), "num_prompts_per_concurrency": self.num_prompts_per_concurrency,
                "warmup": self.warmup, "warm_pass": self.warm_pass, "seed": self.seed,
                **({"speculative": [v if v is not False else "off" for _, v in self.speculative]}
                   if self.speculative else {})}


# --------------------------------------------------------------------------------------------- loading

def load_sweep(path: str | Path) -> SweepConfig:
    """Read and validate a sweep YAML file."""
    path = Path(path)
    data = read_yaml_file(path, "sweep", SweepConfigError, "pass a YAML file such as sweeps/tiny-cpu.yaml")
    return parse_sweep(data, str(path))


def read_yaml_file(path: Path, what: str, error_type: type[DeepInferError], hint: str) -> Any:
    """The parsed YAML of a `what` file (sweep, suite); a missing, unreadable or malformed one is one
    `error_type` line naming the file (and line, column), with `hint` on what to pass instead."""
    import yaml
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error_type(f"{path}: {what} file not found; {hint}") from None
    except IsADirectoryError:
        raise error_type(f"{path}: is a directory; pass a {what} YAML file inside it") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error_type(f"{path}: cannot read {what} file ({_one_line(e)})") from None
    try:
        return yaml.load(text, Loader=_unique_keys_loader())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "unknown position"
        problem = getattr(e, "problem", None) or _one_line(e)
        raise error_type(f"{path}: malformed YAML at {where}: {_one_line(problem)}") from None


def _unique_keys_loader():
    """yaml's SafeLoader, except that a key given twice in one mapping is an error (safe_load keeps the last)."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice in one mapping; keep one", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)
    return UniqueKeys


def parse_sweep(data: Any, source: str = "<dict>") -> SweepConfig:
    """Validate an already parsed sweep definition (a mapping); `source` names it in errors."""
    v = Validator(source)
    if not isinstance(data, dict):
        raise v.error(None, f"the sweep must be a mapping of keys ({', '.join(TOP_KEYS)}), got "
                            f"{_type_name(data)}")
    v.keys(data, None, TOP_KEYS, REQUIRED_KEYS)

    name = v.string(data["name"], "name")
    if not NAME_RE.match(name):
        raise v.error("name", f"got {name!r}; allowed: letters, digits, '.', '_', '-' (it names result "
                              f"directories)")
    model = v.model(data["model"], "model")
    device = v.device(data["device"], "device")
    dtype = v.choice(data.get("dtype", "float32"), "dtype", DTYPES)
    engine_args = v.engine_args(data.get("engine_args", {}), "engine_args")
    mode = v.choice(data.get("mode", "both"), "mode", MODES)
    modes = ("prefill", "decode") if mode == "both" else (mode,)
    scenarios = v.per_mode(data["scenarios"], "scenarios", modes,
                           lambda x, p: v.scenarios(x, p, engine_args.get("max_model_len")))
    range_ratio = v.number(data.get("range_ratio", 0.8), "range_ratio", low_open=0.0, high=1.0)
    topology = v.topology(data.get("topology", {}), "topology")
    concurrency = v.concurrency(data["concurrency"], "concurrency", modes)
    per_c = v.integer(data.get("num_prompts_per_concurrency", MIN_PROMPTS_PER_CONCURRENCY),
                      "num_prompts_per_concurrency", MIN_PROMPTS_PER_CONCURRENCY,
                      why=" (steady state needs at least 5x concurrency requests per point)")
    warmup = v.integer(data.get("warmup", 0), "warmup", 0)
    warm_pass = v.flag(data.get("warm_pass", False), "warm_pass")
    seed = v.integer(data.get("seed", 0), "seed", 0)
    _check_engine_fits(v, model, engine_args, concurrency, topology)
    _check_parallel(v, topology, modes, engine_args)
    speculative = v.speculative(data["speculative"], "speculative", model) if "speculative" in data else ()
    if speculative and "speculative" in engine_args:
        raise v.error("speculative", "give speculative decoding either in engine_args (every point) or as the "
                                     "`speculative` list (one run of the points per setting), not both")
    if "speculative" in engine_args:              # validated as LLM takes it ("off" spelled as False)
        engine_args["speculative"] = v.speculative([engine_args["speculative"]], "engine_args.speculative",
                                                   model)[0][1]
    return SweepConfig(name=name, model=model, device=device, scenarios=MappingProxyType(scenarios),
                       concurrency=MappingProxyType(concurrency), dtype=dtype,
                       engine_args=MappingProxyType(engine_args), mode=mode, range_ratio=float(range_ratio),
                       topology=topology, num_prompts_per_concurrency=per_c, warmup=warmup, warm_pass=warm_pass,
                       seed=seed, speculative=speculative, source=source)


def _check_engine_fits(v, model: str, engine_args: dict, concurrency: dict, topology) -> None:
    """What the file alone decides: every point's concurrency per replica fits the engine's max_num_seqs and step
    budget, and fp4 expert storage is asked of a model that has it (a random V4 does not)."""
    from deepinfer.llm import ENGINE_DEFAULTS
    from deepinfer.validate import check_expert_storage, random_spec_arch
    arch = random_spec_arch(model)
    if arch is not None and "expert_storage" in engine_args:
        try:
            check_expert_storage(engine_args["expert_storage"], arch)
        except DeepInferError as e:
            raise v.error("engine_args.expert_storage", str(e)) from None
    seats = min(engine_args.get("max_num_seqs", ENGINE_DEFAULTS["max_num_seqs"]),
                engine_args.get("max_num_batched_tokens", ENGINE_DEFAULTS["max_num_batched_tokens"]))
    for mode, ladder in concurrency.items():
        ranks = topology.ranks(mode)
        worst = max(-(-c // ranks) for c in ladder)
        if worst > seats:
            raise v.error(f"concurrency", f"{mode} concurrency {max(ladder)} needs {worst} sequences per replica "
                                          f"({ranks} rank(s)) but engine_args allow {seats} (max_num_seqs / "
                                          f"max_num_batched_tokens); raise them or lower the concurrency")


def _check_parallel(v, topology: Topology, modes: tuple[str, ...], engine_args: dict) -> None:
    """ep and dp against each role that runs (docs/bench.md): with no tensor parallelism EP = DP x TP = DP, so a
    role's (capped) ep is 1 or its ranks, and its dp likewise; the expert-parallel engine arguments need a role
    that runs expert parallelism, and EPLB's settings are the engine's (one line each)."""
    from deepinfer.parallel.balancer import eplb_config
    for mode in modes:
        r = topology.ranks(mode)
        for key in ("ep", "dp"):
            width = min(getattr(topology, key), r)
            if width not in (1, r):
                raise v.error(f"topology.{key}", f"got {getattr(topology, key)}; the {mode} role has {mode}_ranks="
                                                 f"{r}: with no tensor parallelism (EP = DP x TP, TP = 1) {key} "
                                                 f"must be 1 or the role's ranks ({r})")
    expert_parallel = any(topology.ep_of(m) > 1 for m in modes)
    given = [k for k in EXPERT_PARALLEL_ARGS if k in engine_args]
    if given and not expert_parallel:
        raise v.error(f"engine_args.{given[0]}", "configures expert parallelism, and no role runs it: set topology "
                                                 "ep to a role's ranks (> 1), or drop it")
    if expert_parallel:
        try:
            eplb_config(engine_args.get("enable_eplb", False), engine_args.get("eplb_config"), True, set(given))
        except DeepInferError as e:
            raise v.error("engine_args", str(e)) from None


def doubling_ladder(start: int, stop: int) -> tuple[int, ...]:
    """start, 2*start, 4*start, ... up to and including stop (stop itself is added when not on the ladder)."""
    out, c = [], start
    while c < stop:
        out.append(c)
        c *= 2
    out.append(stop)
    return tuple(out)


# --------------------------------------------------------------------------------------------- helpers

def _one_line(x: Any) -> str:
    return " ".join(str(x).split())


def _type_name(x: Any) -> str:
    return {type(None): "nothing (null)", bool: "a boolean", int: "an integer", float: "a number",
            str: "a string", list: "a list", dict: "a mapping"}.get(type(x), type(x).__name__)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Validator:
    """Checks of parsed YAML values; every failure is one `error_type` line: source, key path, what is allowed."""

    def __init__(self, source: str, error_type: type[DeepInferError] = SweepConfigError):
        self.source, self.error_type = source, error_type

    def error(self, path: str | None, msg: str) -> DeepInferError:
        return self.error_type(f"{self.source}: {path}: {msg}" if path else f"{self.source}: {msg}")

    def keys(self, d: dict, path: str | None, known: tuple[str, ...], required: tuple[str, ...] = ()) -> None:
        for k in d:
            if not isinstance(k, str):
                raise self.error(_join(path, repr(k)), f"keys must be strings; allowed: {', '.join(known)}")
            if k not in known:
                hint = did_you_mean(k, known, quote=True)
                hint = f"{hint} " if hint else ""
                raise self.error(_join(path, k), f"unknown key; {hint}allowed: {', '.join(known)}")
        for k in required:
            if k not in d:
                raise self.error(_join(path, k), "missing required key")

    def string(self, x: Any, path: str) -> str:
        if not isinstance(x, str):
            raise self.error(path, f"must be a non-empty string, got {_type_name(x)}")
        if not x.strip():
            raise self.error(path, f"must be a non-empty string, got {x!r}")
        return x

    def choice(self, x: Any, path: str, allowed: tuple[str, ...]) -> str:
        if not isinstance(x, str) or x not in allowed:
            got = repr(x) if isinstance(x, str) else _type_name(x)
            raise self.error(path, f"got {got}; allowed: {', '.join(allowed)}")
        return x

    def device(self, x: Any, path: str) -> str:
        """cpu, cuda or cuda:N (the form; whether that GPU is there is checked when the run starts)."""
        if not isinstance(x, str) or not DEVICE_RE.fullmatch(x):
            got = repr(x) if isinstance(x, str) else _type_name(x)
            raise self.error(path, f"got {got}; allowed: {', '.join(DEVICES)}")
        return x

    def integer(self, x: Any, path: str, minimum: int, why: str = "") -> int:
        if not _is_int(x):
            raise self.error(path, f"must be an integer >= {minimum}, got {_type_name(x)} {x!r}")
        if x < minimum:
            raise self.error(path, f"got {x}; must be an integer >= {minimum}{why}")
        return x

    def flag(self, x: Any, path: str) -> bool:
        if not isinstance(x, bool):
            raise self.error(path, f"must be true or false, got {_type_name(x)} {x!r}")
        return x

    def number(self, x: Any, path: str, low_open: float, high: float) -> float:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise self.error(path, f"must be a number in ({low_open:g}, {high:g}], got {_type_name(x)} {x!r}")
        if not low_open < x <= high:
            raise self.error(path, f"got {x!r}; must be a number in ({low_open:g}, {high:g}]")
        return x

    def mapping(self, x: Any, path: str, what: str) -> dict:
        if not isinstance(x, dict):
            raise self.error(path, f"must be a mapping ({what}), got {_type_name(x)}")
        return x

    def model(self, x: Any, path: str) -> str:
        model = self.string(x, path)
        try:
            check_model_spec(model)                  # the form every entry point shares (deepinfer.validate)
        except DeepInferError as e:
            raise self.error(path, str(e)) from None
        return model

    def speculative(self, x: Any, path: str, model: str) -> tuple:
        """A list of speculative settings (off / false, true, "dspark" / "mtp" or a mapping as
        LLM(speculative=...)) -> ((label, value), ...): label none or <method>-<schedule>-<drafts>, unique."""
        from deepinfer.speculative.config import speculative_config, speculation_label
        from deepinfer.validate import drafter_of_spec
        if not isinstance(x, list) or not x:
            raise self.error(path, f"must be a non-empty list of settings (off, dspark or a mapping such as "
                                   f"{{schedule: confidence}}), got {_type_name(x)}")
        out = []
        for i, item in enumerate(x):
            value = False if item in ("off", False, None) else item
            try:
                spec = speculative_config(value, 5, drafter_of_spec(model))
            except DeepInferError as e:
                raise self.error(f"{path}[{i}]", str(e)) from None
            label = "none" if spec is None else speculation_label(spec)
            if label in dict(out):
                raise self.error(f"{path}[{i}]", f"repeats the setting {label}")
            out.append((label, value))
        return tuple(out)

    def engine_args(self, x: Any, path: str) -> dict:
        d = self.mapping(x, path, "arguments passed to LLM(...)")
        self.keys(d, path, tuple(ENGINE_ARG_KINDS))
        for k, val in d.items():
            kind, p = ENGINE_ARG_KINDS[k], f"{path}.{k}"
            if kind in ("int", "count"):
                self.integer(val, p, 1 if kind == "int" else 0)
            elif kind == "util":
                self.number(val, p, low_open=0.0, high=1.0)
            elif kind == "bool":
                self.flag(val, p)
            elif kind == "storage":
                self.choice(val, p, EXPERT_STORAGE)
            elif kind == "projection":
                self.choice(val, p, PROJECTION_STORAGE)
            elif kind == "kv_cache_dtype":
                self.choice(val, p, KV_CACHE_DTYPES)
            elif kind == "dispatch":
                self.choice(val, p, DISPATCH_BACKENDS)
            elif kind == "eplb":
                self.mapping(val, p, "num_redundant_experts, and optionally window_size, step_interval, load")
        if "max_num_seqs" in d and "max_num_batched_tokens" in d and d["max_num_batched_tokens"] < d["max_num_seqs"]:
            raise self.error(f"{path}.max_num_batched_tokens", f"got {d['max_num_batched_tokens']}; must be >= "
                                                               f"max_num_seqs ({d['max_num_seqs']})")
        return dict(d)

    def scenarios(self, x: Any, path: str, max_model_len: int | None) -> tuple[Scenario, ...]:
        if not isinstance(x, list) or not x:
            raise self.error(path, f"must be a non-empty list of {{isl, osl}} mappings (or {{prefill: list, "
                                   f"decode: list}}), got {_type_name(x)}"
                                   + (" (empty)" if isinstance(x, list) else ""))
        out: list[Scenario] = []
        for i, item in enumerate(x):
            p = f"{path}[{i}]"
            self.mapping(item, p, "isl: input tokens, osl: output tokens")
            self.keys(item, p, SCENARIO_KEYS, ("isl", "osl"))
            shared = item.get("shared", 0)
            if isinstance(shared, bool) or not isinstance(shared, (int, float)) or not 0 <= shared < 1:
                raise self.error(f"{p}.shared", f"got {shared!r}; allowed: a fraction of isl in [0, 1) that every "
                                                f"prompt of the point shares")
            s = Scenario(self.integer(item["isl"], f"{p}.isl", 1), self.integer(item["osl"], f"{p}.osl", 1),
                         float(shared), self.integer(item.get("turns", 1), f"{p}.turns", 1))
            longest = s.turns * (s.isl + s.osl)           # the last turn resends every turn before it
            if max_model_len is not None and longest > max_model_len:
                what = "isl + osl" if s.turns == 1 else "turns x (isl + osl)"
                raise self.error(p, f"{what} = {longest} exceeds engine_args.max_model_len ({max_model_len}); "
                                    f"allowed: {what} <= max_model_len")
            if s in out:
                raise self.error(p, f"duplicates scenarios[{out.index(s)}] ({s.label}); each scenario once")
            out.append(s)
        return tuple(out)

    def topology(self, x: Any, path: str) -> Topology:
        d = self.mapping(x, path, ", ".join(TOPOLOGY_KEYS))
        self.keys(d, path, TOPOLOGY_KEYS)
        t = Topology(**{k: self.integer(d.get(k, 1), f"{path}.{k}", 1) for k in TOPOLOGY_KEYS})
        most = max(t.prefill_ranks, t.decode_ranks)
        for k in ("ep", "dp"):
            if getattr(t, k) > most:
                raise self.error(f"{path}.{k}", f"got {getattr(t, k)}; must be <= the larger role's ranks ({most})")
        return t

    def ladder(self, x: Any, path: str) -> tuple[int, ...]:
        form = "an ascending list of integers >= 1, or {start, stop} for a doubling ladder"
        if isinstance(x, list):
            if not x:
                raise self.error(path, f"empty ladder; allowed: {form}")
            vals = tuple(self.integer(c, f"{path}[{i}]", 1) for i, c in enumerate(x))
            for i in range(1, len(vals)):
                if vals[i] <= vals[i - 1]:
                    raise self.error(f"{path}[{i}]", f"got {vals[i]} after {vals[i - 1]}; the list must be "
                                                     f"strictly ascending")
            return vals
        if isinstance(x, dict):
            self.keys(x, path, LADDER_KEYS, LADDER_KEYS)
            start = self.integer(x["start"], f"{path}.start", 1)
            stop = self.integer(x["stop"], f"{path}.stop", 1)
            if stop < start:
                raise self.error(f"{path}.stop", f"got {stop} below start ({start}): empty ladder; "
                                                 f"allowed: stop >= start")
            return doubling_ladder(start, stop)
        raise self.error(path, f"got {_type_name(x)}; allowed: {form}")

    def per_mode(self, x: Any, path: str, modes: tuple[str, ...], one) -> dict[str, Any]:
        """`one(x, path)` for every mode, or {prefill: ..., decode: ...} (one entry per mode that runs)."""
        if isinstance(x, dict) and set(x) & {"prefill", "decode"}:
            self.keys(x, path, ("prefill", "decode"), modes)
            unused = sorted(set(x) - set(modes))
            if unused:
                raise self.error(f"{path}.{unused[0]}", f"mode {unused[0]!r} does not run (mode is "
                                                        f"{modes[0]!r}); allowed keys: {', '.join(modes)}")
            return {m: one(x[m], f"{path}.{m}") for m in modes}
        value = one(x, path)
        return {m: value for m in modes}

    def concurrency(self, x: Any, path: str, modes: tuple[str, ...]) -> dict[str, tuple[int, ...]]:
        """A ladder for every mode, or {prefill: ladder, decode: ladder} (one per mode that runs)."""
        def one(ladder: Any, p: str) -> tuple[int, ...]:
            if isinstance(ladder, dict) and p == path:
                self.keys(ladder, p, LADDER_KEYS + ("prefill", "decode"), LADDER_KEYS)
            return self.ladder(ladder, p)
        return self.per_mode(x, path, modes, one)


def _join(path: str | None, key: str) -> str:
    return f"{path}.{key}" if path else key
