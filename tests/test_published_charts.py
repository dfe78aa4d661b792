"""`deepinfer-bench report --published` from hand-written rows: which rows each chart takes, measured and projected
drawn apart, byte-stable files, and the one-line message of a chart without rows. CPU, HTML only."""

import json

import pandas as pd
from click.testing import CliRunner

from deepinfer.harness.cli import cli
from deepinfer.harness.published_charts import (considered_rows, published_figure, select, spec_symbols,
                                                write_published)

MODEL, HW = "deepseek-v4-flash", "H200"


def _row(run_id, mode, c, gpus, spec="none", projected=False, status="ok", **extra):
    isl, osl = (8192, 1) if mode == "prefill" else (1024, 1024)
    row = {"run_id": run_id, "key": f"{mode}/isl{isl}-osl{osl}/c{c}", "mode": mode, "isl": isl, "osl": osl,
           "concurrency": c, "gpus": gpus, "hardware": HW, "engine": "deepinfer", "spec_mode": spec,
           "is_projected": projected, "model": MODEL, "status": status,
           "input_tput_per_gpu": 1000.0 * c / (1 + c / 8), "p99_ttft": 0.05 * c + 0.013,
           "median_ttft": 0.04 * c, "output_tput_per_gpu": 30.0 * c / (1 + c / 64) * (1.7 if spec != "none" else 1),
           "median_intvty": 90.0 / (1 + c / 32) * (1.7 if spec != "none" else 1)}
    if spec != "none":
        row["key"] += f"/{spec}"
    return row | extra


def _write_run(root, run_id, rows):
    run = root / "1" / run_id
    run.mkdir(parents=True)
    (run / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _report_dir(tmp_path):
    """A measured run (4-rank prefill, 64-rank decode, and rows no chart takes) and a projected run (64-rank decode,
    DSpark off and on)."""
    measured = [_row("h200-measured", "prefill", c, 4) for c in (1, 4, 16)]
    measured += [_row("h200-measured", "prefill", 2, 1), _row("h200-measured", "decode", 2, 2),     # other ranks
                 _row("h200-measured", "decode", 64, 64, status="failed")]
    measured += [_row("h200-measured", "decode", c, 64) for c in (8, 32)]
    projection = {"version": "1", "overlap": "two_micro_batches", "calibration": {
        "decode": {"run": "step-h200-s33-v41", "measured_on": "NVIDIA H200", "layers": 4}, "prefill": None}}
    projected = [_row("h200-projected", "decode", c, 64, spec=spec, projected=True, projection=projection,
                      flags=["eager rows: busy time = median x (1 - GPU idle)"])
                 for spec in ("none", "dspark-fixed-5") for c in (16, 64, 256)]
    _write_run(tmp_path, "h200-measured", measured)
    _write_run(tmp_path, "h200-projected", projected)
    chosen = {("h200-measured", r["key"]) for r in measured if r["status"] == "ok" and r["gpus"] in (4, 64)}
    return chosen | {("h200-projected", r["key"]) for r in projected}


def test_published_charts_take_the_rows_at_the_ranks_and_are_byte_stable(tmp_path):
    chosen = _report_dir(tmp_path)
    written, missing = write_published(tmp_path, png=False)
    out = tmp_path / "published"
    assert missing == [] and sorted(p.name for p in written) == ["decode.html", "points.csv", "prefill.html"]
    html = (out / "decode.html").read_text()
    assert 'src="../plotly.min.js"' in html and (out / ".." / "plotly.min.js").is_file()   # works from published/
    assert "projected" in html and "step-h200-s33-v41" in html and "eager rows" in html
    assert "non-cached" in (out / "prefill.html").read_text()
    points = pd.read_csv(out / "points.csv")
    assert set(zip(points["run_id"], points["key"])) == chosen and len(points) == len(chosen)
    assert list(points["mode"]) == ["prefill"] * 3 + ["decode"] * 8
    assert set(points.loc[points["is_projected"], "calibration"]) == {"decode step-h200-s33-v41 (NVIDIA H200)"}
    before = {p.name: p.read_bytes() for p in written}
    again, _ = write_published(tmp_path, png=False)                          # over its own files
    assert {p.name: p.read_bytes() for p in again} == before
    for p in written:
        p.unlink()
    again, _ = write_published(tmp_path, png=False)                          # from nothing
    assert {p.name: p.read_bytes() for p in again} == before


def test_published_png_is_kept_while_its_chart_is_unchanged(tmp_path):
    """Without a browser (or with --no-png) a published PNG rendered elsewhere stays while the rows give the same
    chart, and goes once the chart changes."""
    _report_dir(tmp_path)
    write_published(tmp_path, png=False)
    png = tmp_path / "published" / "decode.png"
    png.write_bytes(b"rendered elsewhere")
    again, _ = write_published(tmp_path, png=False)
    assert png in again and png.read_bytes() == b"rendered elsewhere"
    write_published(tmp_path, decode_ranks=2, png=False)                     # other rows: another chart
    assert not png.exists() and (tmp_path / "published" / "decode.html").exists()


def test_projected_series_are_open_and_dotted_and_spec_modes_differ(tmp_path):
    _report_dir(tmp_path)
    decode = select(considered_rows(tmp_path), "decode", 64)
    fig = published_figure(decode, "decode", 64, spec_symbols(decode))
    markers = [t for t in fig.data if t.mode == "markers"]
    lines = {t.legendgroup: t for t in fig.data if t.mode == "lines"}
    assert len(markers) == 3                               # measured none; projected none and dspark-fixed-5
    for t in markers:
        projected = t.name.endswith(" projected")
        assert projected != t.name.endswith(" measured")
        assert t.marker.symbol.endswith("-open") == projected
        assert lines[t.legendgroup].line.dash == ("dot" if projected else "solid")
    symbols = {t.name: t.marker.symbol for t in markers}
    assert len({s.removesuffix("-open") for s in symbols.values()}) == 2       # DSpark on and off apart
    assert any("dspark-fixed-5" in name for name in symbols) and any("no speculation" in n for n in symbols)


def test_cli_published_restricts_to_named_runs_and_reports_a_missing_chart(tmp_path):
    _report_dir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(cli, ["report", "--published", "--report-dir", str(tmp_path), "--no-png"])
    assert res.exit_code == 0, res.output
    assert "published: " in res.output and "prefill.html" in res.output and "decode.html" in res.output
    assert not (tmp_path / "index.md").exists()                              # --published writes only published/
    res = runner.invoke(cli, ["report", "h200-projected", "--published", "--report-dir", str(tmp_path), "--no-png"])
    assert res.exit_code == 0, res.output
    lines = [line for line in res.output.splitlines() if "published prefill chart" in line]
    assert len(lines) == 1 and "gpus == 4" in lines[0] and "--prefill-ranks 4" in lines[0]
    assert not (tmp_path / "published" / "prefill.html").exists()            # the earlier one is gone
    assert set(pd.read_csv(tmp_path / "published" / "points.csv")["run_id"]) == {"h200-projected"}
    res = runner.invoke(cli, ["report", "--published", "--decode-ranks", "2", "--prefill-ranks", "1",
                              "--report-dir", str(tmp_path), "--no-png"])
    assert res.exit_code == 0, res.output
    points = pd.read_csv(tmp_path / "published" / "points.csv")
    assert sorted(points["gpus"]) == [1, 2]
    for args, msg in ((["gone", "--published"], "no stored rows for run(s) ['gone']"),
                      (["--decode-ranks", "64", "--all"], "add --published"),
                      (["h200-measured", "--published", "--against", "h200-projected"], "--published pools")):
        res = runner.invoke(cli, ["report", *args, "--report-dir", str(tmp_path), "--no-png"])
        assert res.exit_code != 0 and msg in (res.output + str(res.exception)), res.output


def test_no_matching_rows_writes_nothing_and_says_how_to_get_them(tmp_path):
    _write_run(tmp_path, "one-gpu", [_row("one-gpu", "prefill", 1, 1), _row("one-gpu", "decode", 4, 1)])
    res = CliRunner().invoke(cli, ["report", "--published", "--report-dir", str(tmp_path), "--no-png"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert len(lines) == 2 and not any(line.startswith("published:") for line in lines)
    assert "no ok prefill rows with gpus == 4" in lines[0]
    assert "no ok decode rows with gpus == 64" in lines[1] and "deepinfer-bench sweep SWEEP --decode-ranks 64" in lines[1]
    assert not (tmp_path / "published").exists() and not (tmp_path / "plotly.min.js").exists()
