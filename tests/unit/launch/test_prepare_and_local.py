"""What the launcher decides once and how it watches ranks, without starting any."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from fsdp_lab.config import (
    Config,
    ConfigError,
    HardwareConfig,
    HardwareKind,
    ModelArch,
    ModelConfig,
    StartMethod,
)
from fsdp_lab.launch import local, prepare
from fsdp_lab.observe import heartbeat, rundir
from fsdp_lab.train import preempt


def test_a_run_dir_is_claimed_once_and_never_reused(tmp_path):
    run = tmp_path / "run"
    prepare._claim_run_dir(run, continuing=False, job={"num": 0})
    assert rundir.read_run_file(run).to_dict() == {"status": "starting", "job": {"num": 0}}
    with pytest.raises(ConfigError, match="already holds files"):
        prepare._claim_run_dir(run, continuing=False, job=None)
    prepare._claim_run_dir(run, continuing=True, job=None)  # resume=auto continues its run
    assert rundir.read_run_file(run).job == {"num": 0}


def test_resuming_drops_the_records_after_the_checkpoint(tmp_path):
    path = tmp_path / rundir.METRICS_FILE
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (1, 2, 3, 4)))
    assert prepare._truncate_metrics(path, 2) == 4
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    assert prepare._truncate_metrics(tmp_path / "none.jsonl", 2) == 0


@pytest.mark.parametrize(
    "argv0, typed",
    [("train.py", "python train.py"), ("/venv/bin/fsdp-lab", "fsdp-lab train")],
)
def test_a_bare_launch_stays_on_one_node(monkeypatch, argv0, typed):
    cfg = Config(
        model=ModelConfig(arch=ModelArch.llama),
        hardware=HardwareConfig(kind=HardwareKind.cpu, num_nodes=2),
    )
    monkeypatch.setattr("sys.argv", [argv0])  # the message names the command the user typed
    with pytest.raises(ConfigError, match=f"a bare `{typed}` starts ranks.*srun on every node"):
        prepare.local_topology(cfg)
    cfg.hardware.num_nodes, cfg.hardware.nproc_per_node = 1, 3
    topo = prepare.local_topology(cfg)
    assert (topo.world_size, topo.nproc_per_node, topo.device) == (3, 3, HardwareKind.cpu)


class Exited:
    """A rank's process, as far as the launcher looks at it."""

    def __init__(self, code):
        self.returncode = code

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.returncode = -sig

    def wait(self, timeout=None):
        return self.returncode


def test_a_rank_that_died_silently_is_the_cause_not_its_peers_errors(tmp_path):
    (tmp_path / rundir.LOG_DIR).mkdir()
    rundir.error_file(tmp_path, 0).write_text(
        json.dumps({"rank": 0, "time": time.time(), "error": "Connection reset by peer"})
    )
    procs = [Exited(1), Exited(-signal.SIGKILL)]
    reason = local._first_failure(tmp_path, procs, {0: time.time(), 1: time.time() - 1}, {})
    assert reason.startswith("rank 1 died (signal 9) without an error message")
    reason = local._first_failure(tmp_path, [Exited(1), Exited(0)], {0: time.time()}, {})
    assert reason.startswith("rank 0 failed: Connection reset by peer")


def test_an_error_every_rank_wrote_alike_names_the_lowest_rank(tmp_path):
    """A checkpoint that could not be written fails every rank with one reason; whichever rank
    wrote it first (rank 1 on a busy machine), the line is the same."""
    (tmp_path / rundir.LOG_DIR).mkdir()
    now = time.time()
    for rank, at, error in ((0, now, "the disk is full"), (1, now - 1, "the disk is full")):
        rundir.error_file(tmp_path, rank).write_text(
            json.dumps({"rank": rank, "time": at, "error": error})
        )
    procs, exits = [Exited(1), Exited(1)], {0: now, 1: now}
    assert local._first_failure(tmp_path, procs, exits, {}).startswith(
        "rank 0 failed: the disk is full (full log: "
    )
    rundir.error_file(tmp_path, 0).write_text(  # told apart: the earliest is the cause
        json.dumps({"rank": 0, "time": now, "error": "Connection reset by peer"})
    )
    assert local._first_failure(tmp_path, procs, exits, {}).startswith(
        "rank 1 failed: the disk is full"
    )


def test_a_timeout_is_reported_as_the_rank_that_stopped_beating(tmp_path):
    """rank 0 timed out; rank 1 (stopped, then killed by the launcher) beat last 20 s earlier."""
    (tmp_path / "logs").mkdir()
    now = time.time()
    rundir.error_file(tmp_path, 0).write_text(
        json.dumps({"rank": 0, "time": now, "error": "RuntimeError: Timed out waiting 20000ms"})
    )
    beats = {0: (now, 35), 1: (now - 20, 34)}
    reason = local._first_failure(tmp_path, [Exited(1), Exited(-signal.SIGKILL)], {0: now}, beats)
    assert reason.startswith(
        "rank 1 stopped responding after step 34 (no heartbeat for 20 s); "
        "rank 0 timed out waiting for it (full logs"
    )
    # With rank 0's flight recorder dump (a real one, tests/unit/observe/data), where it waits.
    dump = Path(__file__).parents[1] / "observe" / "data" / "behind_rank0.flight.json"
    shutil.copy(dump, tmp_path / "logs" / "rank0.flight.json")
    reason = local._first_failure(tmp_path, [Exited(1), Exited(-signal.SIGKILL)], {0: now}, beats)
    assert "waiting for it; flight recorder: rank 0 waits in collective #5 (all_reduce" in reason
    assert "; no dump from rank 1 (a stopped" in reason
    # Not a timeout, or every rank beating: the error itself is the cause.
    assert local._first_failure(
        tmp_path, [Exited(1), Exited(-signal.SIGKILL)], {0: now}, {0: (now, 35), 1: (now, 35)}
    ).startswith("rank 0 failed: RuntimeError: Timed out")
    assert heartbeat.describe_stall({0: (now, 3)}, 2, waiting=0).startswith(
        "rank 1 never sent a heartbeat"
    )


def test_waiting_reports_the_first_failure_and_preemption_is_not_one():
    assert local._wait([Exited(0), Exited(preempt.EXIT_CODE)])[0] == preempt.EXIT_CODE
    assert local._wait([Exited(0), Exited(0)])[0] == 0
    assert local._wait([Exited(3), Exited(preempt.EXIT_CODE)])[0] == 3


def test_ranks_fork_on_cpu_only_and_spawn_where_cuda_or_xla_runs():
    auto, fork, spawn = StartMethod.auto, StartMethod.fork, StartMethod.spawn
    assert local.resolve_start_method(auto, HardwareKind.cpu) is fork
    assert local.resolve_start_method(auto, HardwareKind.gpu) is spawn
    assert local.resolve_start_method(auto, HardwareKind.tpu) is spawn
    assert local.resolve_start_method(spawn, HardwareKind.cpu) is spawn
    for device in (HardwareKind.gpu, HardwareKind.tpu):
        with pytest.raises(ConfigError, match="start_method=spawn"):
            local.resolve_start_method(fork, device)


def _child(code: int | None) -> local.ForkedRank:
    """A forked child that exits with ``code``, or sleeps until signalled (None)."""
    pid = os.fork()
    if pid == 0:
        if code is None:
            time.sleep(60)
        os._exit(code or 0)
    return local.ForkedRank(pid)


def test_a_forked_rank_reports_its_exit_as_popen_does():
    ok, failed, running = _child(0), _child(3), _child(None)
    assert ok.wait(timeout=10) == 0 and failed.wait(timeout=10) == 3
    assert running.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        running.wait(timeout=0.1)
    running.send_signal(signal.SIGTERM)
    assert running.wait(timeout=10) == -signal.SIGTERM
    running.kill()  # reaped: nothing is sent to a pid that may now be another process's
    assert local._wait([ok, failed])[0] == 3
