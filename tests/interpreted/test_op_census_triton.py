"""deepinfer-bench ops with a Triton set under the interpreter (harness/op_census.py): each kernel launch of the
graph-captured decode step is counted, and the step's launches stay at what the fusions left (tiny V4.1 and V4,
one sequence): the permute is one kernel with no torch ops around it, the expert tile table one kernel, the
compressors' open windows two gathers, a static step's closing rows no torch op at all."""

from __future__ import annotations

import pytest

from deepinfer.harness.op_census import build_census_engine, run_graph_census, table

# launches per decode step measured when these fusions landed (docs/results.md): a regression past them fails
BOUNDS = {"deepseek_v41": 218, "deepseek_v4": 261}


@pytest.mark.parametrize("family", sorted(BOUNDS))
def test_triton_census_counts_kernels_and_holds_the_fusions(family):
    llm = build_census_engine(f"random:{family}:tiny:4", "triton", 1)
    census = run_graph_census(llm, batch=1)
    layers = llm.model.cfg.num_hidden_layers
    assert census.kernels["_permute_scatter_kernel"] == layers and "_expert_histogram_kernel" not in census.kernels
    assert census.kernels["_tile_table_kernel"] == layers              # one table for the two expert GEMMs
    assert census.kernels["_gather_rows_kernel"] >= 2                  # a compressor's kv and scores
    inside = {k.split(":")[1] for k in census.kernel_ops}
    assert not inside & {"permute", "grouped_experts", "swiglu", "route", "softmax_pool"}, inside
    assert not any("closing_rows" in where or "open_windows" in where for where, _ in census.lines)
    assert 100 < census.launches_per_step <= BOUNDS[family]
    assert any(line.endswith("(before cuBLAS's split-K reduces)") for line in table(census, 5))
