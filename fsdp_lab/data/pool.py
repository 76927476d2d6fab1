"""The preparing processes: started, fed one task at a time, watched, and stopped; and the
progress of their reading (a bar on a terminal, a line a minute in a log).

Each is ``python -m fsdp_lab.data.worker`` (a fresh interpreter that imports no torch or
transformers: about 100 MB). The launcher samples their memory every second, so a process the
kernel kills (the out-of-memory killer's SIGKILL) is named in one line with its signal, its task
and its last RSS, instead of a preparation that never ends or a terminal that just closes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

from fsdp_lab.config import ConfigError
from fsdp_lab.data.tasks import Task

log = logging.getLogger(__name__)
REPORT_S = 60.0  # a log line this often where no progress bar is drawn (not a terminal)


class Progress:
    """Input bytes read: a tqdm bar (MB/s, ETA) on a terminal, else a log line a minute."""

    def __init__(self, total: int | None, done: int = 0) -> None:
        self.total, self.done, self.start = total, done, time.monotonic()
        self.said = self.start
        self.initial = done
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total, initial=done, desc="data", unit="B", unit_scale=True,
                unit_divisor=1 << 20, file=sys.stderr, dynamic_ncols=True,
            )  # fmt: skip

    def update(self, n: int) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif time.monotonic() - self.said > REPORT_S:
            self.said = time.monotonic()
            elapsed = max(1e-9, time.monotonic() - self.start)
            rate = (self.done - self.initial) / elapsed  # bytes/s
            share, eta = "", ""
            if self.total:
                share = f" of {self.total / 1e6:,.0f} MB"
                eta = f", {(self.total - self.done) / max(rate, 1e-9) / 60:.0f} min to go"
            log.info("data: %.0f MB%s read, %.2f MB/s%s", self.done / 1e6, share, rate / 1e6, eta)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Stopped(ConfigError):
    """A preparation stopped by something other than its input (a killed process, a full disk):
    what it finished is kept for the next run."""


def die_with_parent() -> None:
    """In a new child process: on Linux, die with the process that started it. A launcher killed
    by SIGKILL or the OOM killer must not leave its children running as orphans."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def memory_of(pid: int) -> tuple[int, int]:
    """(resident, peak resident) bytes of a live process on Linux; (0, 0) where unknown."""
    found = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    found[line[:5]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return found.get("VmRSS", 0), found.get("VmHWM", 0)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GB" if n >= 2**30 else f"{n / 2**20:.0f} MB"


class Worker:
    def __init__(self, setup: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fsdp_lab.data.worker", str(setup)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            preexec_fn=die_with_parent,
        )
        self.buffer, self.task, self.rss, self.peak = b"", None, 0, 0

    def send(self, task: Task) -> None:
        self.sample()  # seen before each task: a process killed in it has a last size
        self.task = task
        self.proc.stdin.write((json.dumps(task.to_json()) + "\n").encode())
        self.proc.stdin.flush()

    def lines(self) -> list[bytes] | None:
        """Complete lines read so far; None at end of output (the process ended)."""
        chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
        if not chunk:
            return None
        self.buffer += chunk
        *complete, self.buffer = self.buffer.split(b"\n")
        return complete

    def sample(self) -> None:
        rss, peak = memory_of(self.proc.pid)
        if rss:
            self.rss, self.peak = rss, max(self.peak, peak)

    def death(self) -> str:
        """One line for a process that ended without answering its task."""
        code = self.proc.wait()
        how = (
            f"was killed by {signal.Signals(-code).name}"
            if code < 0
            else f"exited with code {code}"
        )
        where = self.task.segments[0].path if self.task and self.task.segments else "?"
        memory = (
            f", last seen at {_size(self.rss)} RSS (peak {_size(self.peak)})" if self.rss else ""
        )
        oom = (
            ": most likely the kernel's out-of-memory killer (see dmesg); lower data.num_proc "
            "or free memory, then run again (finished shards are kept)"
            if code == -signal.SIGKILL
            else "; its error is above"
        )
        return (
            f"data: a preparing process (pid {self.proc.pid}, reading {where}) {how}{memory}{oom}"
        )


class Pool:
    """``n`` preparing processes; ``run`` yields each task's result as it completes."""

    def __init__(self, n: int, setup: Path, *, threads: int = 1) -> None:
        env = {
            **os.environ,
            "RAYON_NUM_THREADS": str(threads),  # the tokenizer's threads in each process
            "TOKENIZERS_PARALLELISM": "true" if threads > 1 else "false",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        self.workers = [Worker(setup, env) for _ in range(n)]

    def run(self, tasks: list[Task], progress: Callable[[int], None]) -> Iterator[dict]:
        todo, selector = deque(tasks), selectors.DefaultSelector()
        for w in self.workers:
            selector.register(w.proc.stdout, selectors.EVENT_READ, w)
            if todo:
                w.send(todo.popleft())
        busy, sampled = sum(w.task is not None for w in self.workers), 0.0
        while busy:
            if time.monotonic() - sampled > 1.0:
                for w in self.workers:
                    w.sample()
                sampled = time.monotonic()
            for key, _ in selector.select(timeout=1.0):
                w: Worker = key.data
                lines = w.lines()
                if lines is None:
                    raise Stopped(w.death())
                for line in lines:
                    message = json.loads(line)
                    if "progress" in message:
                        progress(message["progress"])
                    elif "error" in message:
                        raise (Stopped if message["kept"] else ConfigError)(message["error"])
                    else:
                        yield message["result"]
                        w.task = todo.popleft() if todo else None
                        if w.task is not None:
                            w.send(w.task)
                        busy -= w.task is None

    def close(self) -> None:
        """Stop every process: done ones see their input end, the others are terminated."""
        for w in self.workers:
            if w.proc.poll() is None and w.task is not None:
                w.proc.terminate()
            with contextlib.suppress(OSError):  # a process that died took its pipe with it
                w.proc.stdin.close()
        deadline = time.monotonic() + 5
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            w.proc.stdout.close()
