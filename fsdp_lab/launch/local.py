"""A local run: one worker process per rank on this machine, started, watched and stopped.

Ranks start in one of two ways (``hardware.start_method``). fork, the default on cpu: each rank
is a child of this launcher, which has already imported torch and transformers and built the
model on meta, so a rank is training in about a second instead of re-importing for five (the
launcher runs no tensor math, so no OpenMP pool is inherited; CUDA and XLA cannot be used in a
forked child, hence spawn on gpu and tpu). spawn: ``python -m fsdp_lab.launch.rank_main
RUN_DIR PORT_FD``. Either way a rank reads the resolved config from the run dir and the port of
the rendezvous store this process hosts from a pipe: the store is bound after the ranks start,
so the launcher forks while it has no store thread. The first failure stops the others and is
reported once, with its root cause.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import BinaryIO

from fsdp_lab.config import Config, ConfigError, HardwareKind, StartMethod
from fsdp_lab.config.hardware_kinds import hardware_row
from fsdp_lab.config.topology import Topology
from fsdp_lab.data.pool import die_with_parent
from fsdp_lab.launch import rank_main
from fsdp_lab.observe import flight, heartbeat, rundir
from fsdp_lab.train import preempt

# After the first rank fails, the others get this long to fail on their own (a broken
# collective usually ends them at once) before they are terminated.
GRACE_S = 5.0


def resolve_start_method(method: StartMethod, device: HardwareKind) -> StartMethod:
    """fork or spawn for ``hardware.start_method`` on ``device`` (auto: fork on cpu)."""
    can_fork, row = hasattr(os, "fork"), hardware_row(device)
    if method is StartMethod.auto:
        return row.start_method if can_fork else StartMethod.spawn
    if method is StartMethod.fork and not row.forks:
        raise ConfigError(
            f"hardware.start_method=fork with hardware={device.name}: CUDA and XLA cannot be "
            "used in a forked child; use hardware.start_method=spawn (or auto)"
        )
    if method is StartMethod.fork and not can_fork:
        raise ConfigError(
            "hardware.start_method=fork: this platform cannot fork; use "
            "hardware.start_method=spawn (or auto)"
        )
    return method


def _rendezvous_store(timeout_s: int):
    """The ranks' rendezvous store, hosted here on a port the OS assigns as it binds: unlike a
    port picked in advance and bound seconds later by rank 0, no other process can take it."""

    from torch.distributed import TCPStore

    return TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


# Long: starting and watching share one process list and one cleanup (finally).
def spawn_local(
    cfg: Config, topo: Topology, run_dir: Path, forwarder: preempt.SignalForwarder
) -> int:
    """Start one worker process per rank, wait, and report the first failure once.

    A preemption signal (a scheduler's SIGTERM, SLURM's SIGUSR1) reaches every rank through
    ``forwarder``; they finish the step, checkpoint and exit with preempt.EXIT_CODE."""
    from fsdp_lab.engine.hardware import devices

    rundir.save_run_config(cfg, run_dir)
    log_dir = run_dir / rundir.LOG_DIR
    log_dir.mkdir(exist_ok=True)
    # One process per rank; on tpu one for the host, which drives every XLA device.
    nprocs = devices.processes_per_node(topo.device, topo.nproc_per_node)
    for rank in range(nprocs):  # an earlier attempt's: a rank that fails early clears none
        flight.clear(log_dir, rank)
    forks = resolve_start_method(cfg.hardware.start_method, topo.device) is StartMethod.fork
    start = _fork_rank if forks else _spawn_rank
    base_env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        # Every rank is a client of the launcher's store (torchrun's agent does the same).
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "PYTHONUNBUFFERED": "1",
    }
    procs: list[subprocess.Popen | ForkedRank] = []
    store = None
    outputs: list[BinaryIO | None] = []
    port_pipes: list[int] = []  # the write ends; each rank holds its read end
    # Preemption signals stay pending while ranks start: each rank unblocks them once its
    # handler is in place (the mask survives fork and exec), and the launcher's forwarder
    # passes on any that came meanwhile once every rank is known to it.
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, preempt.SIGNALS)
    try:
        for rank in range(nprocs):
            env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            # Rank 0 talks to the console; the others' raw output (native warnings, crashes)
            # goes to their log file beside what their logger writes there.
            # Closed in the finally below, once every rank has exited.
            out = None if rank == 0 else open(log_dir / f"rank{rank}.log", "ab")  # noqa: SIM115
            outputs.append(out)
            port_fd, port_w = os.pipe()
            port_pipes.append(port_w)
            try:
                procs.append(start(run_dir, env, out, port_fd, port_pipes))
            finally:
                os.close(port_fd)
            rundir.pid_file(run_dir, rank).write_text(f"{procs[-1].pid}\n")
            forwarder.add(procs[-1])
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        store = _rendezvous_store(cfg.hardware.timeout_s)
        for port_w in port_pipes:
            with contextlib.suppress(BrokenPipeError):  # a rank that died is reported below
                os.write(port_w, f"{store.port}\n".encode())
        code, exit_times = _wait(procs)
    except KeyboardInterrupt:
        _stop(procs)
        _mark_failed(run_dir, "interrupted (Ctrl-C)")
        print("fsdp_lab: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        for fd in port_pipes:
            os.close(fd)
        for rank, out in enumerate(outputs):
            if out is not None:
                out.close()
            rundir.pid_file(run_dir, rank).unlink(missing_ok=True)
    beats = heartbeat.read(store, nprocs) if code not in (0, preempt.EXIT_CODE) else {}
    return _report_end(run_dir, code, procs, exit_times, forwarder, beats)


def _report_end(
    run_dir: Path,
    code: int,
    procs: list[subprocess.Popen | ForkedRank],
    exit_times: dict[int, float],
    forwarder: preempt.SignalForwarder,
    beats: dict[int, tuple[float, int]],
) -> int:
    """One line on stderr for a preempted or failed run; the launcher's exit code. ``beats``:
    the ranks' last heartbeats, which name a rank that stopped."""
    if code == preempt.EXIT_CODE:
        facts = rundir.read_run_file(run_dir)
        sig = forwarder.seen[0] if forwarder.seen else "?"
        print(
            f"fsdp_lab: preempted (signal {sig}) after step "
            f"{facts.step}, checkpoint written; run the same command again with "
            f"hydra.run.dir={run_dir} to resume",
            file=sys.stderr,
        )
    elif code != 0:
        reason = _first_failure(run_dir, procs, exit_times, beats)
        _mark_failed(run_dir, reason)
        print(f"fsdp_lab: error: {reason}", file=sys.stderr)
    return 128 - code if code < 0 else code  # killed by signal N: exit 128+N, as shells do


def _spawn_rank(
    run_dir: Path, env: dict, out: BinaryIO | None, port_fd: int, port_pipes: list[int]
) -> subprocess.Popen:
    """A rank in a fresh interpreter (it inherits no descriptor but its port pipe)."""
    return subprocess.Popen(
        [sys.executable, "-m", "fsdp_lab.launch.rank_main", str(run_dir), str(port_fd)],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT if out else None,
        pass_fds=(port_fd,),
        preexec_fn=die_with_parent,
    )


def _fork_rank(
    run_dir: Path, env: dict, out: BinaryIO | None, port_fd: int, port_pipes: list[int]
) -> ForkedRank:
    """A rank as a child of this process; the child never returns into the launcher's code."""
    sys.stdout.flush()  # or the child would print what the launcher buffered, a second time
    sys.stderr.flush()
    with warnings.catch_warnings():
        # Python 3.12+ warns of forking with threads alive: torch's import leaves an idle one
        # behind, which the child neither has nor needs.
        warnings.filterwarnings("ignore", ".*fork", DeprecationWarning)
        pid = os.fork()
    if pid:
        return ForkedRank(pid)
    try:
        die_with_parent()
        for fd in port_pipes:  # the write ends: a rank holds only its read end
            os.close(fd)
        os.environ.update(env)
        if out is not None:
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        rank_main.catch_signals()
        rank_main.run_local_rank(run_dir, port_fd)
    except BaseException:  # noqa: BLE001 - the child's failure is reported by its exit code
        traceback.print_exc()
    finally:
        os._exit(1)  # run_local_rank ends the process itself; reached only when it failed to


class ForkedRank:
    """A forked rank, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"rank (pid {self.pid})", timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # once reaped, the pid may belong to another process
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _wait(procs: list[subprocess.Popen | ForkedRank]) -> tuple[int, dict[int, float]]:
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


def _stop(procs: list[subprocess.Popen | ForkedRank]) -> None:
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
    run_dir: Path,
    procs: list[subprocess.Popen | ForkedRank],
    exit_times: dict[int, float],
    beats: dict[int, tuple[float, int]],
) -> str:
    """The root cause, shown once.

    A rank that died without writing an error (kill -9, OOM killer, a native crash) before the
    launcher stopped anyone is the cause: the errors its peers then write ("Connection reset by
    peer") are effects, and they often reach the disk before the launcher's poll sees the
    death. A rank that stopped beating (stopped, hung) while the others timed out waiting is
    the cause of their timeouts. Otherwise the earliest error written wins (written alike by
    several ranks: the lowest of them). A timeout also says what the ranks' flight recorders
    hold: where each waits, which is behind, or which collectives did not match.
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
    log_dir, ranks = run_dir / rundir.LOG_DIR, range(len(procs))
    # Dumps exist only after a collective timed out (NCCL's watchdog may then end the rank).
    waited = [r for _, r, message in errors if heartbeat.is_timeout(message)]
    said = flight.describe(flight.read_dir(log_dir, ranks), ranks, waiting=waited)
    recorded = f"; {said}" if said else ""
    if not deaths and heartbeat.is_timeout(min(errors)[2]):
        stall = heartbeat.describe_stall(
            beats, len(procs), waiting=min(errors)[1], exclude=frozenset(r for _, r, _ in errors)
        )
        if stall is not None:
            return f"{stall}{recorded} (full logs: {log_dir})"
    _, rank, message = min(deaths or errors)
    # An error several ranks wrote alike (a checkpoint that could not be written): the lowest
    # of them, not whichever wrote first, so a busy machine says what an idle one does.
    if not deaths:
        rank = min(r for _, r, m in errors if m == message)
    return f"rank {rank} {message}{recorded} (full log: {log_dir / f'rank{rank}.log'})"


def _mark_failed(run_dir: Path, reason: str) -> None:
    """Record the failure in run.json, so reports list the run as failed with its reason."""
    rundir.update_run_file(run_dir, status="failed", error=reason)
