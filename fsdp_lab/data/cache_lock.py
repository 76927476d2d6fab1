"""The lock of a cache entry: the one process that prepares it holds ``tokens-<key>.lock``
(an flock) and writes who it is there; the others wait, say whom for, and find the entry made.
The kernel releases a dead holder's lock, so the next process takes over."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from fsdp_lab.data.cache import is_complete

log = logging.getLogger(__name__)

WAIT_REPORT_S = 60.0
HOLDER_NAMED_S = 5.0


class CacheLock:
    """An exclusive flock on ``path``; the holder writes who it is into the file."""

    def __init__(self, path: Path) -> None:
        self.path, self.fd = path, None
        self.private = False  # the filesystem cannot lock: this process builds apart

    def acquire(self, entry: Path) -> bool:
        """Hold the lock (True), or return False once ``entry`` is complete (someone else made
        it while this process waited). Says who it waits for, now and every minute."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        said, began = 0.0, time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if is_complete(entry):
                    os.close(fd)
                    return False
                who = self._holder()
                # the holder writes its pid just after it locks: give it a moment to be named
                named = who is not None or time.monotonic() - began > HOLDER_NAMED_S
                if named and time.monotonic() - said > WAIT_REPORT_S:
                    log.info("data: waiting for %s to prepare %s", who or "another process", entry)
                    said = time.monotonic()
                time.sleep(0.5)
                continue
            except OSError as e:  # a filesystem without locks (some Lustre mounts)
                if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                log.warning(
                    "data: %s cannot be locked (%s); this process prepares its own copy, and "
                    "concurrent runs of the same corpus each do the same",
                    self.path,
                    e.strerror,
                )
                self.private = True
            self.fd = fd
            break
        if not self.private:
            stopped = self._holder()
            if stopped is not None and not is_complete(entry):
                log.info("data: %s stopped preparing %s; continuing it here", stopped, entry)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_owner()).encode(), 0)
        return True

    def _holder(self) -> str | None:
        try:
            owner = json.loads(self.path.read_text() or "null")
        except (OSError, ValueError):
            return None
        if not owner:
            return None
        age = time.time() - owner["since"]
        return f"pid {owner['pid']} on {owner['host']} (for {age:.0f} s)"

    def release(self) -> None:
        if self.fd is not None:
            if not self.private:
                os.ftruncate(self.fd, 0)  # a lock file with an owner in it means a dead owner
            os.close(self.fd)  # closing releases the flock
            self.fd = None


def _owner() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
