"""fsdp_lab's Optuna study as a Hydra sweeper (``hydra/sweeper=study``): the Hydra side
(settings, launcher, job numbers). The study itself is ``fsdp_lab.launch.study``, imported when
a study starts so that every other run skips Optuna; the settings' schema is
``fsdp_lab.launch.study_settings``. Hydra finds and instantiates sweepers only under
``hydra_plugins``: ``hydra_plugins/fsdp_lab_sweeper`` registers this one there, by name."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn
from hydra.plugins.sweeper import Sweeper
from omegaconf import DictConfig, OmegaConf

from fsdp_lab.config import ConfigError
from fsdp_lab.launch.study_settings import StudySweeperConf


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
        try:  # Optuna is optional: only a study imports it
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
