"""A study's storage (SQLite, or a journal file that several sweep processes share): one that
holds something else is refused in one line and left as it was; a stopped study continues;
a trial is taken over only from a process that is gone; a grid study's order is its seed's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import optuna
import pytest
from conftest import ROOT
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf
from optuna.trial import TrialState

from fsdp_lab.config import ConfigError, Objective
from fsdp_lab.launch import search_space, study, study_storage
from fsdp_lab.launch.study_settings import StudySweeperConf
from fsdp_lab.launch.study_sweeper import StudySweeper


def settings(**changes) -> StudySweeperConf:
    """conf/hydra/sweeper/study.yaml's settings, with changes."""
    values = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/hydra/sweeper/study.yaml"))
    values.pop("defaults")
    return StudySweeperConf(**{**values, "study_name": "s", **changes})


def config(sweep_dir, **changes):
    base = {"hydra": {"sweep": {"dir": str(sweep_dir)}}, "seed": 0, "objective": "val_loss"}
    return OmegaConf.create({**base, "trainer": {"eval_every": 1}, **changes})


STORAGES = ["sqlite", "journal"]
FILES = {"sqlite": "optuna.db", "journal": "optuna.journal"}


@pytest.mark.parametrize("storage", STORAGES)
def test_a_file_that_is_not_a_study_is_refused_and_kept(tmp_path, storage):
    (tmp_path / FILES[storage]).write_text("not a study")
    with pytest.raises(ConfigError, match=r"cannot be opened as an Optuna study.*move that file"):
        study_storage.open_study(settings(storage=storage), tmp_path, Objective.val_loss)
    assert (tmp_path / FILES[storage]).read_text() == "not a study"


def test_a_study_an_older_optuna_wrote_names_the_upgrade_and_is_kept(tmp_path):
    """The study file of fsdp_lab's Optuna 2.10 days: its schema marked as 2.10.1's (Optuna's
    own upgrade of a real 2.10 file kept its trials and objective)."""
    import sqlite3

    study_storage.open_study(settings(), tmp_path, Objective.val_loss)
    db = tmp_path / "optuna.db"
    with sqlite3.connect(db) as con:
        con.execute("UPDATE alembic_version SET version_num = 'v2.6.0.a'")
        con.execute("UPDATE version_info SET library_version = '2.10.1'")
    before = db.read_bytes()
    url = f"sqlite:///{db}"
    with pytest.raises(ConfigError) as e:
        study_storage.open_study(settings(), tmp_path, Objective.val_loss)
    assert str(e.value) == (
        f"hydra.sweeper.storage={url} was written by optuna 2.10.1: upgrade it in place, keeping "
        f"its trials, with `optuna storage upgrade --storage {url}` (copy the file first if that "
        "Optuna must read it again), then rerun"
    )
    assert db.read_bytes() == before


@pytest.mark.parametrize("storage", STORAGES)
def test_a_study_continues_only_with_its_objective_and_direction(tmp_path, storage):
    made = study_storage.open_study(settings(storage=storage), tmp_path, Objective.val_loss)
    made.tell(made.ask(), 1.0)  # something to keep
    again = study_storage.open_study(settings(storage=storage), tmp_path, Objective.val_loss)
    assert len(again.get_trials()) == 1
    with pytest.raises(ConfigError, match="made for objective=val_loss, not best_val_loss"):
        study_storage.open_study(settings(storage=storage), tmp_path, Objective.best_val_loss)
    maximize = settings(storage=storage, direction="maximize")
    with pytest.raises(ConfigError, match=r"made for another direction \(minimize, not maximize"):
        study_storage.open_study(maximize, tmp_path, Objective.tokens_per_s)
    kept = study_storage.open_study(settings(storage=storage), tmp_path, Objective.val_loss)
    assert len(kept.get_trials()) == 1 and kept.user_attrs["objective"] == "val_loss"


def test_the_storage_setting_names_a_file_in_the_sweep_dir_or_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep_dir = tmp_path / "sweep"
    assert (
        study_storage.storage_of("sqlite", sweep_dir) == (f"sqlite:///{sweep_dir}/optuna.db",) * 2
    )
    assert (
        study_storage.storage_of("sqlite:///rel.db", sweep_dir)[1] == f"sqlite:///{tmp_path}/rel.db"
    )
    url = "postgresql://u@host/db"
    assert study_storage.storage_of(url, sweep_dir) == (url, url)
    journal, where = study_storage.storage_of("journal", sweep_dir)
    assert isinstance(journal, optuna.storages.JournalStorage)
    assert where == f"journal://{sweep_dir}/optuna.journal"
    assert study_storage.storage_of("journal://shared/lr.journal", sweep_dir)[1] == (
        f"journal://{tmp_path}/shared/lr.journal"
    )
    for bad in ("journl", "journal://"):
        with pytest.raises(ConfigError, match=f"storage={bad}: use sqlite .* journal://PATH"):
            study_storage.storage_of(bad, sweep_dir)


def test_a_study_another_sweep_is_writing_is_refused_as_such(tmp_path):
    import sqlite3

    study_storage.open_study(settings(), tmp_path, Objective.val_loss)
    writer = sqlite3.connect(tmp_path / "optuna.db", isolation_level=None, timeout=0)
    writer.execute("BEGIN IMMEDIATE")  # another process in the middle of a write
    try:
        with pytest.raises(ConfigError, match=r"database is locked \(another sweep is writing"):
            study_storage.open_study(settings(), tmp_path, Objective.val_loss)
    finally:
        writer.execute("ROLLBACK")


def test_objective_harness_needs_tasks_maximizes_and_reads_the_named_score(tmp_path):
    from fsdp_lab.launch import sweep

    config = OmegaConf.create(
        {"objective": "harness", "eval": {"harness_tasks": []}, "trainer": {"eval_every": 0}}
    )
    with pytest.raises(ConfigError, match=r"objective=harness needs eval\.harness_tasks"):
        search_space.checked_objective(config, "maximize")
    config.eval.harness_tasks = ["lab_facts_mc"]
    with pytest.raises(ConfigError, match=r"set hydra\.sweeper\.direction=maximize"):
        search_space.checked_objective(config, "minimize")
    assert search_space.checked_objective(config, "maximize") is Objective.harness
    scores = {"lab_facts_mc/acc": 0.5, "lab_facts_mc/acc_norm": 0.75}
    (tmp_path / "run.json").write_text(json.dumps({"status": "completed", "harness": scores}))
    assert sweep.objective_value(tmp_path, Objective.harness, "lab_facts_mc/acc_norm") == 0.75
    assert sweep.objective_value(tmp_path, Objective.harness) == 0.5


def test_a_grid_study_runs_its_points_in_the_same_order_for_the_same_seed():
    space = search_space.parse_space({"x": "range(6)"}, [])

    def order(seed: int) -> list[int]:
        sampling = search_space.Sampling("grid", {}, seed, space)
        s = optuna.create_study(sampler=sampling.sampler())
        worker = study.Worker(s)
        points = []
        for _ in range(6):
            trial = study._ask(s, worker, sampling)
            points.append(search_space.suggest(trial, space)["x"])
            study._tell(s, trial, values=0.0)
        return points

    first = order(0)
    assert sorted(first) == list(range(6))
    assert order(0) == first
    assert order(1) != first or order(2) != first  # 1 in 720 alike, twice


def run(settings, sweep_dir, launch, arguments):
    study.run_study(settings, config=config(sweep_dir), launch=launch, arguments=arguments)


class Interrupt(Exception):
    """What Ctrl-C or a killed process leaves: a trial running, the study stopped."""


def fake_launch(ran: list, stop_at: int | None = None):
    """Jobs that return their trial's number as the objective; the job of trial ``stop_at``
    stops the study in its middle."""

    def launch(numbers, overrides):
        if stop_at in numbers:
            raise Interrupt
        ran.extend(zip(numbers, overrides, strict=True))
        return [JobReturn(status=JobStatus.COMPLETED, _return_value=float(n)) for n in numbers]

    return launch


@pytest.mark.parametrize("sampler,space", [("tpe", "interval(0,1)"), ("grid", "choice(1,2,3)")])
def test_a_stopped_study_continues_with_the_interrupted_trial_first(tmp_path, sampler, space):
    s = settings(sampler=sampler, n_trials=3, params={"x": space})
    ran = []
    with pytest.raises(Interrupt):
        run(s, tmp_path, fake_launch(ran, stop_at=1), ["trainer.max_steps=2"])
    run(s, tmp_path, fake_launch(ran), ["trainer.max_steps=2"])
    record = json.loads((tmp_path / "study.json").read_text())
    trials = {t["number"]: t for t in record["trials"]}
    assert sorted(trials) == [0, 1, 2, 3]  # 1 interrupted, its rerun 2, then 3
    assert trials[1]["state"] == "FAIL" and trials[1]["error"] == study.INTERRUPTED
    assert trials[2]["params"] == trials[1]["params"]
    assert [n for n, _ in ran] == [0, 2, 3]
    assert all(o[-1] == "trainer.max_steps=2" for _, o in ran)
    if sampler == "grid":  # each point once
        assert sorted(trials[n]["params"]["x"] for n in (0, 2, 3)) == [1, 2, 3]
    assert record["best"]["trial"] == 0
    assert OmegaConf.load(tmp_path / study.RESULTS_FILE).best_value == 0.0


def test_a_trial_draws_the_same_values_alone_or_in_a_batch(tmp_path):
    """Each trial's values come from (seed, its number), however many are asked at once: a
    study is reproducible, and a batch's trials do not share one random stream."""

    def values(n_jobs: int) -> list[float]:
        s = settings(sampler="random", n_trials=4, n_jobs=n_jobs, params={"x": "interval(0,1)"})
        run(s, tmp_path / str(n_jobs), fake_launch([]), [])
        trials = json.loads((tmp_path / str(n_jobs) / "study.json").read_text())["trials"]
        return [t["params"]["x"] for t in trials]

    alone = values(1)
    assert values(2) == alone and len(set(alone)) == 4


def test_a_trial_is_taken_over_only_from_a_process_that_is_gone(tmp_path):
    s = study_storage.open_study(settings(), tmp_path, Objective.val_loss)
    me = study.Worker(s)
    host = me.id.split(":")[0]
    dead_pid = int(subprocess.check_output([sys.executable, "-c", "import os; print(os.getpid())"]))
    now = time.time()
    owners = {
        f"{host}:{os.getppid()}:a": now,  # alive, this host
        f"{host}:{dead_pid}:b": now,  # dead, this host
        f"{host}:{os.getpid()}:c": now,  # this pid, another token: an earlier run of it
        "elsewhere:1:d": now,  # another host, beating
        "elsewhere:2:e": now - study.STALE_AFTER_S - 1,  # another host, silent
    }
    beats = {f"heartbeat:{w}": t for w, t in owners.items()}
    gone = {}
    for owner in owners:
        trial = s.ask()
        trial.set_user_attr("worker", owner)
        gone[owner[-1]] = me.is_gone(s.trials[-1], beats)
    assert gone == {"a": False, "b": True, "c": True, "d": False, "e": True}
    s.ask()
    assert not me.is_gone(s.trials[-1], beats)  # just asked: its process claims it next


def test_trials_numbered_apart_are_launched_apart():
    calls = []
    sweeper = StudySweeper.__new__(StudySweeper)
    sweeper.launcher = SimpleNamespace(
        launch=lambda jobs, initial_job_idx: calls.append((initial_job_idx, jobs)) or jobs
    )
    assert sweeper.launch([4, 5, 7], [["a"], ["b"], ["c"]]) == [["a"], ["b"], ["c"]]
    assert calls == [(4, [["a"], ["b"]]), (7, [["c"]])]  # Hydra numbers jobs from the first


WORKER = """
import json, os, sys, time
from pathlib import Path
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf
from fsdp_lab.launch.study_settings import StudySweeperConf
from fsdp_lab.launch import study

sweep_dir, marks = Path(sys.argv[1]), Path(sys.argv[2])
config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}, "seed": 0,
                           "objective": "val_loss", "trainer": {"eval_every": 1}})

def launch(numbers, overrides):
    (marks / f"started-{os.getpid()}").touch()
    deadline = time.monotonic() + 60  # the first trial waits for the other process's
    while len(list(marks.glob("started-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    with open(marks / f"ran-{os.getpid()}", "a") as f:
        f.write(json.dumps(list(numbers)) + "\\n")
    return [JobReturn(status=JobStatus.COMPLETED, _return_value=float(n)) for n in numbers]

settings = StudySweeperConf(**json.loads(sys.argv[3]))
study.run_study(settings, config=config, launch=launch, arguments=[])
"""


def test_two_sweep_processes_share_one_journal_study(tmp_path):
    """Two processes at once on one journal file: each takes the study's next trial (numbers
    apart), neither takes over the other's running trial, n_trials counts both."""
    sweep_dir, marks = tmp_path / "sweep", tmp_path / "marks"
    marks.mkdir()
    s = settings(storage="journal", n_trials=5, params={"x": "interval(0,1)"})
    args = [sys.executable, "-c", WORKER, str(sweep_dir), str(marks), json.dumps(vars(s))]
    procs = [subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-2000:]
    ran = {
        int(f.name.split("-")[1]): [
            n for line in f.read_text().splitlines() for n in json.loads(line)
        ]
        for f in marks.glob("ran-*")
    }
    assert set(ran) == {p.pid for p in procs}  # both ran trials
    assert sorted(ran[procs[0].pid] + ran[procs[1].pid]) == [0, 1, 2, 3, 4]
    storage, _ = study_storage.storage_of("journal", sweep_dir)
    shared = optuna.load_study(study_name="s", storage=storage)
    assert [t.state for t in shared.trials] == [TrialState.COMPLETE] * 5
    owners = {t.number: int(t.user_attrs["worker"].split(":")[1]) for t in shared.trials}
    assert {n: pid for pid, ns in ran.items() for n in ns} == owners


def test_hydra_instantiates_the_sweeper_its_settings_name():
    # Hydra instantiates plugins defined under hydra_plugins only, by their own module's name:
    # the shim there subclasses launch.study_sweeper's, and the settings' _target_ names it.
    from hydra.core.plugins import Plugins

    target = StudySweeperConf.__dataclass_fields__["_target_"].default
    plugins = Plugins.instance()
    assert plugins.is_in_toplevel_plugins_module(target)
    assert issubclass(plugins.class_name_to_class[target], StudySweeper)
