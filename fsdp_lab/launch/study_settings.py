"""The settings of fsdp_lab's Optuna study (``hydra.sweeper`` under ``hydra/sweeper=study``):
their schema, registered in Hydra's config store as ``hydra/sweeper/study_schema``, which
conf/hydra/sweeper/study.yaml extends. The sweeper is ``fsdp_lab.launch.study_sweeper``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


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


def register() -> None:
    """The settings' schema in Hydra's config store (``hydra/sweeper/study_schema``), which
    study.yaml extends; the plugin calls it when Hydra scans for plugins."""
    ConfigStore.instance().store(
        group="hydra/sweeper", name="study_schema", node=StudySweeperConf, provider="fsdp_lab"
    )
