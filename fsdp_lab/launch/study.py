"""``hydra/sweeper=study``: an Optuna search through Hydra that can be stopped and continued.

    python train.py hparams_search=lr                                   # conf/hparams_search/
    python train.py hparams_search=lr hydra.sweep.dir=multirun/lr-1     # again: it continues

It is Hydra's Optuna sweeper (hydra-optuna-sweeper, the ``optuna`` extra: search-space syntax,
samplers and ``hydra.sweeper.params`` are its own) with what a search of training runs needs:

- The study lives in the sweep dir (``optuna.db``, SQLite). Rerun with the same
  ``hydra.sweep.dir`` and it continues: finished trials count towards ``n_trials``; a trial that
  was running when the study stopped is recorded as failed ("interrupted") and its parameters
  are tried again first. The stock sweeper would run ``n_trials`` more and number the jobs from
  0 again, over the earlier trials' run dirs.
- Job dirs are numbered by Optuna's trial number, so no trial's dir is another's.
- A trial that fails (refused before launch, diverged, crashed) is told to Optuna as failed, with
  its run's one-line reason, and the study goes on. ``max_failure_rate`` (1.0 here, 0.0 in the
  stock sweeper) stops the study when a batch fails more often than that.
- The objective is ``objective`` (val_loss, best_val_loss, tokens_per_s), read from each run's
  run.json; a direction that contradicts it is refused.
- ``study.json`` in the sweep dir, after every batch: every trial's number, state, value,
  parameters and reason, and the best one (``fsdp-lab report`` reads it).
"""

from __future__ import annotations

import functools
import logging
import math
import random
import sys
import warnings
from pathlib import Path

import numpy as np
import optuna
from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_optuna_sweeper._impl import (
    OptunaSweeperImpl,
    create_params_from_overrides,
)
from omegaconf import OmegaConf
from optuna.trial import TrialState

from fsdp_lab.config import ConfigError, Objective
from fsdp_lab.launch import sweep
from fsdp_lab.observe import rundir
from fsdp_lab.observe.record import RunRecord, objective_result

log = logging.getLogger(__name__)

RESULTS_FILE = "optimization_results.yaml"  # what the stock sweeper writes, for its readers
INTERRUPTED = "interrupted: the study stopped while this trial ran; its parameters ran again"
DIRECTION = {
    Objective.val_loss: "minimize",
    Objective.best_val_loss: "minimize",
    Objective.tokens_per_s: "maximize",
    Objective.harness: "maximize",  # accuracy, exact match
}


class StudySweeper(OptunaSweeperImpl):
    """The stock sweeper's configuration and parsing; its own loop (see the module doc)."""

    def sweep(self, arguments: list[str]) -> None:
        try:
            self._sweep(arguments)
        except ConfigError as e:
            print(f"fsdp_lab: error: {e}", file=sys.stderr)
            sys.exit(2)

    # The study's life in order: check, load or create, recover, batches, summary.
    def _sweep(self, arguments: list[str]) -> None:
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        directions = self._get_directions()
        objective = _checked_objective(self.config, directions)
        distributions, fixed = self._search_space(arguments)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        study = _open_study(self, sweep_dir, directions, objective)
        reruns = recover_interrupted(study)
        seed = self.config.hydra.sweeper.sampler.get("seed")
        seed = self.config.seed if seed is None else seed
        _seed_sampler(self.sampler, seed, study)
        ran = [
            t
            for t in study.get_trials(deepcopy=False)
            if t.state.is_finished() and t.user_attrs.get("error") != INTERRUPTED
        ]
        to_go = self.n_trials - len(ran)
        if ran or reruns:
            log.info(
                "study %s in %s: %d trial(s) ran, %d interrupted (to run again); %d to go",
                study.study_name,
                sweep_dir,
                len(ran),
                len(reruns),
                max(to_go, 0),
            )
        while to_go > 0:
            trials = [_ask(study, seed) for _ in range(min(self.n_jobs, to_go))]
            for trial in trials:
                _regrid(study, trial, reruns)
                _check_job_dir_free(sweep_dir, trial.number)
            overrides = self._configure_trials(trials, distributions, fixed)
            returns = self.launcher.launch(overrides, initial_job_idx=trials[0].number)
            failed = sum(
                not tell(study, trial, ret, objective)
                for trial, ret in zip(trials, returns, strict=True)
            )
            write_study_file(study, sweep_dir, objective)
            if failed / len(trials) > self.max_failure_rate:
                raise ConfigError(
                    f"{failed} of {len(trials)} trial(s) failed, over "
                    f"hydra.sweeper.max_failure_rate={self.max_failure_rate}; the study stops "
                    "(it continues from here when rerun with the same hydra.sweep.dir)"
                )
            to_go -= len(trials)
        write_study_file(study, sweep_dir, objective)
        _summarize(study, sweep_dir, objective)

    def _search_space(self, arguments: list[str]) -> tuple[dict, dict]:
        """(Optuna distributions, fixed overrides) from hydra.sweeper.params and the command
        line, parsed by the stock sweeper; sampler=grid is built from them here."""
        self._process_searchspace_config()
        distributions, fixed = create_params_from_overrides(
            [*self._parse_sweeper_params_config(), *arguments]
        )
        if self.search_space_distributions:
            distributions = {**self.search_space_distributions, **distributions}
        if isinstance(self.sampler, functools.partial):  # sampler=grid: built from the space
            grid = {k: self._to_grid_sampler_choices(d) for k, d in distributions.items()}
            self.sampler = self.sampler(grid)
            self.n_trials = min(self.n_trials, math.prod(len(v) for v in grid.values()))
        for name in fixed:
            distributions.pop(name, None)
        if not distributions:
            raise ConfigError(
                "the study has nothing to search: give hydra.sweeper.params (see "
                "conf/hparams_search/) or a range on the command line, e.g. "
                "'optim.lr=interval(1e-4,1e-2)'"
            )
        return distributions, fixed


def _checked_objective(config, directions: list[str]) -> Objective:
    """``objective=``, refused where the search could not read it or would go the wrong way."""
    objective = sweep.objective_of(config)
    if objective is Objective.harness:
        tasks, metric = list(config.eval.harness_tasks), config.eval.get("objective_metric")
        if not tasks:
            raise ConfigError(
                "objective=harness needs eval.harness_tasks (the scores it reads); set "
                "eval.harness_tasks=[task] and eval.objective_metric=task/metric"
            )
        if metric is not None and metric.split("/")[0] not in tasks:
            raise ConfigError(
                f"eval.objective_metric={metric} names no task of eval.harness_tasks={tasks}; "
                f"give it as task/metric, e.g. {tasks[0]}/acc"
            )
    if objective in (Objective.val_loss, Objective.best_val_loss) and not config.trainer.eval_every:
        raise ConfigError(
            f"objective={objective.name} needs validation but trainer.eval_every=0: set "
            "trainer.eval_every (validation also runs after the last step) or "
            "objective=tokens_per_s"
        )
    if directions != [DIRECTION[objective]]:
        raise ConfigError(
            f"hydra.sweeper.direction={','.join(directions)} but objective="
            f"{objective.name} is to {DIRECTION[objective]}: set "
            f"hydra.sweeper.direction={DIRECTION[objective]}"
        )
    return objective


def _storage(storage, sweep_dir: Path):
    """The storage URL; a relative SQLite path is taken from the working dir at launch, made
    absolute so that the jobs (and SLURM's) find the same file."""
    if storage is None:
        return f"sqlite:///{sweep_dir / 'optuna.db'}"
    text = str(storage)
    prefix = "sqlite:///"
    if text.startswith(prefix) and not text.startswith(prefix + "/"):
        return prefix + str(Path(text[len(prefix) :]).resolve())
    return storage


def _open_study(
    sweeper: StudySweeper, sweep_dir: Path, directions: list[str], objective: Objective
) -> optuna.Study:
    """The study in its storage: created, or loaded to continue. Refused, and left as it is:
    one that cannot be read (not a database, a newer Optuna's), one in use or read-only, and
    one made for another objective or direction (its values would not compare with the new)."""
    import sqlalchemy.exc

    url = _storage(sweeper.storage, sweep_dir)
    try:
        study = optuna.create_study(
            study_name=sweeper.study_name,
            storage=url,
            sampler=sweeper.sampler,
            directions=directions,
            load_if_exists=True,
        )
        made_for = study.user_attrs.get("objective")
        if made_for is None:
            study.set_user_attr("objective", objective.value)
    except ValueError as e:  # "Cannot overwrite study direction from [...] to [...]"
        raise ConfigError(
            _another_study(url, sweeper.study_name, f"another direction ({e})")
        ) from None
    except (
        sqlalchemy.exc.SQLAlchemyError,
        optuna.exceptions.StorageInternalError,  # a failed write: its cause is SQLAlchemy's
        RuntimeError,
    ) as e:
        cause = e.__cause__ if isinstance(e, optuna.exceptions.StorageInternalError) else e
        reason = (str(getattr(cause, "orig", None) or cause).splitlines() or [repr(cause)])[0]
        if "locked" in reason:
            raise ConfigError(
                f"hydra.sweeper.storage={url}: {reason} (another sweep is writing this study): "
                "wait for it to end, or set another hydra.sweep.dir"
            ) from None
        if "readonly" in reason:
            raise ConfigError(
                f"hydra.sweeper.storage={url}: {reason}: make it writable, or set another "
                "hydra.sweep.dir"
            ) from None
        raise ConfigError(
            f"hydra.sweeper.storage={url} cannot be opened as an Optuna study ({reason}); "
            "move that file away to start a new study, or set another hydra.sweep.dir"
        ) from None
    if made_for is not None and made_for != objective.value:
        why = f"objective={made_for}, not {objective.value}"
        raise ConfigError(_another_study(url, sweeper.study_name, why))
    return study


def _another_study(url: str, name: str, why: str) -> str:
    return (
        f"study {name} in {url} was made for {why}: continue it with its own settings, or "
        "give this search another hydra.sweep.dir (or hydra.sweeper.study_name)"
    )


def recover_interrupted(study: optuna.Study) -> dict[int, int | None]:
    """Trials left running by a study that was stopped (Ctrl-C, a killed process, a preempted
    allocation): recorded as failed, their parameters queued to run first. Returns {queued
    trial's number: the interrupted trial's grid point, None outside sampler=grid} (see
    ``_regrid``)."""
    stale = [t for t in study.get_trials(deepcopy=False) if t.state is TrialState.RUNNING]
    reruns = {}
    for t in stale:
        study._storage.set_trial_user_attr(t._trial_id, "error", INTERRUPTED)
        _tell(study, t.number, state=TrialState.FAIL)
        with warnings.catch_warnings():  # enqueue_trial is "experimental" in Optuna 2
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.enqueue_trial(t.params)
        reruns[study.get_trials(deepcopy=False)[-1].number] = t.system_attrs.get("grid_id")
    return reruns


def _regrid(study: optuna.Study, trial: optuna.Trial, reruns: dict[int, int | None]) -> None:
    """Optuna 2's GridSampler gives a queued trial an unvisited grid point, which its fixed
    parameters then replace: that point would never run. The queued rerun takes the grid point
    of the trial it repeats instead."""
    if reruns.get(trial.number) is not None:
        study._storage.set_trial_system_attr(trial._trial_id, "grid_id", reruns[trial.number])


def _seed_sampler(sampler, seed: int, study: optuna.Study) -> None:
    """Seed the sampler from (the sampler's seed, else the run's ``seed``; the trials so far):
    a study is reproducible, and a continued one does not propose its first trials' parameters
    again (a sampler seeded alike would restart the same random sequence)."""
    new_seed = _derived_seed(seed, study)
    parts = [sampler, getattr(sampler, "_random_sampler", None)]
    reseeded = False
    for part in parts:
        if isinstance(getattr(part, "_rng", None), np.random.RandomState):
            part._rng = np.random.RandomState(new_seed)
            reseeded = True
    if not reseeded and study.trials:  # a sampler laid out otherwise: a fresh, unseeded one
        sampler.reseed_rng()


def _derived_seed(seed: int, study: optuna.Study) -> int:
    return int(np.random.SeedSequence([int(seed), len(study.trials)]).generate_state(1)[0])


def _ask(study: optuna.Study, seed: int) -> optuna.Trial:
    """study.ask, reproducibly: Optuna 2's GridSampler picks each trial's grid point with the
    global ``random``, which nothing seeds (the same grid study ran in another order each
    time); it is seeded from (seed, trials so far) before each ask. Nothing in a run uses it."""
    if isinstance(study.sampler, optuna.samplers.GridSampler):
        random.seed(_derived_seed(seed, study))
    return study.ask()


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
        job_dir = _job_dir(ret)
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
    """study.tell; Optuna 2's GridSampler calls study.stop() after the grid's last point, which
    raises outside study.optimize once the trial is already recorded: the loop ends anyway."""
    try:
        study.tell(trial, **outcome)
    except RuntimeError as e:
        if "Study.stop" not in str(e):
            raise


def _job_dir(ret: JobReturn) -> Path | None:
    if ret.hydra_cfg is None:
        return None
    return Path(str(ret.hydra_cfg.hydra.runtime.output_dir))


def study_record(study: optuna.Study, objective: Objective) -> dict:
    """study.json's content: the objective, the best trial, and every trial."""
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state is TrialState.COMPLETE]
    best = None
    if complete:
        b = study.best_trial
        best = {"trial": b.number, "value": b.value, "params": b.params}
    return {
        "study_name": study.study_name,
        "objective": objective.name,
        "direction": DIRECTION[objective],
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
    failed = [t for t in record["trials"] if t["state"] == "FAIL"]
    best = record["best"]
    if best is None:
        raise ConfigError(
            f"no trial of study {study.study_name} completed ({len(failed)} failed; see "
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
        f"fsdp_lab: study {study.study_name}: {len(record['trials'])} trials, "
        f"{len(failed)} failed; best {objective.name} {best['value']:.6g} "
        f"(trial {best['trial']}: {params})",
        file=sys.stderr,
    )
