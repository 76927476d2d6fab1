"""Entry point of a locally spawned rank: ``python -m fsdp_lab.launch.rank_main RUN_DIR``.

Catches preemption signals before the heavy imports (torch, transformers take seconds), so a
signal that arrives while a rank starts up is acted on after its first step instead of killing
it without a checkpoint.
"""

import signal
import sys
from pathlib import Path

from fsdp_lab.observe import rundir
from fsdp_lab.train import preempt

early_signals: list[int] = []


def _remember(signum, frame) -> None:
    early_signals.append(signum)


for _sig in preempt.SIGNALS:
    signal.signal(_sig, _remember)
# The launcher starts ranks with these signals blocked; any that came meanwhile arrive now.
signal.pthread_sigmask(signal.SIG_UNBLOCK, preempt.SIGNALS)

if __name__ == "__main__":
    from fsdp_lab.train import worker

    run_dir = Path(sys.argv[1])
    worker.run_and_exit(rundir.load_run_config(run_dir), run_dir, early_signals=early_signals)
