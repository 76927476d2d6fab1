"""lm-evaluation-harness tasks: fsdp_lab's names for lm-eval's metrics, and the one-line refusal
of a task lm-eval cannot find (a YAML that does not parse is skipped by its index)."""

from __future__ import annotations

import pytest

from fsdp_lab.config import ConfigError
from fsdp_lab.train.harness import HarnessTasks, include_dir, metric_name

pytest.importorskip("lm_eval")


def test_metric_names_drop_lm_evals_none_filter():
    assert metric_name("acc,none") == "acc"
    assert metric_name("exact_match,strict-match") == "exact_match/strict-match"


def test_the_shipped_tasks_are_found_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tasks = HarnessTasks(["lab_facts_mc", "lab_facts_gen"], include_dir("tests/harness_tasks"))
    assert {"lab_facts_mc", "lab_facts_gen"} <= set(tasks.task_manager().all_tasks)


def test_a_task_yaml_that_does_not_parse_is_an_unknown_task_in_one_line(tmp_path):
    (tmp_path / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n")
    tasks = HarnessTasks(["broken"], str(tmp_path))
    with pytest.raises(ConfigError) as e:
        tasks.task_manager()
    message = str(e.value)
    assert "unknown task broken" in message and str(tmp_path) in message
    assert "does not parse" in message and "\n" not in message
