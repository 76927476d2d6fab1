"""srun without torchrun: each SLURM task is one rank.

Inside an ``srun`` step SLURM says who a task is (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID,
SLURM_NODEID, SLURM_TASKS_PER_NODE); torch wants RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
and the rendezvous address. ``adopt_srun_env`` translates once, at start, after which the run
is the same as under torchrun (``external.join_existing_group``). The batch shell itself (where
SLURM_PROCID is 0 too) is not a step and is left alone: there ``python train.py`` spawns its
node's ranks as on a laptop.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess

from fsdp_lab.config import ConfigError, HardwareKind
from fsdp_lab.config.hardware_kinds import HARDWARE, Feature, hardware_row

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
    missing = [
        v
        for v in (
            "SLURM_NTASKS",
            "SLURM_LOCALID",
            "SLURM_NODEID",
            "SLURM_TASKS_PER_NODE",
            "SLURM_JOB_ID",
        )
        if v not in env
    ]
    if missing:
        raise ConfigError(
            f"srun step without {', '.join(missing)}: launch fsdp_lab with sbatch "
            "(scripts/slurm/train.sbatch) or hydra/launcher=slurm"
        )
    if "MASTER_ADDR" not in env:  # the batch script exports it; submitit does not
        env["MASTER_ADDR"] = first_host(env)
    env.setdefault("MASTER_PORT", str(20000 + int(env["SLURM_JOB_ID"]) % 20000))
    local_world = tasks_on_node(env["SLURM_TASKS_PER_NODE"], int(env["SLURM_NODEID"]))
    env.update(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=env["SLURM_NTASKS"],
        LOCAL_RANK=env["SLURM_LOCALID"],
        LOCAL_WORLD_SIZE=str(local_world),
    )
    return True


def first_host(env=os.environ) -> str:
    """The allocation's first node, where rank 0 (SLURM_PROCID 0) runs."""
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodes:
        raise ConfigError(
            "srun step without SLURM_JOB_NODELIST: set MASTER_ADDR to the first node's address"
        )
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodes],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(
            f"`scontrol show hostnames {nodes}` failed ({e}); set MASTER_ADDR to "
            "the first node's address"
        ) from e
    return out.split()[0]


def under_submitit(env=os.environ) -> bool:
    """A job submitit started (hydra/launcher=slurm): each task runs one sweep job."""
    return env.get("SUBMITIT_EXECUTOR") == "slurm"


def requeue_for_submitit(signum: int | None, env=os.environ) -> bool:
    """After a checkpoint on submitit's time-limit signal, requeue the job as submitit would
    (its own handler is replaced while fsdp_lab trains, so that the ranks checkpoint first);
    the job starts again in the same run dir and resumes. True if it was requeued."""
    name = "SIG" + env.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    if not under_submitit(env) or signum != getattr(signal, name, None):
        return False
    job = env.get("SLURM_JOB_ID")
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    subprocess.run(["scontrol", "requeue", str(job)], check=True, timeout=60)
    return True


def _slurm_kinds() -> list:
    """The kinds a SLURM job step can run, the device kinds first."""
    runs = [k for k, row in HARDWARE.items() if row.runs(Feature.external_launch)]
    return sorted(runs, key=lambda k: hardware_row(k).host)


def check_launcher(kind, nproc_per_node: int | None, partition: str | None) -> None:
    """hydra/launcher=slurm sizes SLURM jobs from the hardware group: it must say what the
    compute nodes are (the submitting machine cannot tell), and name a partition that exists."""
    try:
        names = subprocess.run(
            ["sinfo", "-h", "-o", "%R"], capture_output=True, text=True, timeout=60, check=True
        ).stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(
            f"hydra/launcher=slurm needs SLURM's commands (sinfo: {e}); run the "
            "sweep where sbatch works, such as a login node"
        ) from e
    if partition is not None and partition not in names:
        raise ConfigError(
            f"hardware.partition={partition} is not a partition of this cluster "
            f"(sinfo lists {', '.join(names) or 'none'}); pick one of those"
        )
    kind = HardwareKind(getattr(kind, "value", kind))
    if kind not in HARDWARE:
        raise ConfigError(
            f"hydra/launcher=slurm: set {' or '.join(f'hardware={k.name}' for k in _slurm_kinds())}"
            " (the submitting machine cannot tell what the compute nodes have)"
        )
    row = hardware_row(kind)
    if not row.runs(Feature.external_launch):
        raise ConfigError(
            f"hydra/launcher=slurm cannot run hardware={kind.name}: "
            f"{row.refuses[Feature.external_launch]}"
        )
    if row.default_ranks is None and nproc_per_node is None:
        raise ConfigError(
            f"hydra/launcher=slurm with hardware={kind.name}: set hardware.nproc_per_node "
            f"to the {kind.name.upper()}s per node"
        )
