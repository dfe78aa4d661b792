"""deepinfer-bench ops (harness/op_census.py) on the tiny V4.1: decode steps are counted, every torch op lands under
an engine source line or the kernels/ op it ran inside, views are not counted, bad options are one line."""

from __future__ import annotations

from click.testing import CliRunner

from deepinfer import LLM
from deepinfer.errors import DeepInferError
from deepinfer.checkpoint.make import embedded_tiny_dir
from deepinfer.harness.cli import cli
from deepinfer.harness.op_census import NO_LAUNCH, run_census, run_graph_census, table


def test_census_files_every_op_by_source():
    llm = LLM(embedded_tiny_dir("deepseek_v41"), enforce_eager=True, async_scheduling=False)
    census = run_census(llm, batch=2, prompt_len=12, new_tokens=4)
    assert census.steps == 3                              # 4 new tokens: the prefill's, then 3 decode steps
    assert census.per_step > 50
    sources = {where for (where, _op) in census.lines}
    assert all(w.startswith("engine/") for w in sources)
    assert any("write_ring" in w for w in sources)        # the ring writes are torch index_put_s on every backend
    assert not any(f"aten.{op}" in NO_LAUNCH for (_w, op) in census.lines)
    assert census.kernel_ops["kernels/mhc.py:hc_mixes"] > 0   # the reference mHC's ops, filed under its op
    layers = llm.model.cfg.num_hidden_layers
    assert census.op_calls["route"] == 3 * layers          # one call per MoE layer per decode step, 3 steps
    assert census.op_calls["rms_norm"] % 3 == 0 and census.calls_per_step > 4 * layers
    lines = table(census, 5)
    assert lines[0].endswith("(3 steps counted)") and len(lines) == 2 + 5 + 1 + 5 + 1 + 5
    assert lines[-6].endswith("op calls per decode step (one launch or more each in the Triton sets)")
    assert llm.generate([{"prompt_token_ids": [5, 6, 7]}], use_tqdm=False)   # the table is the engine's again
    assert type(llm.engine.kernels.fns).__name__ == "_LazyFunctions"


def test_graph_census_counts_the_static_decode_step():
    """--graph: the forward a decode graph captures (uniform one-row segments), not the eager ragged decode."""
    llm = LLM(embedded_tiny_dir("deepseek_v41"), enforce_eager=True, async_scheduling=False, max_model_len=64)
    graph = run_graph_census(llm, batch=3, context=20)
    assert graph.steps == 1 and graph.per_step > 50
    sources = {where for (where, _op) in graph.lines}
    assert any("forward_batch.py" in w and w.endswith(" uniform") for w in sources)
    assert not any(w.endswith(" ragged") for w in sources)
    eager = {where for (where, _op) in run_census(llm, batch=3, prompt_len=12, new_tokens=3).lines}
    assert any(w.endswith(" ragged") for w in eager)
    assert table(graph, 3)[0].endswith("(1 step counted)")
    assert graph.op_calls["permute"] == llm.model.cfg.num_hidden_layers      # one step, every layer a MoE


def test_bad_options_are_one_line():
    result = CliRunner().invoke(cli, ["ops", "--top", "0"])       # main() prints a DeepInferError as one line
    assert result.exit_code != 0 and isinstance(result.exception, DeepInferError)
    assert "--top must be at least 1, got 0" in str(result.exception) and "\n" not in str(result.exception)


def test_a_triton_set_needs_the_interpreter(monkeypatch):
    """On the CPU a Triton set runs only under Triton's interpreter (tests/interpreted/test_op_census_triton.py
    counts its launches): without TRITON_INTERPRET=1 the option is one line, before any model is built."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    result = CliRunner().invoke(cli, ["ops", "--kernel-backend", "triton"])
    assert result.exit_code != 0 and isinstance(result.exception, DeepInferError)
    assert "TRITON_INTERPRET=1" in str(result.exception) and "\n" not in str(result.exception)
