"""srun tasks as ranks, the launcher's topology checks and submitit's requeue signal, in-process."""

from __future__ import annotations

import pytest

from fsdp_lab.config import Config, ConfigError, HardwareConfig, HardwareKind
from fsdp_lab.launch import external, slurm

STEP = {
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "SLURM_STEP_ID": "0",
    "SLURM_JOB_ID": "4711",
    "MASTER_ADDR": "node1",
}


@pytest.mark.parametrize(
    "spec,node,want",
    [("2(x3),1", 0, 2), ("2(x3),1", 2, 2), ("2(x3),1", 3, 1), ("8", 0, 8), ("4,2", 1, 2)],
)
def test_tasks_per_node_is_read_as_slurm_writes_it(spec, node, want):
    assert slurm.tasks_on_node(spec, node) == want


def test_an_srun_task_becomes_a_rank():
    env = dict(STEP)
    assert slurm.adopt_srun_env(env)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "3",
        "4",
        "1",
        "2",
    )
    assert env["MASTER_PORT"] == str(20000 + 4711)  # one port per job, the same on every task


@pytest.mark.parametrize(
    "env",
    [
        {**STEP, "SLURM_STEP_ID": "4294967294"},  # the batch script: spawn locally as on a laptop
        {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"},  # salloc shell, no step
        {**STEP, "RANK": "0"},  # torchrun inside srun set the ranks itself
    ],
)
def test_outside_an_srun_step_nothing_changes(env):
    before = dict(env)
    assert not slurm.adopt_srun_env(env)
    assert env == before


def test_an_srun_step_without_slurms_task_variables_is_one_clear_line():
    env = {k: v for k, v in STEP.items() if k != "SLURM_TASKS_PER_NODE"}
    with pytest.raises(
        ConfigError, match="srun step without SLURM_TASKS_PER_NODE: launch fsdp_lab with sbatch"
    ):
        slurm.adopt_srun_env(env)


def test_only_submitits_signal_under_submitit_requeues():
    import signal

    assert not slurm.requeue_for_submitit(signal.SIGUSR2, {})  # not a submitit job
    assert not slurm.requeue_for_submitit(signal.SIGTERM, {"SUBMITIT_EXECUTOR": "slurm"})
    assert not slurm.requeue_for_submitit(None, {"SUBMITIT_EXECUTOR": "slurm"})


@pytest.mark.parametrize(
    "hw,fragment",
    [
        (HardwareConfig(nproc_per_node=8), "hardware.nproc_per_node=8 but the launcher started 2"),
        (HardwareConfig(num_nodes=4), "hardware.num_nodes=4 but the launcher started 2 node(s)"),
    ],
)
def test_a_config_asking_for_other_ranks_than_the_launcher_started_fails(monkeypatch, hw, fragment):
    from fsdp_lab.train.worker import topology_from_env

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    topo = topology_from_env(HardwareKind.cpu)
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        external._check_launcher_topology(Config(hardware=hw), topo)
    external._check_launcher_topology(
        Config(hardware=HardwareConfig(nproc_per_node=2, num_nodes=2)), topo
    )
