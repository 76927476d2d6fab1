"""This machine's measured profile: which one a run, plan or tune reads (one per machine,
ranks, threads, dtype and torch version), where it is cached, when it is stale, and its
measuring on a run's first prediction (``ensure``), a few seconds of ``fsdp-lab calibrate``.

No uncalibrated figure reaches a user as a comparison: without a profile of this machine a
run says it is unmeasured instead of printing a ratio.
"""

from __future__ import annotations

import fcntl
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path

from fsdp_lab.config import ConfigError, HardwareKind
from fsdp_lab.config.hardware_profiles import PROFILE_VERSION, DeviceProfile, read_profile

STALE_DAYS = 30  # a profile older than this is measured again (drivers, BIOS, neighbours move)


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
    if kind is HardwareKind.gpu:
        from fsdp_lab.engine.hardware import devices

        return devices.device_summary(kind).split(" x ", 1)[-1]
    return f"{_cpu_model()} x{os.cpu_count()}"


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
    return Path(cfg.hardware.profile_cache).expanduser() / f"{key}.json"


def cached(cfg, topo) -> DeviceProfile | None:
    """This machine's profile for these ranks, or None (never measured, or stale)."""
    path = cache_path(cfg, key_of(cfg, topo))
    if not path.is_file() or time.time() - path.stat().st_mtime > STALE_DAYS * 86400:
        return None
    try:
        return read_profile(path)
    except ConfigError:
        return None


def ensure(cfg, topo, measure: Callable[[], DeviceProfile], *, log=print) -> DeviceProfile | None:
    """The cached profile, else ``measure()``'s (``calibrate.quick``: a few seconds), cached;
    None where another process is measuring this machine right now (measuring beside it would
    measure the two of them)."""
    from fsdp_lab.config.hardware_profiles import write_profile

    profile = cached(cfg, topo)
    if profile is not None:
        return profile
    path = cache_path(cfg, key_of(cfg, topo))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        profile = cached(cfg, topo)  # measured while this waited
        if profile is not None:
            return profile
        start = time.perf_counter()
        profile = measure()
        write_profile(profile, path)
        log(
            f"measured this machine for the step prediction in {time.perf_counter() - start:.0f}"
            f" s, once ({path}; fsdp-lab calibrate measures longer)"
        )
    return profile
