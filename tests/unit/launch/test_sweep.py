"""A sweep job's failure is recorded and the sweep goes on; a single run's failure exits."""

from __future__ import annotations

import pytest

from fsdp_lab.launch import run, sweep
from fsdp_lab.observe import rundir
from fsdp_lab.observe.record import RunRecord
from fsdp_lab.train import preempt


@pytest.fixture
def failing(monkeypatch):
    def fake(code, error):
        monkeypatch.setattr(run, "launch_job", lambda dict_cfg, **kw: (code, error))
        return sweep.SweepJobs()

    return fake


def test_a_refused_sweep_job_gets_a_run_json_and_the_sweep_goes_on(failing, tmp_path, capsys):
    jobs = failing(2, "sharding.replicate_size=3 does not divide the world size 4")
    job = {"overrides": ["sharding.replicate_size=3"], "num": 1}
    jobs.run_job({}, run_dir=tmp_path / "1", multirun=True, job=job)  # no SystemExit
    facts = rundir.read_run_file(tmp_path / "1")
    assert facts.status == "failed" and "does not divide" in facts.error
    assert "the sweep goes on" in capsys.readouterr().err
    assert jobs.exit_code() == 1
    assert (
        "sharding.replicate_size=3: sharding.replicate_size=3 does not" in capsys.readouterr().err
    )


def test_a_started_job_keeps_the_reason_its_launcher_wrote(failing, tmp_path):
    rundir.create_run_file(tmp_path, RunRecord(status="failed", error="rank 1 died (signal 9)"))
    jobs = failing(1, None)
    jobs.run_job({}, run_dir=tmp_path, multirun=True, job=None)
    assert [f"{tmp_path}: rank 1 died (signal 9)"] == jobs.failures


@pytest.mark.parametrize("code,multirun", [(2, False), (preempt.EXIT_CODE, True), (130, True)])
def test_a_single_run_a_preemption_or_ctrl_c_ends_it_all(failing, tmp_path, code, multirun):
    jobs = failing(code, None)
    with pytest.raises(SystemExit) as e:
        jobs.run_job({}, run_dir=tmp_path, multirun=multirun, job=None)
    assert e.value.code == code and jobs.exit_code() == 0


def test_a_study_s_failed_trials_are_listed_and_do_not_fail_the_command(failing, tmp_path, capsys):
    jobs = failing(1, None)
    rundir.create_run_file(tmp_path, RunRecord(status="failed", error="loss is nan at step 3"))
    jobs.run_job({}, run_dir=tmp_path, multirun=True, job=None, trial=True)
    assert jobs.exit_code() == 0
    assert "1 trial(s) of the study failed" in capsys.readouterr().err
