"""Structured outputs in deepinfer-eval: the offline task deepinfer_json (generate_until constrained by a JSON
schema through so_args in its generation_kwargs) and its json_record metric; the structured-smoke suite passes
its json_valid >= 1 bound on the tiny model; the same task without the grammar scores 0 (the metric can fail);
--reference transformers refuses a constrained task in one line."""

from __future__ import annotations

import json

import pytest

from deepinfer.evals.tasks import offline_tasks
from deepinfer.evals.tasks.metrics import json_record
from tests.test_eval_run import rows_of, run

pytest.importorskip("xgrammar")
pytest.importorskip("jsonschema")


def test_json_record_metric():
    schema = offline_tasks()["deepinfer_json"]["generation_kwargs"]["so_args"]["schema"]
    doc = {"fields": {"name": "Ada", "age": 36, "city": "Oslo"}}
    assert json_record(doc, ['{"name": "Ada", "age": 36, "city": "Oslo"}'], schema) == \
        {"json_valid": 1.0, "field_match": 1.0}
    assert json_record(doc, ['{"name": "Ada", "age": 37, "city": "Oslo"}'], schema) == \
        {"json_valid": 1.0, "field_match": 0.0}
    for bad in ['{"name": "Ada", "age": 36}', '{"name": "Ada", "age": 36, "city": "Rome"}', '{"name": "Ada",',
                '{"name": "A\x06", "age": 1, "city": "Oslo"}', "", '{"name": "Ada", "age": 36, "city": "Oslo", "x": 1}']:
        assert json_record(doc, [bad], schema) == {"json_valid": 0.0, "field_match": 0.0}, bad
    bound = offline_tasks()["deepinfer_json"]["process_results"]       # bound to the task's schema
    assert bound(doc, ['{"name": "Ada", "age": 36, "city": "Oslo"}'])["json_valid"] == 1.0


def test_structured_smoke_suite_and_the_same_task_without_its_grammar(tmp_path):
    p = run("--suite", "structured-smoke", "--out", str(tmp_path), "--run-id", "s")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = rows_of(tmp_path / "s")
    valid = [r for r in rows if r["kind"] == "eval" and r["metric"] == "json_valid,none"]
    assert [r["concurrency"] for r in valid] == [8, 4]
    assert all(r["value"] == 1.0 and r["passed"] for r in valid)
    assert [r["value"] for r in rows if r["kind"] == "agreement"] == [1.0]
    samples = [json.loads(line) for line in (tmp_path / "s" / "samples_c8.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and all(s["json_valid"] == 1.0 for s in samples)

    free = tmp_path / "free.yaml"             # the grammar removed: a random model's text is not a record
    free.write_text("name: free\nmodel: tiny\nengine_args: {max_num_seqs: 4, max_model_len: 512}\n"
                    "tasks:\n  - {task: deepinfer_json, num_fewshot: 2, generation_kwargs: "
                    "{until: ['\\nText:'], max_gen_toks: 24, do_sample: false}}\nlimit: 4\nconcurrency: [max]\n")
    p = run("--suite", str(free), "--out", str(tmp_path), "--run-id", "f")
    assert p.returncode == 0, p.stderr[-2000:]
    (row,) = [r for r in rows_of(tmp_path / "f") if r["kind"] == "eval" and r["metric"] == "json_valid,none"]
    assert row["value"] == 0.0


def test_reference_refuses_a_constrained_task(tmp_path):
    from deepinfer.checkpoint.make import embedded_tiny_dir
    p = run("--suite", "structured-smoke", "--model", str(embedded_tiny_dir("deepseek_v4")), "--reference",
            "transformers", "--out", str(tmp_path), "--run-id", "r")
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode != 0 and len(lines) == 1, p.stderr[-2000:]
    assert "task deepinfer_json constrains its replies with so_args" in lines[0]
    assert not (tmp_path / "r").exists()


def test_the_metric_follows_the_tasks_grammar(tmp_path):
    """A suite override that sets so_args is scored against its own schema, one that drops the grammar keeps the
    task's; a task YAML naming the metric without so_args is one line."""
    from lm_eval.tasks import TaskManager

    from deepinfer.evals.suite import TaskSpec
    from deepinfer.evals.tasks import TaskError, bind_metric, task_configs
    other = {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}}}
    spec = TaskSpec("deepinfer_json", 0, {"generation_kwargs": {"so_args": {"schema_type": "json", "schema": other},
                                                                 "until": ["\nText:"], "max_gen_toks": 8}})
    free = TaskSpec("deepinfer_json", 0, {"generation_kwargs": {"until": ["\nText:"], "max_gen_toks": 8}})
    (a,), (b,) = (task_configs([s], lambda defaults: TaskManager(include_defaults=False)) for s in (spec, free))
    assert a["process_results"]({}, ['{"x": 3}'])["json_valid"] == 1.0
    assert b["process_results"]({}, ['{"x": 3}'])["json_valid"] == 0.0
    assert b["process_results"]({}, ['{"name": "Ada", "age": 3, "city": "Lima"}'])["json_valid"] == 1.0
    with pytest.raises(TaskError, match="x.yaml: process_results json_record scores against the schema"):
        bind_metric({"task": "t", "process_results": "json_record"}, "x.yaml")
