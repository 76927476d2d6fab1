"""Which rank stopped: every rank's heartbeat and last completed step, on the rendezvous store.

A collective that times out tells the ranks that waited only that they waited too long ("Timed
out waiting 20000ms for recv"), not for whom. So each rank writes
``fsdp_lab/heartbeat/<rank>`` = "<wall time> <steps done>" as each step completes (the loop)
and every second (a thread) to the store all ranks already share (the local launcher's;
torchrun's agent's, or rank 0's under srun), over a connection of its own. A rank that is
stopped (SIGSTOP, a frozen node), killed or stuck without the GIL stops beating. Whoever reports
the failure reads the beats: the local launcher, which hosts the store, or else the rank whose
collective timed out.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import threading
import time

INTERVAL_S = 1.0
# A heartbeat this much older than the freshest one: that rank stopped (the others beat until
# their own collective timed out, hardware.timeout_s later).
STALE_S = 5.0
_KEY = "fsdp_lab/heartbeat/{}"
_TIMEOUT = re.compile(r"timed? ?out|timeout", re.IGNORECASE)

_current: Heartbeat | None = None


class Heartbeat:
    """This rank's beat: the last optimizer step its loop completed (on a GPU: issued), sent by
    the loop itself as each step completes (so a rank stopped right after a step cannot report
    the one before it: a thread polling the step lagged two steps behind on a loaded machine)
    and again every interval by a thread, so that a rank that stops beating is seen to."""

    def __init__(self, store, rank: int, interval_s: float = INTERVAL_S) -> None:
        self.store, self.rank, self.interval_s = store, rank, interval_s
        self._step = 0
        # After a failed send (the store's host gone) the loop leaves sending to the thread
        # until the thread gets through again: the loop never retries a broken store each step.
        self._inline = True
        self._lock = threading.Lock()  # one sender at a time: a late resend never goes back
        self._thread = threading.Thread(target=self._run, name="fsdp_lab-heartbeat", daemon=True)

    def step_done(self, step: int) -> None:
        """Record ``step`` as completed and send it at once (~10 us on a local store), unless
        the thread is sending (it then sends this step, or the next beat does): the loop never
        waits on the store."""
        self._step = step
        if self._inline and self._lock.acquire(blocking=False):
            try:
                self._inline = self._send_locked()
            finally:
                self._lock.release()

    def _send_locked(self) -> bool:
        try:
            self.store.set(_KEY.format(self.rank), f"{time.time():.3f} {self._step}")
        except Exception:  # noqa: BLE001 - a beat lost is a beat lost; the run goes on
            return False
        return True

    def beat(self) -> None:
        """The thread's beat: the last step again, now."""
        with self._lock:
            if self._send_locked():
                self._inline = True

    def _run(self) -> None:
        while True:
            self.beat()
            time.sleep(self.interval_s)


def start(rank: int) -> Heartbeat | None:
    """Start this rank's heartbeat on the default process group's store (None without one)."""
    global _current
    import torch.distributed as dist

    from fsdp_lab.internals import torch_private

    store = torch_private.default_store()
    while isinstance(store, dist.PrefixStore):  # the group's prefixes: the keys stay plain
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        return None
    own = dist.TCPStore(
        store.host, store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )
    _current = Heartbeat(own, rank)
    _current._thread.start()
    return _current


def current() -> Heartbeat | None:
    return _current


def read(store, world_size: int) -> dict[int, tuple[float, int]]:
    """rank -> (time of its last beat, steps it had done), for the ranks that beat at all."""
    beats = {}
    for rank in range(world_size):
        key = _KEY.format(rank)
        with contextlib.suppress(Exception):
            if store.check([key]):
                t, step = store.get(key).decode().split()
                beats[rank] = (float(t), int(step))
    return beats


def is_timeout(message: str) -> bool:
    return bool(_TIMEOUT.search(message))


def describe_stall(
    beats: dict[int, tuple[float, int]],
    world_size: int,
    *,
    waiting: int | None,
    exclude: frozenset[int] = frozenset(),
) -> str | None:
    """The rank that stopped first, in one line, if one stopped beating before the others
    (ranks in ``exclude`` ended on their own, so they beat no more); ``waiting`` is the rank
    that timed out waiting for it."""
    if not beats:
        return None
    freshest = max(t for t, _ in beats.values())
    never = [r for r in range(world_size) if r not in beats and r not in exclude]
    stale = [r for r, (t, _) in beats.items() if freshest - t > STALE_S and r not in exclude]
    if never:
        what = f"rank {never[0]} never sent a heartbeat (it stopped while starting)"
    elif stale:
        rank = min(stale, key=lambda r: beats[r][0])
        t, step = beats[rank]
        what = (
            f"rank {rank} stopped responding after step {step} "
            f"(no heartbeat for {freshest - t:.0f} s)"
        )
    else:
        return None
    if waiting is not None:
        what += f"; rank {waiting} timed out waiting for it"
    return what
