"""From one job's composed config to its ranks running ``worker.run_rank``.

Bare ``python train.py`` checks the config here, in the parent (``prepare``), then starts
``hardware.nproc_per_node`` rank processes (``local``) that read the resolved config from the
run dir (``Launched.local``). Under torchrun or srun (RANK/WORLD_SIZE set, or SLURM's task
variables) this process is one rank: ``external.join_existing_group`` takes over
(``Launched.external``, or ``Launched.submitit`` in a job of hydra/launcher=slurm).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import DictConfig

from fsdp_lab.config import ConfigError, to_typed, typed_command
from fsdp_lab.launch import external, local, prepare, slurm
from fsdp_lab.train import preempt
from fsdp_lab.train.preempt import Launched


def launch_job(
    dict_cfg: DictConfig, *, run_dir: Path, multirun: bool, job: dict | None = None
) -> tuple[int, str | None]:
    """One run (a sweep's job) from its composed config: (exit code, the one-line error if the
    config was refused before launch). Failures have been reported on stderr once. ``job``
    (its overrides and group choices, see ``sweep.job_info``) goes into run.json."""
    try:
        slurm.adopt_srun_env()  # under srun each task is one rank, as under torchrun
    except ConfigError as e:
        print(f"fsdp_lab: error: {e}", file=sys.stderr)
        return 2, str(e)
    forwarder = preempt.SignalForwarder() if "RANK" not in os.environ else None
    try:
        cfg = to_typed(dict_cfg)
        if "RANK" in os.environ:
            if multirun and not slurm.under_submitit():  # submitit runs one job per task
                raise ConfigError(
                    "-m/--multirun under torchrun or srun would run the whole sweep on every "
                    f"rank; run `{typed_command()} -m ...` (it starts each job's ranks itself)"
                )
            launched = Launched.submitit if slurm.under_submitit() else Launched.external
            return external.join_existing_group(cfg, run_dir, job, launched), None  # submitit
        topo = prepare.local_topology(cfg)
        cfg = prepare.prepare_run(cfg, topo, run_dir, job)
    except ConfigError as e:
        if forwarder is not None:
            forwarder.restore()
        print(f"fsdp_lab: error: {e}", file=sys.stderr)
        return 2, str(e)
    except KeyboardInterrupt:  # Ctrl-C before any rank started (preparing a corpus, say)
        if forwarder is not None:
            forwarder.restore()
        print("fsdp_lab: interrupted before training started", file=sys.stderr)
        return 130, "interrupted"
    try:
        return local.spawn_local(cfg, topo, run_dir, forwarder), None
    finally:
        forwarder.restore()
