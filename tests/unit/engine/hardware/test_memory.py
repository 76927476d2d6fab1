"""Memory readings on the host (the CPU path's peak is the process's high-water mark), pinned
memory, and glibc's heap giving freed tensors back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_lab.config import HardwareKind
from fsdp_lab.engine.hardware import memory


def test_host_memory_is_pinned_on_gpu_only():
    assert memory.pin_memory(HardwareKind.gpu) and not memory.pin_memory(HardwareKind.cpu)


def test_peak_memory_on_cpu_is_the_process_high_water_mark():
    cpu = torch.device("cpu")
    before = memory.peak_memory_bytes(cpu)
    assert before >= memory.current_memory_bytes(cpu)
    grown = torch.ones(before + 96 * 2**20, dtype=torch.uint8)  # touched: resident beyond the peak
    assert memory.peak_memory_bytes(cpu) >= before + 96 * 2**20
    del grown


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only")
def test_cpu_peak_memory_resets_so_a_step_peak_is_not_an_earlier_one():
    cpu = torch.device("cpu")
    big = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    high = memory.peak_memory_bytes(cpu)
    del big
    memory.reset_peak_memory(cpu)
    after_reset = memory.peak_memory_bytes(cpu)
    assert after_reset < high - 32 * 2**20
    assert abs(after_reset - memory.current_memory_bytes(cpu)) < 8 * 2**20


HEAP_PROBE = """
import sys, torch
from fsdp_lab.config import HardwareConfig
from fsdp_lab.engine.hardware import memory

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

cfg = HardwareConfig(malloc_mmap_threshold=int(sys.argv[1]) or None)
assert memory.set_host_allocator(cfg) == cfg.malloc_mmap_threshold
big = torch.ones(6 * 2**20)  # 24 MiB, mapped; freed, it raises glibc's threshold to 24 MiB
del big
base = rss()
t = torch.ones(4 * 2**20)  # 16 MiB: from the heap under glibc's own threshold, mapped under ours
del t
print(rss() - base)
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmRSS")
@pytest.mark.parametrize("threshold,returned", [(131072, True), (0, False)])
def test_a_freed_tensor_goes_back_to_the_system_with_the_fixed_threshold(threshold, returned):
    """glibc raises its mmap threshold to the largest block freed, so a later tensor comes from
    the heap and stays resident after it is freed (0: null, glibc's own, the test's control)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", HEAP_PROBE, str(threshold)],
        capture_output=True,
        text=True,
        check=True,
    )
    kept = int(out.stdout.split()[-1])
    if returned:
        assert kept < 4 * 2**20, kept
    else:
        assert kept > 12 * 2**20, kept  # glibc kept the 16 MiB
