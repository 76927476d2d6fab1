"""The protocol shared by the launchers and the ranks (imports nothing heavy): who started a
rank (``Launched``), which decides how it ends, and how a run is stopped early.

SIGTERM (schedulers), SIGUSR1 (SLURM's --signal, as scripts/slurm/train.sbatch asks) or SIGUSR2
(submitit's, hydra/launcher=slurm) asks a run to stop: the launcher forwards it
to every rank, the ranks stop together at the next logging boundary (trainer.log_every), a
checkpoint is written, and ranks and launcher exit with
EXIT_CODE (EX_TEMPFAIL, "try again"): a scheduler requeues the job and resume=auto continues it.
"""

from __future__ import annotations

import enum
import signal
from typing import Protocol

SIGNALS = frozenset({signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2})
EXIT_CODE = 75


class Launched(enum.Enum):
    """Who started a rank: the one value that decides how ``worker.run_rank`` ends it.

    | launched | config checked by           | a failure reported by        | the rank ends       |
    | local    | the launcher (prepare_run)  | the launcher (error files)   | os._exit(code)      |
    | external | rank 0; others in join      | each rank on its stderr too  | os._exit(code)      |
    | submitit | rank 0; others in join      | each rank on its stderr too  | returns its code    |

    external: torchrun, or srun with ``launch.slurm.adopt_srun_env``. submitit: a job of
    hydra/launcher=slurm, which must end through submitit; a preemption is raised to it as
    ``Preempted`` (after the checkpoint), so that it can requeue the job."""

    local = "local"
    external = "external"
    submitit = "submitit"

    def checked(self, rank: int) -> bool:
        """This process checked the config's rules against the topology the rank runs in, or
        the launcher that started it did: else the rank checks them as it joins."""
        return self is Launched.local or rank == 0

    @property
    def launcher_reports(self) -> bool:
        """The launcher reads the ranks' error files and heartbeats and names the cause."""
        return self is Launched.local

    @property
    def exits(self) -> bool:
        """The rank ends its process (``os._exit``): interpreter shutdown after
        ``destroy_process_group`` sometimes aborts."""
        return self is not Launched.submitit


class Preempted(Exception):
    """Every rank stopped early on a signal, with a checkpoint written if checkpointing is on."""

    def __init__(self, step: int, *, signal: int | None = None) -> None:
        super().__init__(f"stopped after step {step}")
        self.step = step
        self.signal = signal  # the signal that asked for the stop, where this rank saw it


class StopFlag:
    """Set by a preemption signal; read at the loop's next logging boundary, where every rank
    stops together."""

    def __init__(self, early_signals: list[int] | None = None) -> None:
        self.signal: int | None = early_signals[0] if early_signals else None
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    def __call__(self) -> bool:
        return self.signal is not None


class Process(Protocol):
    """What the forwarder needs of a rank's process (a ``subprocess.Popen``, or a forked rank)."""

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...


class SignalForwarder:
    """Preemption signals to the launcher go to every rank; one that arrives before the ranks
    exist is kept and sent to them as soon as they start (they then stop at their first logging
    boundary)."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.procs: list[Process] = []
        self._previous = {sig: signal.signal(sig, self._forward) for sig in SIGNALS}

    def _forward(self, signum, frame) -> None:
        self.seen.append(signum)
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signum)

    def add(self, proc: Process) -> None:
        self.procs.append(proc)
        for signum in self.seen:
            proc.send_signal(signum)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
