"""Runs and sweep jobs from train.py: what a failure ends.

A single run that fails exits non-zero at once. In a sweep (``-m``) a failed job is recorded in
its run.json with the reason and the sweep goes on; at the end train.py lists the failed jobs
and exits 1. A preemption signal or Ctrl-C still stops the whole sweep.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from fsdp_lab.config import Config, ConfigError, Objective
from fsdp_lab.launch import run, slurm
from fsdp_lab.observe import rundir
from fsdp_lab.observe.record import JobRecord, RunRecord
from fsdp_lab.train import preempt

# Hydra imports every installed sweeper at start; Optuna's imports alembic, which logs each of
# its plugins at INFO through Hydra's handler, a dozen lines before every run.
logging.getLogger("alembic").setLevel(logging.WARNING)


def job_info(hydra_cfg) -> dict:
    """What run.json, the trackers and reports say of a job (a ``JobRecord``'s dict): its
    command-line overrides, the chosen option of every config group, and in a sweep its multirun
    dir and number."""
    from hydra.types import RunMode

    groups = {f.name for f in dataclasses.fields(Config)}
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    return JobRecord(
        overrides=list(hydra_cfg.overrides.task),
        choices={k: v for k, v in hydra_cfg.runtime.choices.items() if k in groups},
        sweep_dir=str(Path(hydra_cfg.sweep.dir).resolve()) if multirun else None,
        num=hydra_cfg.job.num if multirun else None,
        # hydra/sweeper=study: the job's number is its Optuna trial's
        study=hydra_cfg.sweeper.get("study_name") if multirun and is_study(hydra_cfg) else None,
    ).to_dict()


def is_study(hydra_cfg) -> bool:
    """The sweeper is hydra/sweeper=study (``launch.study``): the jobs are its trials."""
    return str(hydra_cfg.sweeper.get("_target_", "")).endswith("StudySweeper")


@dataclass
class SweepJobs:
    """The jobs this process runs (one, or a local sweep's) and the command's exit code once
    they have all run. train.py owns one and runs each job through it; a job run elsewhere
    (hydra/launcher=slurm) is recorded where it runs, in its run.json."""

    # "<job overrides>: <reason>" of each failed sweep job, in the order they ran
    failures: list[str] = field(default_factory=list)
    # The jobs are trials of a study (hydra/sweeper=study). One that failed was told to Optuna
    # as failed, part of the search (a diverging learning rate is an answer): it does not fail
    # the command. (A study that stops early exits 2 itself, before exit_code.)
    trials: bool = False

    def run_job(
        self,
        dict_cfg: DictConfig,
        *,
        run_dir: Path,
        multirun: bool,
        job: dict | None = None,
        trial: bool = False,
    ) -> float | None:
        """Run one job; its objective (``objective=``, from its run.json) for a sweeper, None
        if the run failed or did not record it. ``trial``: the job is a study's trial."""
        self.trials = self.trials or trial
        code, config_error = run.launch_job(dict_cfg, run_dir=run_dir, multirun=multirun, job=job)
        if code == 0:
            metric = OmegaConf.select(dict_cfg, "eval.objective_metric")
            return objective_value(run_dir, objective_of(dict_cfg), metric)
        if not multirun or code in (preempt.EXIT_CODE, 130):
            sys.exit(code)
        name = " ".join(JobRecord.from_dict(job).overrides) if job else str(run_dir)
        self.failures.append(f"{name}: {_record_failure(run_dir, code, config_error, job)}")
        print(
            f"fsdp_lab: sweep job {name} failed (exit {code}); the sweep goes on", file=sys.stderr
        )
        return None

    def exit_code(self) -> int:
        """After all jobs: list the failed ones; 1 if any failed (outside a study)."""
        if self.failures:
            what = (
                "trial(s) of the study failed (recorded as failed)"
                if self.trials
                else "sweep job(s) failed"
            )
            print(f"fsdp_lab: {len(self.failures)} {what}:", file=sys.stderr)
            for line in self.failures:
                print(f"  {line}", file=sys.stderr)
        return 1 if self.failures and not self.trials else 0


def objective_of(config: DictConfig) -> Objective:
    """A composed config's ``objective`` (an enum once typed, a name in a sweeper's copy)."""
    value = config.get("objective", Objective.val_loss)
    name = getattr(value, "name", str(value))
    try:
        return Objective[name]
    except KeyError:
        raise ConfigError(
            f"objective={name}: use one of {', '.join(o.name for o in Objective)}"
        ) from None


def objective_value(run_dir: Path, objective: Objective, metric: str | None = None) -> float | None:
    """The run's result that ``objective`` names (run.json's), None if it recorded none;
    objective=harness: the score ``metric`` (eval.objective_metric) names."""
    results = rundir.read_run_file(run_dir).results
    return results.objective(objective, metric) if results is not None else None


def _record_failure(run_dir: Path, code: int, config_error: str | None, job: dict | None) -> str:
    """The failed job's reason. A run that started has it in its run.json already (the launcher
    wrote it); a config error is written to a new run.json, never over another run's."""
    if config_error is None:
        return rundir.read_run_file(run_dir).error or f"exit {code}"
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.create_run_file(run_dir, RunRecord(status="failed", job=job, error=config_error))
    return config_error


class LauncherChecks(Callback):
    """Before any job of a ``-m`` sweep: the checks a launcher needs, one line and exit 2 before
    anything is submitted. (The sweep's report comes from ``tools.report.SweepReport``, the
    other callback conf/config.yaml names.)"""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:

        if "submitit" not in str(config.hydra.launcher.get("_target_", "")):
            return
        try:
            h = config.hardware
            slurm.check_launcher(h.kind, h.nproc_per_node, h.partition)
        except ConfigError as e:
            print(f"fsdp_lab: error: {e}", file=sys.stderr)
            sys.exit(2)
