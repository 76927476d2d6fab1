"""From Hydra's composed config to the typed, checked ``Config``; the schema's registration;
``compose``, the config train.py would run, from overrides (plan, tune, the data commands).

Imports no torch: the parent checks a config in well under a second.
"""

from __future__ import annotations

import contextlib

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdp_lab.config.config_dirs import (
    CONF_MODULE,
    compose_error,
    searchpath_dirs,
    with_config_dirs,
)
from fsdp_lab.config.errors import ConfigError
from fsdp_lab.config.hardware import HardwareKind
from fsdp_lab.config.hardware_kinds import HARDWARE, hardware_row
from fsdp_lab.config.rules import check_fields
from fsdp_lab.config.schema import Config

SCHEMA_NAME = "fsdp_lab_schema"


def register_schema() -> None:
    """Put the schema in Hydra's ConfigStore (conf/config.yaml names it first in its defaults)
    and the resolvers hydra/launcher=slurm sizes its jobs with."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=Config)
    OmegaConf.register_new_resolver("fsdp_lab.slurm_tasks", slurm_tasks_per_node, replace=True)
    OmegaConf.register_new_resolver("fsdp_lab.slurm_gpus", slurm_gpus_per_node, replace=True)


def to_typed(cfg: DictConfig | dict) -> Config:
    """A composed config (or its plain-dict form) as typed dataclasses, single-field rules
    checked."""
    try:
        node = OmegaConf.merge(OmegaConf.structured(Config), cfg)
        typed = OmegaConf.to_object(node)
    except OmegaConfBaseException as e:
        raise ConfigError(str(e).splitlines()[0]) from e
    if not isinstance(typed, Config):
        raise RuntimeError(f"OmegaConf made a {type(typed).__name__} of the schema, not a Config")
    check_fields(typed)
    return typed


def compose(overrides: list[str], config_dirs: list[str] | None = None) -> Config:
    """The typed config train.py would run (single-field rules checked); no run dir is made.
    ``config_dirs``: a user's config dirs (``--config-dir``), searched beside the package's
    groups, as is any ``hydra.searchpath=[...]`` in ``overrides``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.errors import HydraException

    register_schema()
    overrides = with_config_dirs(list(overrides), list(config_dirs or []))
    try:
        with (
            _outside_a_running_app(),
            initialize_config_module(CONF_MODULE, version_base="1.3", job_name="compose"),
        ):
            composed = hydra_compose(config_name="config", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(compose_error(str(e), searchpath_dirs(overrides))) from e
    return to_typed(composed)


@contextlib.contextmanager
def _outside_a_running_app():
    """Compose from inside a running Hydra app too (a job's callback measuring the machine):
    the app's global Hydra is set aside while this composes, and put back (Hydra's own
    backup, as its ``initialize`` contexts do)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    if not GlobalHydra.instance().is_initialized():
        yield
        return
    backup = get_gh_backup()
    restore_gh_from_backup(None)  # no global Hydra: compose makes its own
    try:
        yield
    finally:
        restore_gh_from_backup(backup)


def slurm_tasks_per_node(nproc_per_node: int | None) -> int:
    """SLURM tasks per node for hydra/launcher=slurm: one per rank (2 on CPU nodes by default;
    ``launch.slurm.check_launcher`` has refused what cannot be sized)."""
    return nproc_per_node or 2


def slurm_gpus_per_node(kind, nproc_per_node: int | None) -> int | None:
    """One GPU per rank where the kind's row asks SLURM for GPUs; none on CPU nodes."""
    kind = HardwareKind(getattr(kind, "value", kind))
    if kind not in HARDWARE or not hardware_row(kind).slurm_gpus:
        return None
    return slurm_tasks_per_node(nproc_per_node)
