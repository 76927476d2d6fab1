"""lm-evaluation-harness tasks: fsdp_lab's names for lm-eval's metrics, and the one-line refusal
of a task lm-eval cannot find (a YAML that does not parse is skipped by its index)."""

from __future__ import annotations

import pytest
from conftest import tiny_llama

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


def test_a_request_the_model_cannot_take_fails_in_one_line_before_any_forward():
    from transformers import ByT5Tokenizer

    from fsdp_lab.train.evaluation import Decoding
    from fsdp_lab.train.generate import Lockstep
    from fsdp_lab.train.harness_lm import ShardedLM

    model = tiny_llama(vocab_size=259, num_hidden_layers=1, max_position_embeddings=16)
    tok = ByT5Tokenizer(extra_ids=0)
    lm = ShardedLM(model, Decoding.of(tok, model.config), lock=Lockstep(), batch_size=2)
    good = (("a", "b"), [5, 6], [7])
    assert len(lm._loglikelihood_tokens([good])) == 1
    for bad in ((("a", ""), [5], []), (("a", "b" * 20), [5], list(range(20)))):
        with pytest.raises(ConfigError, match="a harness request has a context of") as e:
            lm._loglikelihood_tokens([good, bad])
        assert "\n" not in str(e.value)
