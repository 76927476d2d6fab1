"""``hydra/sweeper=study``: an Optuna search through Hydra that can be stopped and continued.

    python train.py hparams_search=lr                                   # conf/hparams_search/
    python train.py hparams_search=lr hydra.sweep.dir=multirun/lr-1     # again: it continues
    python train.py hparams_search=lr hydra.sweeper.storage=journal hydra/launcher=slurm

fsdp_lab's own sweeper on current Optuna; what it searches, towards what and how it samples
is ``launch.search_space`` (hydra-optuna-sweeper's syntax), its settings study.yaml's.

- The study lives in the sweep dir (``optuna.db``; ``storage=journal``: ``optuna.journal``, for
  sweep processes on several nodes). Rerun with the same ``hydra.sweep.dir`` and it continues:
  finished trials count towards ``n_trials``; a trial left running when the study stopped is
  failed as "interrupted" and its parameters run again first.
- Sweep processes may share one study at once: each asks its next trial, ``n_trials`` counts
  all of theirs, and a trial a live process runs is left to it (``Worker``).
- Job dirs are numbered by Optuna's trial number, so no trial's dir is another's.
- A failed trial (refused, diverged, crashed) is told to Optuna as failed, with its run's
  one-line reason; the study goes on until a batch fails more often than ``max_failure_rate``.
- ``study.json`` in the sweep dir after every batch (each trial's number, state, value,
  parameters and reason; the best), ``optimization_results.yaml`` at the end.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING
from uuid import uuid4

import optuna
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import DictConfig, OmegaConf
from optuna.trial import TrialState

from fsdp_lab.config import ConfigError, Objective
from fsdp_lab.launch import search_space
from fsdp_lab.launch.study_storage import open_study
from fsdp_lab.observe import rundir
from fsdp_lab.observe.record import RunRecord, objective_result

if TYPE_CHECKING:
    from fsdp_lab.launch.study_settings import StudySweeperConf

log = logging.getLogger(__name__)
# (trial numbers, their overrides) -> the jobs' returns: launch.study_sweeper's StudySweeper.launch.
Launch = Callable[[Sequence[int], list[list[str]]], list[JobReturn]]

RESULTS_FILE = "optimization_results.yaml"  # what hydra-optuna-sweeper wrote, for its readers
INTERRUPTED = "interrupted: the study stopped while this trial ran; its parameters ran again"
HEARTBEAT_S = 60  # how often a sweep process tells the study it is alive
STALE_AFTER_S = 600  # a process silent this long (other hosts: their clocks may differ) is gone
UNCLAIMED_AFTER_S = 60  # a trial asked but never claimed (killed in between) after this long


def run_study(
    settings: StudySweeperConf, *, config: DictConfig, launch: Launch, arguments: list[str]
) -> None:
    """The study's life: check, open, recover, batches (``launch``: jobs by trial), summary."""
    sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
    objective = search_space.checked_objective(config, settings.direction)
    search_space.check_counts(settings.n_jobs, settings.max_failure_rate)
    space = search_space.parse_space(settings.params, arguments)
    seed = int(config.seed if settings.seed is None else settings.seed)
    sampling = search_space.Sampling(settings.sampler, settings.sampler_options, seed, space)
    n_trials = sampling.num_trials(settings.n_trials)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    study = open_study(settings, sweep_dir, objective)
    study.sampler = sampling.sampler()
    worker = Worker.start(study)
    try:
        reruns = recover_interrupted(study, worker, set(space.distributions))
        counted, running = _counts(study)
        if counted or reruns:
            log.info(
                f"study {study.study_name} in {sweep_dir}: {counted - running} trial(s) ran, "
                f"{running} running, {len(reruns)} interrupted (to run again); "
                f"{max(n_trials - counted, 0)} to go"
            )
        while (size := min(settings.n_jobs, n_trials - _counts(study)[0])) > 0:
            trials = [_ask(study, worker, sampling) for _ in range(size)]
            failed = _run_batch(study, trials, space, launch, sweep_dir, objective)
            if failed / size > settings.max_failure_rate:
                raise ConfigError(
                    f"{failed} of {size} trial(s) failed, over hydra.sweeper.max_failure_rate="
                    f"{settings.max_failure_rate}; the study stops (it continues from here when "
                    "rerun with the same hydra.sweep.dir)"
                )
    finally:
        worker.stopped.set()
    write_study_file(study, sweep_dir, objective)
    _summarize(study, sweep_dir, objective)


def _run_batch(study, trials, space, launch: Launch, sweep_dir: Path, objective) -> int:
    """Launch the trials as jobs, tell Optuna how each ended, study.json; how many failed."""
    for trial in trials:
        _check_job_dir_free(sweep_dir, trial.number)
    overrides = [space.overrides(trial.params) for trial in trials]  # in the space's order
    returns = launch([t.number for t in trials], overrides)
    failed = sum(
        not tell(study, trial, ret, objective) for trial, ret in zip(trials, returns, strict=True)
    )
    write_study_file(study, sweep_dir, objective)
    return failed


@dataclass
class Worker:
    """This sweep process as the study's other processes see it: ``host:pid:token`` on each
    trial it runs (user attr ``worker``), and a heartbeat (study user attr ``heartbeat:ID``,
    the time) every HEARTBEAT_S from a thread. Another process takes over a trial only once its
    worker is gone (``is_gone``), never one a live process is running."""

    study: optuna.Study
    id: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:{uuid4()}")
    stopped: threading.Event = field(default_factory=threading.Event)

    @classmethod
    def start(cls, study: optuna.Study) -> Worker:
        worker = cls(study)
        worker.beat()
        threading.Thread(target=worker._beat_until_stopped, daemon=True).start()
        return worker

    def beat(self) -> None:
        self.study.set_user_attr(f"heartbeat:{self.id}", time.time())

    def _beat_until_stopped(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            try:
                self.beat()
            except Exception as e:  # noqa: BLE001 (a missed beat is retried; the sweep goes on)
                log.warning("study heartbeat not recorded: %s", e)

    def is_gone(self, trial: optuna.trial.FrozenTrial, beats: Mapping[str, object]) -> bool:
        """Whether the process that runs ``trial`` is gone: silent for STALE_AFTER_S, dead on
        this host (or its pid now this process's), or it never claimed the trial."""
        owner = trial.user_attrs.get("worker")
        if owner is None:
            started = trial.datetime_start or datetime.now()
            return (datetime.now(started.tzinfo) - started).total_seconds() > UNCLAIMED_AFTER_S
        if owner == self.id:
            return False
        if time.time() - float(beats.get(f"heartbeat:{owner}", 0.0)) > STALE_AFTER_S:
            return True
        host, pid, _ = owner.rsplit(":", 2)
        return host == socket.gethostname() and (int(pid) == os.getpid() or not _alive(int(pid)))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: another user's, alive
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def recover_interrupted(study: optuna.Study, worker: Worker, searched: set[str]) -> list[int]:
    """Trials left running by a process that is gone (Ctrl-C, a killed process, a preempted
    allocation): failed, their parameters queued to run first. Their numbers."""
    beats = study.user_attrs
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    stale = [t for t in running if worker.is_gone(t, beats)]
    for t in stale:
        study._storage.set_trial_user_attr(t._trial_id, "error", INTERRUPTED)
        _tell(study, t.number, state=TrialState.FAIL)
        if searched <= set(t.params):  # launched: its point runs again first
            # as enqueue_trial does, keeping sampler=grid's point (GridSampler.after_trial needs it)
            attrs = {k: v for k, v in t.system_attrs.items() if k in ("grid_id", "search_space")}
            attrs["fixed_params"] = t.params
            study.add_trial(optuna.trial.create_trial(state=TrialState.WAITING, system_attrs=attrs))
    return [t.number for t in stale]


def _counts(study: optuna.Study) -> tuple[int, int]:
    """(trials that count towards n_trials, of them running): finished but not interrupted
    (its rerun counts), and running (here, or in another live process)."""
    trials = study.get_trials(deepcopy=False)
    running = sum(t.state is TrialState.RUNNING for t in trials)
    done = sum(t.state.is_finished() and t.user_attrs.get("error") != INTERRUPTED for t in trials)
    return done + running, running


def _ask(study: optuna.Study, worker: Worker, sampling: search_space.Sampling) -> optuna.Trial:
    """The study's next trial (a queued rerun first), claimed by this process, its values
    drawn at once by a sampler seeded for its number (``Sampling.draw``)."""
    trial = study.ask()
    trial.set_user_attr("worker", worker.id)
    sampling.draw(study, trial)
    return trial


def _check_job_dir_free(sweep_dir: Path, number: int) -> None:
    job_dir = sweep_dir / str(number)
    if (job_dir / rundir.RUN_FILE).exists():
        raise ConfigError(
            f"{job_dir} holds a run but the study in {sweep_dir} has no trial {number} before "
            "it (optuna.db replaced or deleted?): continue with the study that made these "
            "dirs, or start a new search with another hydra.sweep.dir"
        )


def tell(study: optuna.Study, trial: optuna.Trial, ret: JobReturn, objective: Objective) -> bool:
    """Tell Optuna how a trial's run ended: its objective, or failed with the run's reason."""
    value, error = None, None
    if ret.status is JobStatus.COMPLETED:
        value = ret.return_value
    else:
        error = f"{type(ret._return_value).__name__}: {ret._return_value}"
    if value is None and error is None:
        cfg = ret.hydra_cfg
        job_dir = Path(str(cfg.hydra.runtime.output_dir)) if cfg is not None else None
        run = rundir.read_run_file(job_dir) if job_dir else RunRecord()
        error = run.error or (
            f"the run recorded no {objective_result(objective)} (validation needs "
            "trainer.eval_every > 0)"
            if run.status == "completed"
            else f"run status {run.status or 'unknown'}"
        )
    if error is not None:
        trial.set_user_attr("error", error[:500])
        _tell(study, trial, state=TrialState.FAIL)
        log.warning("trial %d failed: %s", trial.number, error)
        return False
    _tell(study, trial, values=float(value))
    return True


def _tell(study: optuna.Study, trial: optuna.Trial | int, **outcome) -> None:
    """study.tell; GridSampler calls study.stop() after the grid's last point, which raises
    outside study.optimize once the trial is already recorded: the loop ends anyway."""
    try:
        study.tell(trial, **outcome)
    except RuntimeError as e:
        if "Study.stop" not in str(e):
            raise


def study_record(study: optuna.Study, objective: Objective) -> dict:
    """study.json's content: the objective, the best trial, and every trial."""
    trials = study.get_trials(deepcopy=False)
    b = study.best_trial if any(t.state is TrialState.COMPLETE for t in trials) else None
    best = b and {"trial": b.number, "value": b.value, "params": b.params}
    return {
        "study_name": study.study_name,
        "objective": objective.name,
        "direction": search_space.DIRECTION[objective],
        "best": best,
        "trials": [
            {
                "number": t.number,
                "state": t.state.name,
                "value": t.value,
                "params": t.params,
                "error": t.user_attrs.get("error"),
            }
            for t in trials
        ],
    }


def write_study_file(study: optuna.Study, sweep_dir: Path, objective: Objective) -> None:
    rundir.write_json(sweep_dir / rundir.STUDY_FILE, study_record(study, objective))


def _summarize(study: optuna.Study, sweep_dir: Path, objective: Objective) -> None:
    record = study_record(study, objective)
    states = [t["state"] for t in record["trials"]]
    best, failed, running = record["best"], states.count("FAIL"), states.count("RUNNING")
    line = f"fsdp_lab: study {study.study_name}: {len(states)} trials, {failed} failed"
    if running:
        line += f", {running} running in other processes"
    if best is None and running:
        print(f"{line}; none completed yet", file=sys.stderr)
        return
    if best is None:
        raise ConfigError(
            f"no trial of study {study.study_name} completed ({failed} failed; see "
            f"{sweep_dir / rundir.STUDY_FILE})"
        )
    OmegaConf.save(
        OmegaConf.create(
            {"name": "optuna", "best_params": best["params"], "best_value": best["value"]}
        ),
        sweep_dir / RESULTS_FILE,
    )
    params = " ".join(f"{k}={v}" for k, v in best["params"].items())
    print(
        f"{line}; best {objective.name} {best['value']:.6g} (trial {best['trial']}: {params})",
        file=sys.stderr,
    )
