"""deepinfer-bench versus on the tiny V4 model (CPU, fp32): rows for transformers, deepinfer and the reference
backend at each batch, the same greedy tokens as transformers' generate (the comparison runs the same weights),
the table's ratios, bad input in one line."""

import json

import pytest
from click.testing import CliRunner

from deepinfer.errors import DeepInferError
from deepinfer.harness.cli import cli
from deepinfer.harness.versus_bench import VersusConfig, run_versus_bench, table
from tests.helpers import assert_traffic


@pytest.mark.usefixtures("transformers_v4_reference")
def test_versus_rows_and_agreement(tmp_path):
    cfg = VersusConfig(batches=(1, 3), isl=40, osl=6)
    rows = run_versus_bench(cfg, tmp_path / "run")
    assert [r["key"] for r in rows] == ["transformers/b1", "transformers/b3", "deepinfer/b1", "deepinfer/b3",
                                        "reference/b1", "reference/b3"]
    for r in rows:
        assert r["status"] == "ok" and r["output_tokens"] == r["batch"] * 6 and r["seconds"] > 0
        assert r["qat_fake_quant"] is False and r["model_type"] == "deepseek_v4"
        if r["engine"] != "transformers":
            assert_traffic(r)
            assert r["agreement_with_transformers"] == {"tokens": 1.0, "first_token": 1.0}   # fp32: same tokens
            assert r["kernel_backend"] == "reference"                                       # CPU default
    assert json.loads((tmp_path / "run" / "versus.json").read_text())["osl"] == 6
    lines = table(rows)
    assert lines[0].split()[:3] == ["engine", "batch", "seconds"] and len(lines) == 7
    assert lines[1].split()[0] == "transformers" and lines[1].split()[5] == "1.00x"


def test_versus_refuses_bad_input(tmp_path):
    with pytest.raises(DeepInferError, match="--engines 'vllm'"):
        VersusConfig(engines=("vllm",)).check()
    with pytest.raises(DeepInferError, match="runs deepseek_v4 only"):
        run_versus_bench(VersusConfig(model="random:deepseek_v41:tiny:10", batches=(1,), isl=8, osl=2),
                         tmp_path / "v41")
    assert not (tmp_path / "v41").exists()
    res = CliRunner().invoke(cli, ["versus", "--osl", "0", "--out", str(tmp_path / "x")])
    assert res.exit_code != 0 and "--osl must be at least 1" in str(res.exception)
