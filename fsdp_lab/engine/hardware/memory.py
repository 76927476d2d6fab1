"""Host and device memory: glibc's heap, pinned host memory, the peak and current readings
the metrics report, and the profiler's (what it records on this device, the GPU allocator's
history, the out-of-memory observer)."""

from __future__ import annotations

import ctypes
import functools
import resource
import sys
from pathlib import Path

import torch

from fsdp_lab.config import HardwareConfig, HardwareKind
from fsdp_lab.config.hardware_kinds import hardware_row
from fsdp_lab.internals import torch_private

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def set_host_allocator(cfg: HardwareConfig) -> int | None:
    """Fix glibc's mmap threshold for this process (``hardware.malloc_mmap_threshold``), so
    that a freed tensor's memory goes back to the system instead of staying in a fragmented
    heap. The threshold set, or None: not asked for, or not glibc (macOS, musl), where the
    process's own allocator stays."""
    if cfg.malloc_mmap_threshold is None:
        return None
    libc = _glibc()
    if libc is None or libc.mallopt(_M_MMAP_THRESHOLD, cfg.malloc_mmap_threshold) != 1:
        return None
    return cfg.malloc_mmap_threshold


def trim_host_heap() -> bool:
    """Give glibc's free heap pages back to the system (``malloc_trim(0)``: every arena, the
    pages inside the heap too). False where there is no glibc (macOS, musl)."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@functools.cache
def _glibc():
    """glibc, loaded once; None where the C library is another (macOS, musl)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (AttributeError: not glibc)
    except (OSError, AttributeError):
        return None
    return libc


def pin_memory(kind: HardwareKind) -> bool:
    """CPUOffloadPolicy pins host memory for fast H2D copies; pinning needs a GPU."""
    return hardware_row(kind).device_type == "cuda"


# ---- readings -------------------------------------------------------------------------------
def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak: the allocator's on GPU; on Linux CPUs the process's RSS high-water mark
    (VmHWM), reset through /proc/self/clear_refs, so a step's peak is not the load's."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    reset_host_peak()


def reset_host_peak() -> None:
    """Start a new host RSS high-water mark (Linux: VmHWM through /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not permitted: the peak stays the process's lifetime peak
        pass


def host_peak_since_reset_bytes() -> int:
    """The host RSS high-water mark since ``reset_host_peak`` (else the lifetime peak)."""
    return _proc_status_bytes("VmHWM") or host_peak_rss_bytes()


def peak_memory_bytes(device: torch.device) -> int:
    """Allocator peak on GPU; on CPU the process's RSS high-water mark since the last reset (it
    includes the interpreter, imports and libraries, about 400 MB). On tpu the host process's
    too: torch_xla 2.9 reports no memory for the SPMD virtual device."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return host_peak_since_reset_bytes()


def current_memory_bytes(device: torch.device) -> int:
    """Allocated bytes on GPU; on CPU the process's resident set size now."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _proc_status_bytes("VmRSS") or host_peak_rss_bytes()


def host_peak_rss_bytes() -> int:
    """This process's lifetime peak resident set size on the host, whatever the device."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _proc_status_bytes(field: str) -> int | None:
    """A kB field of /proc/self/status (Linux), in bytes; None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---- the profiler ---------------------------------------------------------------------------
def profiler_activities(device: torch.device) -> list:
    """What torch.profiler records on this device: the host's operators, and on a GPU its
    kernels and copies (with their streams)."""
    from torch.profiler import ProfilerActivity

    if device.type == "cuda":
        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    return [ProfilerActivity.CPU]


def start_memory_history(max_entries: int) -> None:
    """GPU: record every allocation and free, with its stack, from now (profile=memory)."""
    torch_private.record_memory_history(max_entries)


def dump_memory_history(pickle_path: Path, html_path: Path | None = None) -> None:
    """GPU: the recorded history as a snapshot (pytorch.org/memory_viz reads it) and, with
    ``html_path``, torch's own HTML view of it (no tool to learn)."""
    torch_private.dump_memory_snapshot(str(pickle_path))
    if html_path is not None:
        html_path.write_text(torch_private.memory_history_html())


def stop_memory_history() -> None:
    torch_private.record_memory_history(None)


def on_out_of_memory(callback) -> None:
    """GPU: ``callback()`` when an allocation fails, before the OutOfMemoryError is raised."""
    torch_private.on_out_of_memory(callback)
