"""The training command: the same from ``python train.py`` in a checkout, ``fsdp-lab train``
and ``python -m fsdp_lab`` from any directory (an installed wheel carries its configs).

Hydra composes each job from the groups shipped in the package (``pkg://fsdp_lab.conf``) and
a user's config dirs (``--config-dir DIR``, ``hydra.searchpath=[DIR]``), checked here first:
Hydra itself only warns of a missing one. Each job runs through ``sweep.SweepJobs``."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig

from fsdp_lab import config
from fsdp_lab.config.config_dirs import CONF_MODULE, split_dir_flags, with_config_dirs


def _one_run(overrides: list[str]) -> bool:
    """The command line is one run's overrides: no Hydra flag (-m, --cfg, ...) and no sweep
    value (a,b / range(...), which a study's config may run without -m). A sweep's jobs are
    composed by Hydra's sweeper, each checked as it runs."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    if any(o.startswith("-") for o in overrides):
        return False
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException:
        return True  # compose names what is wrong with it, in one line
    return not any(o.is_sweep_override() for o in parsed)


def main(argv: list[str] | None = None) -> int:
    """Run the job (or each job of a -m sweep) of ``argv`` (default: the command line's
    arguments); the exit code: 1 if a sweep job failed (each failure is recorded in its
    run.json and listed at the end), 2 if the config was refused."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from fsdp_lab.launch import sweep

    try:
        # Config dirs, checked and absolute, become one hydra.searchpath that both the check
        # below and Hydra's own run search (Hydra would keep only the last --config-dir).
        args, dirs = split_dir_flags(sys.argv[1:] if argv is None else list(argv))
        args = with_config_dirs(args, dirs)
        if _one_run(args):
            config.compose(args)  # a bad key in one line, naming its file
    except config.ConfigError as e:
        print(f"fsdp_lab: error: {e}", file=sys.stderr)
        return 2
    config.register_schema()
    jobs = sweep.SweepJobs()

    @hydra.main(version_base="1.3", config_path=f"pkg://{CONF_MODULE}", config_name="config")
    def one_job(cfg: DictConfig) -> float | None:
        hc = HydraConfig.get()
        return jobs.run_job(
            cfg,
            run_dir=Path(hc.runtime.output_dir),
            multirun=hc.mode == RunMode.MULTIRUN,
            job=sweep.job_info(hc),
            trial=hc.mode == RunMode.MULTIRUN and sweep.is_study(hc),
        )

    saved = sys.argv
    sys.argv = [saved[0], *args]  # Hydra reads its overrides and flags from sys.argv
    try:
        one_job()  # Hydra composes each job's config and calls one_job with it
    finally:
        sys.argv = saved
    return jobs.exit_code()
