"""The preemption protocol shared by the launcher and the ranks (imports nothing heavy).

SIGTERM (schedulers) or SIGUSR1 (SLURM's --signal) asks a run to stop: the launcher forwards it
to every rank, each finishes its step, a checkpoint is written, and ranks and launcher exit with
EXIT_CODE (EX_TEMPFAIL, "try again"): a scheduler requeues the job and resume=auto continues it.
"""

from __future__ import annotations

import signal

SIGNALS = frozenset({signal.SIGTERM, signal.SIGUSR1})
EXIT_CODE = 75


class Preempted(Exception):
    """Every rank stopped early on a signal, with a checkpoint written if checkpointing is on."""


class StopFlag:
    """Set by a preemption signal; the loop finishes its step, then every rank stops together."""

    def __init__(self, early_signals: list[int] | None = None) -> None:
        self.signal: int | None = early_signals[0] if early_signals else None
        for sig in SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    def __call__(self) -> bool:
        return self.signal is not None
