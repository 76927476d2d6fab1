"""srun without torchrun: each SLURM task is one rank.

Inside an ``srun`` step SLURM says who a task is (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
SLURM_NODEID, SLURM_TASKS_PER_NODE); torch wants RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
and the rendezvous address. ``adopt_srun_env`` translates once, at start, after which the run
is the same as under torchrun (``launch._join_existing_group``). The batch shell itself (where
SLURM_PROCID is 0 too) is not a step and is left alone: there ``python train.py`` spawns its
node's ranks as on a laptop.
"""

from __future__ import annotations

import os
import re

from fsdp_lab.config import ConfigError

BATCH_STEP_IDS = {"batch", "4294967294"}  # the batch script's own step (SLURM_BATCH_SCRIPT)


def in_srun_step(env=os.environ) -> bool:
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return "SLURM_PROCID" in env and step is not None and step not in BATCH_STEP_IDS


def tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """The tasks of node ``node_id`` from SLURM_TASKS_PER_NODE, e.g. "2(x3),1" -> 2,2,2,1."""
    counts: list[int] = []
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            raise ConfigError(f"SLURM_TASKS_PER_NODE={tasks_per_node!r} is not SLURM's format")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    if not 0 <= node_id < len(counts):
        raise ConfigError(f"SLURM_NODEID={node_id} but SLURM_TASKS_PER_NODE={tasks_per_node!r}")
    return counts[node_id]


def adopt_srun_env(env=os.environ) -> bool:
    """Set torch's rank variables from an srun step's (True), or do nothing (False): outside a
    step, or under torchrun, which sets them itself."""
    if "RANK" in env or not in_srun_step(env):
        return False
    missing = [v for v in ("SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID",
                           "SLURM_TASKS_PER_NODE", "MASTER_ADDR", "MASTER_PORT")
               if v not in env]
    if missing:
        raise ConfigError(
            f"srun step without {', '.join(missing)}: launch with scripts/slurm/train.sbatch "
            "(it exports MASTER_ADDR and MASTER_PORT) or export them before srun")
    local_world = tasks_on_node(env["SLURM_TASKS_PER_NODE"], int(env["SLURM_NODEID"]))
    env.update(RANK=env["SLURM_PROCID"], WORLD_SIZE=env["SLURM_NTASKS"],
               LOCAL_RANK=env["SLURM_LOCALID"], LOCAL_WORLD_SIZE=str(local_world))
    return True
