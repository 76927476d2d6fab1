"""A study's storage that holds something else is refused in one line and left as it was;
a grid study's order is its seed's."""

from __future__ import annotations

from types import SimpleNamespace

import optuna
import pytest

from fsdp_lab.config import ConfigError, Objective
from fsdp_lab.launch import study


def sweeper(storage=None):
    return SimpleNamespace(storage=storage, study_name="s", sampler=optuna.samplers.TPESampler())


def test_a_file_that_is_not_a_study_is_refused_and_kept(tmp_path):
    (tmp_path / "optuna.db").write_text("not a database")
    with pytest.raises(ConfigError, match=r"cannot be opened as an Optuna study.*move that file"):
        study._open_study(sweeper(), tmp_path, ["minimize"], Objective.val_loss)
    assert (tmp_path / "optuna.db").read_text() == "not a database"


def test_a_study_continues_only_with_its_objective_and_direction(tmp_path):
    made = study._open_study(sweeper(), tmp_path, ["minimize"], Objective.val_loss)
    made.tell(made.ask(), 1.0)  # something to keep
    again = study._open_study(sweeper(), tmp_path, ["minimize"], Objective.val_loss)
    assert len(again.get_trials()) == 1
    with pytest.raises(ConfigError, match="made for objective=val_loss, not best_val_loss"):
        study._open_study(sweeper(), tmp_path, ["minimize"], Objective.best_val_loss)
    with pytest.raises(ConfigError, match="made for another direction"):
        study._open_study(sweeper(), tmp_path, ["maximize"], Objective.tokens_per_s)
    kept = study._open_study(sweeper(), tmp_path, ["minimize"], Objective.val_loss)
    assert len(kept.get_trials()) == 1


def test_a_grid_study_runs_its_points_in_the_same_order_for_the_same_seed():
    def order(seed: int) -> list[int]:
        s = optuna.create_study(sampler=optuna.samplers.GridSampler({"x": list(range(6))}))
        points = []
        for _ in range(6):
            trial = study._ask(s, seed)
            points.append(trial.suggest_categorical("x", list(range(6))))
            study._tell(s, trial, values=0.0)
        return points

    first = order(0)
    assert sorted(first) == list(range(6))
    assert order(0) == first  # unseeded, 1 in 720 alike
    assert order(1) != first or order(2) != first


def test_a_study_another_sweep_is_writing_is_refused_as_such(tmp_path):
    import sqlite3

    study._open_study(sweeper(), tmp_path, ["minimize"], Objective.val_loss)
    writer = sqlite3.connect(tmp_path / "optuna.db", isolation_level=None, timeout=0)
    writer.execute("BEGIN IMMEDIATE")  # another process in the middle of a write
    try:
        with pytest.raises(ConfigError, match=r"database is locked \(another sweep is writing"):
            study._open_study(sweeper(), tmp_path, ["minimize"], Objective.val_loss)
    finally:
        writer.execute("ROLLBACK")


def test_objective_harness_needs_tasks_maximizes_and_reads_the_named_score(tmp_path):
    import json

    from omegaconf import OmegaConf

    from fsdp_lab.launch import sweep

    config = OmegaConf.create(
        {"objective": "harness", "eval": {"harness_tasks": []}, "trainer": {"eval_every": 0}}
    )
    with pytest.raises(ConfigError, match=r"objective=harness needs eval\.harness_tasks"):
        study._checked_objective(config, ["maximize"])
    config.eval.harness_tasks = ["lab_facts_mc"]
    with pytest.raises(ConfigError, match=r"set hydra\.sweeper\.direction=maximize"):
        study._checked_objective(config, ["minimize"])
    assert study._checked_objective(config, ["maximize"]) is Objective.harness
    scores = {"lab_facts_mc/acc": 0.5, "lab_facts_mc/acc_norm": 0.75}
    (tmp_path / "run.json").write_text(json.dumps({"status": "completed", "harness": scores}))
    assert sweep.objective_value(tmp_path, Objective.harness, "lab_facts_mc/acc_norm") == 0.75
    assert sweep.objective_value(tmp_path, Objective.harness) == 0.5
