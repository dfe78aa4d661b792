"""Eval suites: the shipped ones load; bad suites fail with one line naming the key; concurrency words resolve."""

from __future__ import annotations

import pytest

from deepinfer.evals.suite import Bound, SuiteError, load_suite, metric_key, parse_suite, suite_names

MINIMAL = {"name": "s", "model": "tiny", "tasks": ["deepinfer_arith"]}


def suite(**kw):
    return {**MINIMAL, **kw}


def error_of(data) -> str:
    with pytest.raises(SuiteError) as info:
        parse_suite(data, "x.yaml")
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_shipped_suites_load():
    assert {"offline-smoke", "flash-4l-offline", "v41-flash-published"} <= set(suite_names())
    for name in suite_names():
        s = load_suite(name)
        assert s.name == name and s.tasks
        assert parse_suite(s.to_dict(), s.source) == s


def test_published_suite_mirrors_deepseek_reports():
    s = load_suite("v41-flash-published")
    assert s.model == "deepseek-ai/DeepSeek-V4.1-Flash-1017"
    assert {t.name for t in s.tasks} == {"gsm8k_cot", "mmlu", "mmlu_pro", "humaneval"}


def test_concurrency_words():
    s = parse_suite(suite(concurrency=["max", "median", 3]))
    assert s.concurrencies(64) == [64, 8, 3]          # median of 1, 2, 4, ..., 64
    assert s.concurrencies(8) == [8, 4, 3]
    with pytest.raises(SuiteError, match=r"concurrency\[3\]: 'max' is listed twice"):
        parse_suite(suite(concurrency=["max", "median", 3, "max"]))
    with pytest.raises(SuiteError, match="exceeds engine max_num_seqs"):
        parse_suite(suite(concurrency=[16])).concurrencies(8)


def test_shipped_suites_hold_no_bound_that_cannot_fail():
    """Every bound of a shipped suite can fail (parse_suite refuses trivially true ones on fraction metrics); the
    offline-smoke suite bounds what an untrained model can be held to: scoring numerics and agreement."""
    s = load_suite("offline-smoke")
    assert set(s.thresholds) == {"deepinfer_text"} and s.agreement.min == 1.0
    assert str(Bound(0.5)) == ">= 0.5" and not Bound(0.5).holds(0.0)


def test_thresholds_and_bounds():
    s = parse_suite(suite(thresholds={"deepinfer_arith": {"exact_match,first-integer": {"min": 0.5}}}))
    bound = s.thresholds["deepinfer_arith"]["exact_match,first-integer"]
    assert bound.holds(0.5) and not bound.holds(0.49) and not bound.holds(float("nan")) and not bound.holds(None)
    assert str(Bound(0.1, 0.9)) == ">= 0.1 and <= 0.9"
    assert metric_key("acc") == "acc,none" and metric_key("exact_match,strict-match") == "exact_match,strict-match"


def test_task_entries():
    s = parse_suite(suite(tasks=["deepinfer_text", {"task": "deepinfer_arith", "num_fewshot": 3,
                                                   "generation_kwargs": {"max_gen_toks": 4}}]))
    assert [t.name for t in s.tasks] == ["deepinfer_text", "deepinfer_arith"]
    assert s.tasks[1].num_fewshot == 3 and dict(s.tasks[1].overrides) == {"generation_kwargs": {"max_gen_toks": 4}}


@pytest.mark.parametrize("data, fragment", [
    ([1, 2], "a suite is a mapping"),
    (suite(taks=["x"]), "taks: unknown key; did you mean 'tasks'?"),
    ({"name": "s", "model": "tiny"}, "tasks: missing required key"),
    (suite(tasks=[]), "tasks: must be a non-empty list"),
    (suite(tasks=[{"num_fewshot": 2}]), "tasks[0]: must be a task name"),
    (suite(tasks=["a", "a"]), "tasks[1]: task 'a' is listed twice"),
    (suite(tasks=[{"task": "a", "num_fewshot": -1}]), "tasks[0].num_fewshot"),
    (suite(concurrency=["most"]), "concurrency[0]: got 'most'; allowed: max, median"),
    (suite(concurrency=[0]), "concurrency[0]"),
    (suite(limit=0), "limit"),
    (suite(thresholds={"other": {"acc": {"min": 1}}}), "thresholds.other: not one of the suite's tasks"),
    (suite(thresholds={"deepinfer_arith": {"acc": {"least": 1}}}), "thresholds.deepinfer_arith.acc.least"),
    (suite(thresholds={"deepinfer_arith": {"acc": {"min": "high"}}}), "must be a number"),
    (suite(agreement={}), "agreement: give min and/or max"),
    (suite(batch_invariant="yes"), "batch_invariant: must be true or false"),
    (suite(model="random:deepseek_v4:huge:2"), "model: model='random:deepseek_v4:huge:2'"),
    (suite(thresholds={"deepinfer_arith": {"acc": {"min": 0}}}), "acc: >= 0 holds for every value of acc (0..1), "
                                                                 "so it can never fail"),
    (suite(thresholds={"deepinfer_arith": {"exact_match,first-integer": {"min": 0.0, "max": 1.0}}}),
     "can never fail"),
    (suite(agreement={"min": 0}), "agreement: >= 0 holds for every value of agreement"),
    (suite(name="a b"), "name: got 'a b'"),
])
def test_bad_suites(data, fragment):
    msg = error_of(data)
    assert msg.startswith("x.yaml") and fragment in msg, msg


def test_unknown_suite_and_bad_yaml(tmp_path):
    with pytest.raises(SuiteError, match="unknown suite 'nope'; suites: .*offline-smoke"):
        load_suite("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntasks: [a\n")
    with pytest.raises(SuiteError, match=r"bad.yaml: malformed YAML at line \d+, column \d+"):
        load_suite(bad)


def test_published_suite_names_lm_eval_tasks():
    """Every non-offline task of the shipped suites is in lm-eval's task index (so users with hub access can run
    them as they are)."""
    pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from deepinfer.evals.tasks import offline_tasks
    index = TaskManager().all_tasks
    local = offline_tasks()
    for name in suite_names():
        for t in load_suite(name).tasks:
            assert t.name in local or t.name in index, (name, t.name)
