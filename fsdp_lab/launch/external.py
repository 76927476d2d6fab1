"""Ranks an external launcher started (torchrun, or srun with ``slurm.adopt_srun_env``): each
process is one rank; they join the group and adopt rank 0's config and run dir, since every
rank composed its own config (``${now:}`` can differ between them)."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from fsdp_lab.config import (
    Config,
    ConfigError,
    to_container,
    to_typed,
)
from fsdp_lab.config.hardware_kinds import Feature, hardware_row
from fsdp_lab.config.topology import Topology
from fsdp_lab.launch import slurm
from fsdp_lab.observe import rundir
from fsdp_lab.train.preempt import EXIT_CODE as PREEMPTED_EXIT_CODE
from fsdp_lab.train.preempt import Launched, Preempted

log = logging.getLogger("fsdp_lab")


def _check_launcher_topology(cfg: Config, topo: Topology) -> None:
    """Under torchrun or srun the launcher decides the ranks; a config that says otherwise is a
    mistake to name, not to ignore."""
    h = cfg.hardware
    if h.nproc_per_node is not None and h.nproc_per_node != topo.nproc_per_node:
        raise ConfigError(
            f"hardware.nproc_per_node={h.nproc_per_node} but the launcher started "
            f"{topo.nproc_per_node} ranks per node; launch that many (srun --ntasks-per-node, "
            "torchrun --nproc_per_node) or drop the override"
        )
    if h.num_nodes != 1 and h.num_nodes != topo.num_nodes:
        raise ConfigError(
            f"hardware.num_nodes={h.num_nodes} but the launcher started {topo.num_nodes} "
            "node(s); launch that many (sbatch --nodes, torchrun --nnodes) or drop the override"
        )


def join_existing_group(
    cfg: Config, hydra_run_dir: Path, job: dict | None, launched: Launched
) -> int:
    """Join the group, adopt rank 0's config and run dir, run this rank. Never returns, except
    when ``launched`` is submitit (hydra/launcher=slurm), whose job must end through
    submitit: the exit code."""
    import torch.distributed as dist

    from fsdp_lab.engine.hardware import devices, process_group
    from fsdp_lab.launch.prepare import prepare_run
    from fsdp_lab.train import worker

    kind = devices.resolve_kind(cfg.hardware)
    refused = hardware_row(kind).refuses.get(Feature.external_launch)
    if refused:
        raise ConfigError(f"hardware={kind.name} cannot run under torchrun or srun: {refused}")
    topo = worker.topology_from_env(kind)
    _check_launcher_topology(cfg, topo)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = devices.rank_device(kind, local_rank)
    # The recorder's size is read as the group is made; its dump file, in join (the run dir
    # is rank 0's, known after the broadcast below).
    process_group.set_flight_recorder(cfg.hardware.flight_recorder, None)
    process_group.init_process_group(kind, device, cfg.hardware.timeout_s, cfg.hardware.backend)
    rank = dist.get_rank()
    payload: list = [None]
    if rank == 0:
        try:
            cfg = prepare_run(cfg, topo, hydra_run_dir, job)
            rundir.save_run_config(cfg, hydra_run_dir)
            payload = [{"config": to_container(cfg), "run_dir": str(hydra_run_dir)}]
        except ConfigError as e:
            payload = [{"error": str(e)}]
        except Exception as e:  # noqa: BLE001 - the other ranks wait in the broadcast below
            payload = [{"error": f"{type(e).__name__}: {e}".splitlines()[0]}]
    process_group.after_rank0("prepared")  # tokenising a corpus may outlast hardware.timeout_s
    dist.broadcast_object_list(payload, src=0)
    shared = payload[0]
    if "error" in shared:
        if rank == 0:
            print(f"fsdp_lab: error: {shared['error']}", file=sys.stderr)
        dist.destroy_process_group()
        sys.stdout.flush()
        if not launched.exits:
            return 2
        os._exit(2)
    run_dir = Path(shared["run_dir"])
    if rank != 0 and hydra_run_dir.resolve() != run_dir.resolve():
        _remove_if_empty(hydra_run_dir)  # this rank's own Hydra dir (hydra #2070)
    # Rank 0 checked the config in prepare_run; the others check it against their own view of
    # the launcher's topology (``Launched.checked``).
    try:
        return worker.run_rank(to_typed(shared["config"]), run_dir, launched)
    except Preempted as stopped:  # only submitit's jobs return: one stopped by its time limit
        if rank == 0 and slurm.requeue_for_submitit(stopped.signal):  # requeues itself
            log.info("requeued the SLURM job: it resumes from step %d", stopped.step)
        return PREEMPTED_EXIT_CODE


def _remove_if_empty(path: Path) -> None:
    """Remove a run dir this rank's Hydra made and nothing wrote to, and its empty parent."""
    for p in (path, path.parent):
        try:
            p.rmdir()
        except OSError:
            return
