"""The preemption protocol in one process: a signal sets the flag, the launcher forwards it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from fsdp_lab.train import preempt


@pytest.fixture
def restore_handlers():
    saved = {sig: signal.getsignal(sig) for sig in preempt.SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


@pytest.mark.parametrize("sig", sorted(preempt.SIGNALS))
def test_each_preemption_signal_sets_the_stop_flag(restore_handlers, sig):
    stop = preempt.StopFlag()
    assert not stop()
    os.kill(os.getpid(), sig)
    assert stop() and stop.signal == sig


def test_a_signal_caught_during_start_up_counts(restore_handlers):
    stop = preempt.StopFlag(early_signals=[signal.SIGUSR1])
    assert stop() and stop.signal == signal.SIGUSR1


def test_the_forwarder_sends_signals_to_ranks_started_before_and_after(restore_handlers):
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    forwarder = preempt.SignalForwarder()
    first = late = subprocess.Popen(sleeper)
    try:
        forwarder.add(first)
        os.kill(os.getpid(), signal.SIGTERM)
        assert first.wait(timeout=10) == -signal.SIGTERM
        late = subprocess.Popen(sleeper)  # started after the signal: it gets it at once
        forwarder.add(late)
        assert late.wait(timeout=10) == -signal.SIGTERM
        assert forwarder.seen == [signal.SIGTERM]
    finally:
        forwarder.restore()
        for p in (first, late):
            if p.poll() is None:
                p.kill()
    assert signal.getsignal(signal.SIGTERM) is not forwarder._forward


def test_preempted_carries_the_step_and_signal():
    e = preempt.Preempted(12, signal=signal.SIGUSR1)
    assert (e.step, e.signal, str(e)) == (12, signal.SIGUSR1, "stopped after step 12")
    assert preempt.EXIT_CODE == 75  # EX_TEMPFAIL: schedulers read it as "try again"


def test_who_launched_a_rank_decides_its_checks_reports_and_end():
    """One value, not four flags: the local launcher checked the config for every rank and
    reads their errors; under torchrun/srun rank 0 checked it and the others check it as they
    join; only a submitit job's rank returns instead of ending its process."""
    assert [preempt.Launched.local.checked(r) for r in (0, 3)] == [True, True]
    for launched in (preempt.Launched.external, preempt.Launched.submitit):
        assert [launched.checked(r) for r in (0, 3)] == [True, False]
        assert not launched.launcher_reports
    assert preempt.Launched.local.launcher_reports
    assert [m for m in preempt.Launched if not m.exits] == [preempt.Launched.submitit]
