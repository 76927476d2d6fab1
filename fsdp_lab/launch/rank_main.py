"""Entry point of a rank the local launcher starts, one path for both ways it starts one.

spawn: ``python -m fsdp_lab.launch.rank_main RUN_DIR PORT_FD`` in a fresh interpreter. fork: a
child of the launcher calls ``catch_signals`` and ``run_local_rank`` itself. Either way
preemption signals are caught before the heavy imports (torch and transformers take seconds in
a fresh interpreter), so a signal that arrives while a rank starts up is acted on after its
first step instead of killing it without a checkpoint; and the rank reads the rendezvous port
from the pipe ``PORT_FD`` once the launcher has bound its store.
"""

import os
import signal
import sys
from pathlib import Path

from fsdp_lab.observe import rundir
from fsdp_lab.train import preempt

early_signals: list[int] = []


def _remember(signum, frame) -> None:
    early_signals.append(signum)


def catch_signals() -> None:
    """Remember preemption signals from now on. The launcher starts ranks with these signals
    blocked; any that came meanwhile arrive now."""
    for sig in preempt.SIGNALS:
        signal.signal(sig, _remember)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, preempt.SIGNALS)


def read_port(port_fd: int) -> str:
    """The launcher's store port, sent once it is bound (EOF: the launcher is gone)."""
    with os.fdopen(port_fd, "rb") as pipe:
        port = pipe.readline().strip().decode()
    if not port.isdigit():
        raise RuntimeError("the launcher exited before it sent the rendezvous port")
    return port


def run_local_rank(run_dir: Path, port_fd: int) -> None:
    """Run this rank of the config the launcher saved in ``run_dir``; never returns
    (``worker.run_rank`` ends the process)."""
    os.environ["MASTER_PORT"] = read_port(port_fd)
    from fsdp_lab.train import worker

    config = rundir.load_run_config(run_dir)
    worker.run_rank(config, run_dir, preempt.Launched.local, early_signals=early_signals)


if __name__ == "__main__":
    catch_signals()
    run_local_rank(Path(sys.argv[1]), int(sys.argv[2]))
