"""A local run: one worker process per rank on this machine, started, watched and stopped.

The ranks read the resolved config from the run dir (``python -m fsdp_lab.launch.rank_main
RUN_DIR``) and meet at a rendezvous store this process hosts. The first failure stops the
others and is reported once, with its root cause.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fsdp_lab.config import Config
from fsdp_lab.config.topology import Topology
from fsdp_lab.observe import rundir
from fsdp_lab.train import preempt

# After the first rank fails, the others get this long to fail on their own (a broken
# collective usually ends them at once) before they are terminated.
GRACE_S = 5.0


def _rendezvous_store(timeout_s: int):
    """The ranks' rendezvous store, hosted here on a port the OS assigns as it binds: unlike a
    port picked in advance and bound seconds later by rank 0, no other process can take it."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


# Long: starting, watching and reporting share one process list and one cleanup (finally).
def spawn_local(
    cfg: Config, topo: Topology, run_dir: Path, forwarder: preempt.SignalForwarder
) -> int:
    """Start one worker process per rank, wait, and report the first failure once.

    A preemption signal (a scheduler's SIGTERM, SLURM's SIGUSR1) reaches every rank through
    ``forwarder``; they finish the step, checkpoint and exit with preempt.EXIT_CODE."""
    from fsdp_lab.engine import hardware

    rundir.save_run_config(cfg, run_dir)
    log_dir = run_dir / rundir.LOG_DIR
    log_dir.mkdir(exist_ok=True)
    store = _rendezvous_store(cfg.hardware.timeout_s)
    # One process per rank; on tpu one for the host, which drives every XLA device.
    nprocs = hardware.processes_per_node(topo.device, topo.nproc_per_node)
    base_env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        # Every rank is a client of the launcher's store (torchrun's agent does the same).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "PYTHONUNBUFFERED": "1",
    }
    procs: list[subprocess.Popen] = []
    outputs = []
    try:
        for rank in range(nprocs):
            env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            # Rank 0 talks to the console; the others' raw output (native warnings, crashes)
            # goes to their log file beside what their logger writes there.
            # Closed in the finally below, once every rank has exited.
            out = None if rank == 0 else open(log_dir / f"rank{rank}.log", "ab")  # noqa: SIM115
            outputs.append(out)
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "fsdp_lab.launch.rank_main", str(run_dir)],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT if out else None,
                    preexec_fn=_prepare_child,
                )
            )
            forwarder.add(procs[-1])
        code, exit_times = _wait(procs)
    except KeyboardInterrupt:
        _stop(procs)
        _mark_failed(run_dir, "interrupted (Ctrl-C)")
        print("fsdp_lab: interrupted", file=sys.stderr)
        return 130
    finally:
        for out in outputs:
            if out is not None:
                out.close()
    if code == preempt.EXIT_CODE:
        facts = rundir.read_run_file(run_dir)
        sig = forwarder.seen[0] if forwarder.seen else "?"
        print(
            f"fsdp_lab: preempted (signal {sig}) after step "
            f"{facts.get('step')}, checkpoint written; run the same command again with "
            f"hydra.run.dir={run_dir} to resume",
            file=sys.stderr,
        )
    elif code != 0:
        reason = _first_failure(run_dir, procs, exit_times)
        _mark_failed(run_dir, reason)
        print(f"fsdp_lab: error: {reason}", file=sys.stderr)
    return 128 - code if code < 0 else code  # killed by signal N: exit 128+N, as shells do


def _prepare_child() -> None:
    """In the child before exec.

    Hold preemption signals pending (the mask survives exec) until rank_main has its handler
    in place and unblocks them, so none is lost or fatal. And on Linux, die with the launcher:
    a launcher killed by SIGKILL or the OOM killer must not leave ranks training as orphans.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, preempt.SIGNALS)
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _wait(procs: list[subprocess.Popen]) -> tuple[int, dict[int, float]]:
    """Wait for every rank; after the first failure, stop the rest. Returns the first non-zero
    exit code (0 if none) and when each rank was seen to exit (wall clock)."""
    exit_times: dict[int, float] = {}
    failed_at = None
    while True:
        for rank, p in enumerate(procs):
            if rank not in exit_times and p.poll() is not None:
                exit_times[rank] = time.time()
        codes = [p.returncode for p in procs]
        # A preempted rank is not a failure: the others follow it.
        first_bad = next((c for c in codes if c not in (None, 0, preempt.EXIT_CODE)), 0)
        if len(exit_times) == len(procs):
            preempted = preempt.EXIT_CODE in codes
            return first_bad or (preempt.EXIT_CODE if preempted else 0), exit_times
        if failed_at is None and first_bad:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            _stop(procs)
            return first_bad, exit_times
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _first_failure(
    run_dir: Path, procs: list[subprocess.Popen], exit_times: dict[int, float]
) -> str:
    """The root cause, shown once.

    A rank that died without writing an error (kill -9, OOM killer, a native crash) before the
    launcher stopped anyone is the cause: the errors its peers then write ("Connection reset by
    peer") are effects, and they often reach the disk before the launcher's poll sees the
    death. Otherwise the earliest error written wins.
    """
    deaths, errors = [], []  # (time, rank, message)
    for rank, p in enumerate(procs):
        path = rundir.error_file(run_dir, rank)
        if path.is_file():
            err = json.loads(path.read_text())
            errors.append((err["time"], rank, f"failed: {err['error']}"))
        elif p.returncode not in (0, None, preempt.EXIT_CODE) and rank in exit_times:
            how = f"signal {-p.returncode}" if p.returncode < 0 else f"exit code {p.returncode}"
            deaths.append((exit_times[rank], rank, f"died ({how}) without an error message"))
    if not deaths and not errors:
        return "a rank failed without an error message"
    _, rank, message = min(deaths or errors)
    return f"rank {rank} {message} (full log: {run_dir / rundir.LOG_DIR / f'rank{rank}.log'})"


def _mark_failed(run_dir: Path, reason: str) -> None:
    """Record the failure in run.json, so reports list the run as failed with its reason."""
    rundir.update_run_file(run_dir, status="failed", error=reason)
