"""This machine's measured profile: which one a run, plan or tune reads (one per machine,
ranks, threads, dtype and torch version), where it is cached, when it is stale, and its
measuring on a run's first prediction (``ensure``), a few seconds of ``fsdp-lab calibrate``.

No uncalibrated figure reaches a user as a comparison: without a profile of this machine a
run says it is unmeasured instead of printing a ratio.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import platform
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from fsdp_lab.config import ConfigError, HardwareKind
from fsdp_lab.config.hardware import profile_dir
from fsdp_lab.config.hardware_kinds import hardware_row
from fsdp_lab.config.hardware_profiles import (
    PROFILE_VERSION,
    DeviceProfile,
    read_profile,
    write_profile,
)

STALE_DAYS = 30  # a profile older than this is measured again (drivers, BIOS, neighbours move)
RETRY_AFTER_S = 86400  # a run's measuring that failed is not tried again for a day


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(kind: HardwareKind) -> str:
    """The device as the cache names it: the GPU's model, or the CPU's with its cores."""
    if not hardware_row(kind).host:
        from fsdp_lab.engine.hardware import devices

        return devices.device_summary(kind).split(" x ", 1)[-1]
    return f"{_cpu_model()} x{cpu_count()}"


def cpu_count() -> int:
    """The cores this process may run on (a container's or taskset's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def key_of(cfg, topo) -> str:
    """The profile's name in the cache: this host and device, the ranks per node and threads,
    the compute dtype, torch's version and the profile format."""
    import torch

    threads = cfg.hardware.threads_per_rank or "auto"
    parts = [
        platform.node(),
        topo.device.name,
        device_name(topo.device),
        f"{topo.nproc_per_node}r",
        f"{threads}t",
        cfg.precision.param_dtype.name,
        f"torch{torch.__version__}",
        f"v{PROFILE_VERSION}",
    ]
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", "-".join(parts))[:200]


def cache_path(cfg, key: str) -> Path:
    return profile_dir(cfg.hardware) / f"{key}.json"


def _age_s(profile: DeviceProfile, path: Path) -> float:
    """Seconds since the profile was measured (its own date; a copied file keeps it)."""
    date = (profile.measured or {}).get("date")
    try:
        return time.time() - time.mktime(time.strptime(date, "%Y-%m-%d %H:%M:%S"))
    except (TypeError, ValueError):
        return time.time() - path.stat().st_mtime


def cached(cfg, topo) -> DeviceProfile | None:
    """This machine's profile for these ranks, or None (never measured, or stale)."""
    path = cache_path(cfg, key_of(cfg, topo))
    try:
        profile = read_profile(path) if path.is_file() else None
    except ConfigError:
        return None
    if profile is None or _age_s(profile, path) > STALE_DAYS * 86400:
        return None
    return profile


@contextlib.contextmanager
def measuring(path: Path, *, wait: bool, log=print) -> Iterator[bool]:
    """Hold the lock on measuring this machine (``path``'s profile): yields False where
    another process holds it and ``wait`` is False (measuring beside it would measure the two
    of them); else waits for it, saying so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            log(f"another process is measuring this machine ({path.name}); waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield True


def failed_path(path: Path) -> Path:
    return path.with_suffix(".failed")


def ensure(cfg, topo, measure: Callable[[], DeviceProfile], *, log=print) -> DeviceProfile | None:
    """The cached profile, else ``measure()``'s (``calibrate.quick``: a few seconds), cached.
    None, said in ``log``, where another process is measuring this machine now, or measuring
    it failed within the day (a ``.failed`` note beside the profile; ``fsdp-lab calibrate``
    tries again at once). A failure raises ConfigError, once."""
    profile = cached(cfg, topo)
    if profile is not None:
        return profile
    path = cache_path(cfg, key_of(cfg, topo))
    failed = failed_path(path)
    if failed.is_file() and time.time() - failed.stat().st_mtime < RETRY_AFTER_S:
        reason = failed.read_text(errors="replace").strip()
        log(
            f"this machine is unmeasured: measuring it failed within the day ({reason}); "
            f"fsdp-lab calibrate tries again (or delete {failed})"
        )
        return None
    with measuring(path, wait=False) as held:
        if not held:
            log(
                "no predicted step: another process is measuring this machine now "
                f"({path.with_suffix('.lock')}); the next run reads its profile"
            )
            return None
        profile = cached(cfg, topo)  # measured between this call's look and its lock
        if profile is not None:
            return profile
        start = time.perf_counter()
        try:
            profile = measure()
        except Exception as e:
            failed.write_text(f"{type(e).__name__}: {e}\n")
            raise ConfigError(f"measuring this machine for the step prediction failed: {e}") from e
        write_profile(profile, path)
        failed.unlink(missing_ok=True)
        log(
            f"measured this machine for the step prediction in {time.perf_counter() - start:.0f}"
            f" s, once ({path}; fsdp-lab calibrate measures longer)"
        )
    return profile
