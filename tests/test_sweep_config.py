"""Sweep definitions: every shipped file loads, points expand in order, each error is one clear line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from deepinfer.errors import DeepInferError
from deepinfer.harness.sweep_config import (SweepConfigError, SweepPoint, doubling_ladder, load_sweep,
                                            parse_sweep)

SWEEPS = Path(__file__).resolve().parent.parent / "sweeps"
MINIMAL = {"name": "t", "model": "tiny", "device": "cpu", "scenarios": [{"isl": 128, "osl": 32}],
           "concurrency": [1, 2]}


def sweep(**changes):
    d = {**MINIMAL, **changes}
    return {k: v for k, v in d.items() if v is not _DROP}


_DROP = object()


def error_of(data, source="s.yaml") -> str:
    with pytest.raises(SweepConfigError) as info:
        parse_sweep(data, source)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{source}: "), msg
    return msg


# ------------------------------------------------------------------------------------- shipped files

@pytest.mark.parametrize("path", sorted(SWEEPS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_sweep_file_loads(path):
    cfg = load_sweep(path)
    assert cfg.name == path.stem
    points = cfg.points()
    assert points and len({p.key for p in points}) == len(points)
    for p in points:
        assert p.num_prompts >= 5 * p.concurrency
        if "max_model_len" in cfg.engine_args:
            assert p.isl + p.osl <= cfg.engine_args["max_model_len"]


def test_shipped_files_are_the_expected_three():
    assert {p.name for p in SWEEPS.glob("*.yaml")} >= {"tiny-cpu.yaml", "h200-flash-4l.yaml",
                                                       "v41-flash-published.yaml"}


def test_tiny_cpu_shape():
    cfg = load_sweep(SWEEPS / "tiny-cpu.yaml")
    assert (cfg.model, cfg.device, cfg.modes) == ("tiny", "cpu", ("prefill", "decode"))
    assert [(s.isl, s.osl) for s in cfg.scenarios["decode"]] == [(128, 32), (32, 128)]
    assert cfg.concurrency["decode"] == (1, 2, 4, 8)
    assert len(cfg.points()) == 2 * 2 * 4


def test_h200_flash_shape():
    cfg = load_sweep(SWEEPS / "h200-flash-4l.yaml")
    assert cfg.model == "random:deepseek_v41:flash:4" and cfg.device == "cuda" and cfg.dtype == "bfloat16"
    assert cfg.engine_args["expert_storage"] == "fp4"
    assert [(s.isl, s.osl) for s in cfg.scenarios["decode"]] == [(1024, 1024), (8192, 1024)]
    assert cfg.concurrency["prefill"] == cfg.concurrency["decode"] == (1, 2, 4, 8, 16, 32, 64)


def test_projection_storage_is_an_engine_arg():
    cfg = parse_sweep(sweep(engine_args={"projection_storage": "fp8"}), "s.yaml")
    assert cfg.engine_args["projection_storage"] == "fp8"


def test_published_shape():
    cfg = load_sweep(SWEEPS / "v41-flash-published.yaml")
    assert cfg.model == "deepseek-ai/DeepSeek-V4.1-Flash-1017"
    assert (cfg.topology.prefill_ranks, cfg.topology.decode_ranks) == (4, 64)
    assert [(s.isl, s.osl) for s in cfg.scenarios["decode"]] == [(1024, 1024), (8192, 1024), (1024, 8192)]
    assert cfg.concurrency["decode"][-1] == 16384 and cfg.engine_args["expert_dispatch"] == "deepep"
    keys = [p.key for p in cfg.points()]
    assert "dspark-confidence-5/decode/isl1024-osl8192/c16384" in keys and "none/prefill/isl8192-osl1024/c64" in keys
    assert {p.ranks for p in cfg.points() if p.mode == "decode"} == {64}
    assert {p.ranks for p in cfg.points() if p.mode == "prefill"} == {4}


# ------------------------------------------------------------------------------------- expansion

def test_points_order_and_keys():
    cfg = parse_sweep(sweep(scenarios=[{"isl": 1024, "osl": 1024}, {"isl": 8192, "osl": 1024}],
                            concurrency={"start": 8, "stop": 32}, warmup=3))
    assert [p.key for p in cfg.points()] == [
        f"{m}/isl{i}-osl1024/c{c}" for m in ("prefill", "decode") for i in (1024, 8192) for c in (8, 16, 32)]
    assert cfg.points()[0] == SweepPoint("prefill", 1024, 1024, 8, 40, 3, 1)


def test_single_mode_and_explicit_list():
    cfg = parse_sweep(sweep(mode="decode", concurrency=[1, 3, 7], num_prompts_per_concurrency=10))
    assert [p.key for p in cfg.points()] == ["decode/isl128-osl32/c1", "decode/isl128-osl32/c3",
                                             "decode/isl128-osl32/c7"]
    assert [p.num_prompts for p in cfg.points()] == [10, 30, 70]


def test_per_mode_ladders():
    cfg = parse_sweep(sweep(concurrency={"prefill": [1, 2], "decode": {"start": 4, "stop": 16}}))
    assert [p.key for p in cfg.points()] == ["prefill/isl128-osl32/c1", "prefill/isl128-osl32/c2",
                                             "decode/isl128-osl32/c4", "decode/isl128-osl32/c8",
                                             "decode/isl128-osl32/c16"]


def test_per_mode_scenarios():
    cfg = parse_sweep(sweep(scenarios={"prefill": [{"isl": 64, "osl": 1}, {"isl": 512, "osl": 1}],
                                       "decode": [{"isl": 64, "osl": 16}]},
                            concurrency={"prefill": [1], "decode": [1, 2]}))
    assert [p.key for p in cfg.points()] == ["prefill/isl64-osl1/c1", "prefill/isl512-osl1/c1",
                                             "decode/isl64-osl16/c1", "decode/isl64-osl16/c2"]
    assert parse_sweep(cfg.to_dict()) == cfg
    assert isinstance(cfg.to_dict()["scenarios"], dict)


def test_doubling_ladder_includes_stop():
    assert doubling_ladder(1, 1) == (1,)
    assert doubling_ladder(1, 64) == (1, 2, 4, 8, 16, 32, 64)
    assert doubling_ladder(3, 20) == (3, 6, 12, 20)


def test_point_key_is_stable():
    assert SweepPoint("decode", 1024, 1024, 32, 160, 0, 1).key == "decode/isl1024-osl1024/c32"


# ------------------------------------------------------------------------------------- defaults

def test_defaults_and_round_trip():
    cfg = parse_sweep(dict(MINIMAL), "m.yaml")
    assert (cfg.dtype, cfg.mode, cfg.range_ratio, cfg.num_prompts_per_concurrency, cfg.warmup, cfg.seed) == \
        ("float32", "both", 0.8, 5, 0, 0)
    assert dataclasses.astuple(cfg.topology) == (1, 1, 1, 1)
    assert dict(cfg.engine_args) == {} and cfg.source == "m.yaml"
    again = parse_sweep(cfg.to_dict(), "m.yaml")
    assert again == cfg and again.points() == cfg.points()


def test_round_trip_through_yaml(tmp_path):
    import yaml
    for path in sorted(SWEEPS.glob("*.yaml")):
        cfg = load_sweep(path)
        out = tmp_path / path.name
        out.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
        assert dataclasses.replace(load_sweep(out), source=str(path)) == cfg


def test_config_is_frozen():
    cfg = parse_sweep(dict(MINIMAL))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.name = "x"
    with pytest.raises(TypeError):
        cfg.engine_args["max_num_seqs"] = 4


# ------------------------------------------------------------------------------------- errors: files

def test_missing_file(tmp_path):
    with pytest.raises(SweepConfigError, match=r"nope\.yaml: sweep file not found"):
        load_sweep(tmp_path / "nope.yaml")


def test_error_is_a_deepinfer_error():
    assert issubclass(SweepConfigError, DeepInferError)


def test_malformed_yaml_names_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("name: x\nmodel: tiny\nscenarios: [{isl: 1, osl: 2}\ndevice: cpu\n")
    with pytest.raises(SweepConfigError) as info:
        load_sweep(p)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{p}: malformed YAML at line 4")


def test_not_a_mapping(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- 1\n- 2\n")
    with pytest.raises(SweepConfigError, match=r"list\.yaml: the sweep must be a mapping .* got a list"):
        load_sweep(p)
    p.write_text("")
    with pytest.raises(SweepConfigError, match=r"got nothing \(null\)"):
        load_sweep(p)


# ------------------------------------------------------------------------------------- errors: keys

@pytest.mark.parametrize("data, path, hint", [
    (sweep(scenarios=[{"isl": 1, "osl": 2}], concurency=[1]), "concurency", "did you mean 'concurrency'?"),
    (sweep(engine_args={"max_num_seq": 4}), "engine_args.max_num_seq", "did you mean 'max_num_seqs'?"),
    (sweep(engine_args={"tensor_parallel": 2}), "engine_args.tensor_parallel", "allowed: max_num_seqs"),
    (sweep(scenarios=[{"isl": 1, "osl": 2, "isll": 3}]), "scenarios[0].isll", "did you mean 'isl'?"),
    (sweep(topology={"prefil_ranks": 2}), "topology.prefil_ranks", "did you mean 'prefill_ranks'?"),
    (sweep(concurrency={"start": 1, "stpo": 8}), "concurrency.stpo", "did you mean 'stop'?"),
    (sweep(model=_DROP), "model", "missing required key"),
    (sweep(scenarios=[{"isl": 1}]), "scenarios[0].osl", "missing required key"),
])
def test_unknown_and_missing_keys(data, path, hint):
    msg = error_of(data)
    assert f": {path}: " in msg and hint in msg, msg


# ------------------------------------------------------------------------------------- errors: values

@pytest.mark.parametrize("data, path, hint", [
    (sweep(name=3), "name", "non-empty string"),
    (sweep(name="a b"), "name", "letters, digits"),
    (sweep(model=""), "model", "non-empty string"),
    (sweep(model="random:deepseek_v41:huge:4"), "model", "PRESET in tiny|flash"),
    (sweep(model="random:deepseek_v41:flash:0"), "model", "LAYERS an integer >= 1"),
    (sweep(device="tpu"), "device", "allowed: cpu, cuda"),
    (sweep(dtype="int8"), "dtype", "allowed: bfloat16"),
    (sweep(mode="serve"), "mode", "allowed: prefill, decode, both"),
    (sweep(engine_args=[1]), "engine_args", "must be a mapping"),
    (sweep(engine_args={"max_num_seqs": 0}), "engine_args.max_num_seqs", "integer >= 1"),
    (sweep(engine_args={"max_num_seqs": "8"}), "engine_args.max_num_seqs", "got a string"),
    (sweep(engine_args={"enforce_eager": "yes"}), "engine_args.enforce_eager", "true or false"),
    (sweep(engine_args={"gpu_memory_utilization": 1.5}), "engine_args.gpu_memory_utilization", "(0, 1]"),
    (sweep(engine_args={"expert_storage": "fp8"}), "engine_args.expert_storage", "allowed: dense, fp4"),
    (sweep(engine_args={"projection_storage": "fp4"}), "engine_args.projection_storage", "allowed: dense, fp8"),
    (sweep(engine_args={"max_num_seqs": 64, "max_num_batched_tokens": 32}),
     "engine_args.max_num_batched_tokens", ">= max_num_seqs (64)"),
    (sweep(scenarios=[]), "scenarios", "non-empty list"),
    (sweep(scenarios={"isl": 1, "osl": 2}), "scenarios", "non-empty list"),
    (sweep(scenarios=[{"isl": 1, "osl": 2}, [1, 2]]), "scenarios[1]", "must be a mapping"),
    (sweep(scenarios=[{"isl": 1, "osl": 2}, {"isl": 1, "osl": 0}]), "scenarios[1].osl", "integer >= 1"),
    (sweep(scenarios=[{"isl": 1, "osl": 2}, {"isl": 1.5, "osl": 2}]), "scenarios[1].isl", "got a number"),
    (sweep(scenarios=[{"isl": 1, "osl": 2}, {"isl": True, "osl": 2}]), "scenarios[1].isl", "got a boolean"),
    (sweep(scenarios=[{"isl": 1, "osl": 2}, {"isl": 1, "osl": 2}]), "scenarios[1]", "duplicates scenarios[0]"),
    (sweep(engine_args={"max_model_len": 1024}, scenarios=[{"isl": 128, "osl": 32}, {"isl": 1000, "osl": 32}]),
     "scenarios[1]", "isl + osl = 1032 exceeds engine_args.max_model_len (1024)"),
    (sweep(scenarios=[{"isl": 8, "osl": 2, "shared": 1.0}]), "scenarios[0].shared", "in [0, 1)"),
    (sweep(scenarios=[{"isl": 8, "osl": 2, "shared": "half"}]), "scenarios[0].shared", "in [0, 1)"),
    (sweep(scenarios=[{"isl": 8, "osl": 2, "turns": 0}]), "scenarios[0].turns", "integer >= 1"),
    (sweep(engine_args={"max_model_len": 100}, scenarios=[{"isl": 40, "osl": 10, "turns": 3}]),
     "scenarios[0]", "turns x (isl + osl) = 150 exceeds engine_args.max_model_len (100)"),
    (sweep(engine_args={"enable_prefix_caching": "on"}), "engine_args.enable_prefix_caching", "true or false"),
    (sweep(range_ratio=0), "range_ratio", "(0, 1]"),
    (sweep(range_ratio="0.8"), "range_ratio", "must be a number"),
    (sweep(topology={"ep": 0}), "topology.ep", "integer >= 1"),
    (sweep(topology={"decode_ranks": 8, "ep": 16}), "topology.ep", "<= the larger role's ranks (8)"),
    (sweep(topology=4), "topology", "must be a mapping"),
    (sweep(concurrency=[]), "concurrency", "empty ladder"),
    (sweep(concurrency={"start": 8, "stop": 4}), "concurrency.stop", "empty ladder"),
    (sweep(concurrency=[1, 4, 4]), "concurrency[2]", "strictly ascending"),
    (sweep(concurrency=[1, 0]), "concurrency[1]", "integer >= 1"),
    (sweep(concurrency=8), "concurrency", "ascending list of integers >= 1, or {start, stop}"),
    (sweep(concurrency={"start": 1}), "concurrency.stop", "missing required key"),
    (sweep(concurrency={"decode": [1]}), "concurrency.prefill", "missing required key"),
    (sweep(mode="decode", concurrency={"prefill": [1], "decode": [1]}), "concurrency.prefill", "does not run"),
    (sweep(concurrency={"prefill": [1], "decode": []}), "concurrency.decode", "empty ladder"),
    (sweep(scenarios={"decode": [{"isl": 1, "osl": 2}]}), "scenarios.prefill", "missing required key"),
    (sweep(mode="prefill", scenarios={"prefill": [{"isl": 1, "osl": 2}], "decode": [{"isl": 1, "osl": 2}]}),
     "scenarios.decode", "does not run"),
    (sweep(scenarios={"prefill": [{"isl": 1, "osl": 2}], "decode": [{"isl": 0, "osl": 2}]}),
     "scenarios.decode[0].isl", "integer >= 1"),
    (sweep(num_prompts_per_concurrency=4), "num_prompts_per_concurrency", "at least 5x concurrency"),
    (sweep(warmup=-1), "warmup", "integer >= 0"),
    (sweep(seed="0"), "seed", "integer >= 0"),
])
def test_bad_values(data, path, hint):
    msg = error_of(data)
    assert f": {path}: " in msg and hint in msg, msg


def test_error_from_file_names_file_and_path(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("name: x\nmodel: tiny\ndevice: cpu\nscenarios:\n  - {isl: 1, osl: 2}\n  - {isl: 3, osl: -1}\n"
                 "concurrency: [1]\n")
    with pytest.raises(SweepConfigError, match=rf"^{p}: scenarios\[1\]\.osl: got -1; must be an integer >= 1$"):
        load_sweep(p)


def test_constants_match_the_engine():
    """The shared validation layer's names cover the engine's presets; the schema's engine args are LLM's."""
    from deepinfer import validate
    from deepinfer.config.presets import PRESETS
    from deepinfer.harness import sweep_config as sc
    from deepinfer.llm import ENGINE_DEFAULTS
    assert {(a, p) for a in validate.ARCHS for p in validate.PRESETS} == set(PRESETS)
    assert set(sc.ENGINE_ARG_KINDS) <= set(ENGINE_DEFAULTS)


# ------------------------------------------------------------------------------------- speculative axis

def test_speculative_axis_multiplies_points_and_labels_them():
    cfg = parse_sweep(sweep(model="random:deepseek_v41:tiny:2", mode="decode",
                            speculative=["off", {"schedule": "fixed"}, {"schedule": "confidence",
                                                                        "num_speculative_tokens": 3}]))
    keys = [p.key for p in cfg.points()]
    assert keys[:2] == ["none/decode/isl128-osl32/c1", "none/decode/isl128-osl32/c2"]
    assert keys[2:4] == ["dspark-fixed-5/decode/isl128-osl32/c1", "dspark-fixed-5/decode/isl128-osl32/c2"]
    assert keys[4].startswith("dspark-confidence-3/") and len(keys) == 6
    assert cfg.speculative_value("none") is False
    assert cfg.speculative_value("dspark-confidence-3") == {"schedule": "confidence", "num_speculative_tokens": 3}
    again = parse_sweep(cfg.to_dict())             # the stored definition loads back to the same points
    assert [p.key for p in again.points()] == keys
    v4 = parse_sweep(sweep(model="random:deepseek_v4:tiny:2", speculative=["off", {"schedule": "budget"}]))
    assert [label for label, _ in v4.speculative] == ["none", "mtp-budget-5"]      # V4 drafts with its MTP layer
    off = parse_sweep(sweep(model="random:deepseek_v41:tiny:2", engine_args={"speculative": "off"}))
    assert off.engine_args["speculative"] is False      # as LLM takes it
    plain = parse_sweep(sweep())                   # no axis: keys as before, no speculative key stored
    assert plain.points()[0].key == "prefill/isl128-osl32/c1" and "speculative" not in plain.to_dict()


@pytest.mark.parametrize("data,path,hint", [
    (sweep(speculative=[]), "speculative", "non-empty list"),
    (sweep(model="random:deepseek_v41:tiny:2", speculative=["off", "off"]), "speculative[1]", "repeats"),
    (sweep(model="random:deepseek_v41:tiny:2", speculative=[{"schedule": "smart"}]), "speculative[0]",
     "schedule='smart'"),
    (sweep(model="random:deepseek_v4:tiny:2", speculative=[{"method": "dspark"}]), "speculative[0]",
     "this model drafts with 'mtp'"),
    (sweep(model="random:deepseek_v41:tiny:2", speculative=["off"], engine_args={"speculative": True}),
     "speculative", "not both"),
    (sweep(model="random:deepseek_v41:tiny:2", engine_args={"speculative": {"speed": 2}}),
     "engine_args.speculative[0]", "unknown keys"),
])
def test_bad_speculative_settings(data, path, hint):
    msg = error_of(data)
    assert f": {path}: " in msg and hint in msg, msg


def test_shared_prefix_scenarios_key_and_round_trip():
    cfg = parse_sweep(sweep(scenarios=[{"isl": 64, "osl": 4}, {"isl": 64, "osl": 4, "shared": 0.9},
                                       {"isl": 64, "osl": 4, "turns": 3}], concurrency=[1], mode="prefill"))
    assert [p.key for p in cfg.points()] == ["prefill/isl64-osl4/c1", "prefill/isl64-osl4-shared90/c1",
                                             "prefill/isl64-osl4-turns3/c1"]
    assert parse_sweep(cfg.to_dict()).points() == cfg.points()
