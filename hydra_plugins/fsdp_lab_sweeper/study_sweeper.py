"""Hydra finds sweepers only under ``hydra_plugins``: this is fsdp_lab's Optuna study there
(``hydra/sweeper=study``, conf/hydra/sweeper/study.yaml), with its settings' schema. The
Hydra side (settings, launcher, job numbers) is here; the study is ``fsdp_lab.launch.study``,
imported when a study starts so that every other run skips Optuna. (No ``from __future__
import annotations``: Hydra's plugin scan runs this module outside sys.modules, where a
dataclass cannot resolve string annotations.)"""

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.plugins.sweeper import Sweeper
from omegaconf import MISSING, DictConfig, OmegaConf


@dataclass
class StudySweeperConf:
    """``hydra.sweeper``'s fields under hydra/sweeper=study: the types (a typo or a wrong type
    fails at compose); the values are study.yaml's."""

    _target_: str = "hydra_plugins.fsdp_lab_sweeper.study_sweeper.StudySweeper"
    direction: str = MISSING
    """minimize or maximize: the way objective= goes (val_loss: minimize, tokens_per_s: maximize)"""
    sampler: str = MISSING
    """tpe, random, grid, gp or cmaes (fsdp_lab.launch.search_space.SAMPLERS)"""
    sampler_options: dict[str, Any] = MISSING
    """keyword arguments of the sampler's class, e.g. {n_startup_trials: 5} for tpe"""
    seed: int | None = MISSING
    """the sampler's seed; null: the run's ``seed``"""
    storage: str = MISSING
    """sqlite, journal, journal://PATH, sqlite:///PATH or a database URL
    (launch.study_storage.storage_of)"""
    study_name: str = MISSING
    """the study's name in its storage (and the trials' W&B config)"""
    n_trials: int = MISSING
    """trials of the whole study, those of earlier and parallel sweep processes included"""
    n_jobs: int = MISSING
    """trials launched at once: with hydra/launcher=slurm, SLURM jobs per batch"""
    max_failure_rate: float = MISSING
    """the study stops when more than this fraction of a batch fails (1.0: never)"""
    params: dict[str, str] | None = MISSING
    """the search space: override key -> Hydra sweep syntax (launch.search_space)"""


ConfigStore.instance().store(
    group="hydra/sweeper", name="study_schema", node=StudySweeperConf, provider="fsdp_lab"
)


class StudySweeper(Sweeper):
    """Hydra's sweeper interface around ``fsdp_lab.launch.study.run_study``."""

    def __init__(self, **settings: Any) -> None:
        plain = {
            k: OmegaConf.to_container(v) if isinstance(v, DictConfig) else v
            for k, v in settings.items()
        }
        self.settings = StudySweeperConf(**plain)

    def setup(self, *, hydra_context, task_function, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def sweep(self, arguments: list[str]) -> None:
        from fsdp_lab.config import ConfigError

        try:
            from fsdp_lab.launch.study import run_study
        except ImportError as e:
            raise ImportError(
                f"hydra/sweeper=study needs Optuna ({e}): pip install -e '.[optuna]'"
            ) from e
        try:
            run_study(self.settings, config=self.config, launch=self.launch, arguments=arguments)
        except ConfigError as e:
            print(f"fsdp_lab: error: {e}", file=sys.stderr)
            sys.exit(2)

    def launch(self, numbers: Sequence[int], overrides: list[list[str]]) -> list[JobReturn]:
        """Run jobs numbered ``numbers`` (their trials'). Hydra numbers a launch's jobs from
        ``initial_job_idx`` on, and a job's number is its dir and its W&B trial: numbers
        apart (another sweep process asked a trial in between) go in launches of their own,
        one after the other."""
        returns, start = [], 0
        for end in range(1, len(numbers) + 1):
            if end == len(numbers) or numbers[end] != numbers[end - 1] + 1:
                jobs = overrides[start:end]
                returns += self.launcher.launch(jobs, initial_job_idx=numbers[start])
                start = end
        return returns
