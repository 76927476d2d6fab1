"""The GPU path's decisions, checked without a GPU by faking what torch.cuda reports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fsdp_lab.config import Backend, ConfigError, Dtype, HardwareConfig, HardwareKind
from fsdp_lab.engine import hardware


@pytest.fixture
def fake_gpus(monkeypatch):
    def install(count: int, bf16: bool = True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)

    return install


def test_auto_picks_gpu_only_when_cuda_is_there(fake_gpus):
    fake_gpus(0)
    assert hardware.resolve_kind(HardwareConfig(kind=HardwareKind.auto)) is HardwareKind.cpu
    with pytest.raises(ConfigError, match="hardware=cpu"):
        hardware.resolve_kind(HardwareConfig(kind=HardwareKind.gpu))
    fake_gpus(8)
    assert hardware.resolve_kind(HardwareConfig(kind=HardwareKind.auto)) is HardwareKind.gpu
    assert hardware.default_nproc_per_node(HardwareKind.gpu) == 8
    assert hardware.default_nproc_per_node(HardwareKind.cpu) == 2


def test_gpu_backend_pinning_and_rank_counts(fake_gpus):
    fake_gpus(4)
    assert hardware.backend(HardwareKind.gpu) == "cuda:nccl,cpu:gloo"  # gloo for offloaded grads
    assert hardware.backend(HardwareKind.cpu) == "gloo"
    assert hardware.pin_memory(HardwareKind.gpu) and not hardware.pin_memory(HardwareKind.cpu)
    hardware.check_nproc(HardwareKind.gpu, 4)
    with pytest.raises(ConfigError, match="only 4 GPUs"):
        hardware.check_nproc(HardwareKind.gpu, 5)
    hardware.check_nproc(HardwareKind.cpu, 16)  # CPU ranks are processes, not devices


def test_gloo_on_gpu_lets_ranks_share_a_gpu_and_nccl_needs_one(fake_gpus, monkeypatch):
    fake_gpus(1)
    with pytest.raises(ConfigError, match=r"hardware\.backend=gloo") as e:
        hardware.check_nproc(HardwareKind.gpu, 2, Backend.nccl)
    assert "\n" not in str(e.value)
    hardware.check_nproc(HardwareKind.gpu, 2, Backend.gloo)  # both ranks on GPU 0
    assert hardware.backend(HardwareKind.gpu, Backend.gloo) == "gloo"
    assert hardware.backend(HardwareKind.gpu, Backend.nccl) == "cuda:nccl,cpu:gloo"
    for kind in (HardwareKind.cpu, HardwareKind.tpu):
        with pytest.raises(ConfigError, match=r"hardware\.backend=nccl needs hardware=gpu"):
            hardware.backend(kind, Backend.nccl)
        assert hardware.backend(kind, Backend.gloo) == "gloo"
    # Ranks share round-robin: rank r on GPU r mod count.
    monkeypatch.setattr(hardware.torch.cuda, "set_device", lambda index: None)
    assert [hardware.rank_device(HardwareKind.gpu, r).index for r in range(3)] == [0, 0, 0]
    fake_gpus(2)
    monkeypatch.setattr(hardware.torch.cuda, "set_device", lambda index: None)
    assert [hardware.rank_device(HardwareKind.gpu, r).index for r in range(3)] == [0, 1, 0]


def test_bf16_needs_a_gpu_that_has_it(fake_gpus):
    fake_gpus(1, bf16=False)
    with pytest.raises(ConfigError, match=r"precision\.param_dtype=bf16"):
        hardware.check_dtype(HardwareKind.gpu, Dtype.bf16, "precision.param_dtype")
    hardware.check_dtype(HardwareKind.gpu, Dtype.fp16, "precision.param_dtype")
    hardware.check_dtype(HardwareKind.cpu, Dtype.bf16, "precision.param_dtype")


def test_cpu_threads_are_split_among_ranks():
    before = torch.get_num_threads()
    try:
        assert hardware.set_threads(HardwareConfig(threads_per_rank=3), 2) == 3
        assert torch.get_num_threads() == 3
        assert hardware.set_threads(HardwareConfig(), 10_000) == 1
    finally:
        torch.set_num_threads(before)


def test_peak_memory_on_cpu_is_the_process_high_water_mark():
    cpu = torch.device("cpu")
    before = hardware.peak_memory_bytes(cpu)
    assert before >= hardware.current_memory_bytes(cpu)
    grown = torch.ones(before + 96 * 2**20, dtype=torch.uint8)  # touched: resident beyond the peak
    assert hardware.peak_memory_bytes(cpu) >= before + 96 * 2**20
    del grown


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux only")
def test_cpu_peak_memory_resets_so_a_step_peak_is_not_an_earlier_one():
    cpu = torch.device("cpu")
    big = torch.ones(64 * 2**20, dtype=torch.uint8)  # 64 MiB, touched
    high = hardware.peak_memory_bytes(cpu)
    del big
    hardware.reset_peak_memory(cpu)
    after_reset = hardware.peak_memory_bytes(cpu)
    assert after_reset < high - 32 * 2**20
    assert abs(after_reset - hardware.current_memory_bytes(cpu)) < 8 * 2**20


def _solo_work_rank(rank: int, port: int, result_dir: str) -> None:
    import datetime
    import os
    import time

    import torch
    import torch.distributed as dist

    from fsdp_lab.engine import hardware

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    if rank == 0:
        time.sleep(4)  # rank 0's solo work outlasts the 2 s collective timeout
    hardware.after_rank0("solo")
    t = torch.tensor([float(rank == 0)])
    dist.broadcast(t, src=0)
    Path(f"{result_dir}/rank{rank}").write_text(str(t.item()))
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_wait_for_rank0_solo_work_beyond_the_collective_timeout(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_solo_work_rank, args=(port, str(tmp_path)), nprocs=2)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["1.0", "1.0"]


def test_tpu_without_torch_xla_names_the_install(monkeypatch):
    """This environment (torch 2.13) has no torch_xla: hardware=tpu says what to install."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch_xla" else real(name, *a),
    )
    with pytest.raises(ConfigError, match=r"pip install 'fsdp_lab\[tpu\]'.*torch==2.9.0"):
        hardware.resolve_kind(HardwareConfig(kind=HardwareKind.tpu))


def test_tpu_with_a_mismatched_torch_names_the_pair(monkeypatch):
    import importlib.metadata
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.9.0")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    with pytest.raises(ConfigError, match=r"torch-xla 2\.9\.0 needs torch 2\.9\.0.*torch 2\.13\.0"):
        hardware.resolve_kind(HardwareConfig(kind=HardwareKind.tpu))


def test_tpu_devices_and_processes_without_starting_xla(monkeypatch):
    """On tpu one process drives every device; the device count comes from the environment
    (PJRT CPU) without starting the XLA runtime, which a TPU lets only one process hold."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    assert hardware.default_nproc_per_node(HardwareKind.tpu) == 4
    assert hardware.processes_per_node(HardwareKind.tpu, 4) == 1
    assert hardware.processes_per_node(HardwareKind.cpu, 4) == 4
    hardware.check_nproc(HardwareKind.tpu, 4)
    with pytest.raises(ConfigError, match="SPMD uses all of them"):
        hardware.check_nproc(HardwareKind.tpu, 2)
    assert hardware.backend(HardwareKind.tpu) == "gloo"  # the host processes' own group
    assert hardware.collective_device(torch.device("xla", 0)) == torch.device("cpu")
    assert hardware.collective_device(torch.device("cpu")) == torch.device("cpu")
    assert hardware.device_summary(HardwareKind.tpu).startswith(
        "tpu: 4 XLA devices (PJRT_DEVICE=CPU)"
    )


def test_tpu_end_to_end_without_torch_xla(tmp_path):
    """The user's view in an environment without torch_xla: one line, exit 2, nothing written."""
    from conftest import train

    if importlib_util_has("torch_xla"):
        pytest.skip("torch_xla is installed here: tests/integration/test_tpu.py runs hardware=tpu")
    proc = train(tmp_path / "run", "hardware=tpu", timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fsdp_lab: error:")]
    assert len(errors) == 1 and "hardware=tpu needs torch_xla" in errors[0], proc.stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def importlib_util_has(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.parametrize(
    "compute,tf32,peak",
    [(Dtype.bf16, True, 989.0), (Dtype.fp32, True, 494.7), (Dtype.fp32, False, 67.0)],
)
def test_mfu_peak_follows_the_compute_dtype_and_tf32(fake_gpus, monkeypatch, compute, tf32, peak):
    fake_gpus(1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    got = hardware.peak_flops(HardwareConfig(), HardwareKind.gpu, compute, tf32=tf32)
    assert got == peak * 1e12


def test_tf32_is_set_on_gpu_only(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    hardware.set_tf32(HardwareKind.cpu, True)
    assert torch.backends.cuda.matmul.allow_tf32 is False
    hardware.set_tf32(HardwareKind.gpu, True)
    assert torch.backends.cuda.matmul.allow_tf32 is True
    hardware.set_tf32(HardwareKind.gpu, False)
    assert torch.backends.cuda.matmul.allow_tf32 is False


def test_a_cpu_without_native_bf16_is_named_before_a_slow_run(monkeypatch):
    """An AVX2 CPU computes bf16/fp16 matmuls in generic kernels, tens of times slower than
    fp32: the launch warns. Decided by oneDNN's own probe, and only for CPU compute."""
    for dtype, probe in (
        (Dtype.bf16, "_is_mkldnn_bf16_supported"),
        (Dtype.fp16, "_is_mkldnn_fp16_supported"),
    ):
        monkeypatch.setattr(torch.ops.mkldnn, probe, lambda: False, raising=False)
        assert f"no native {dtype.value} matmuls" in hardware.slow_cpu_dtype(
            HardwareKind.cpu, dtype
        )
        assert hardware.slow_cpu_dtype(HardwareKind.gpu, dtype) is None
        monkeypatch.setattr(torch.ops.mkldnn, probe, lambda: True, raising=False)
        assert hardware.slow_cpu_dtype(HardwareKind.cpu, dtype) is None
    assert hardware.slow_cpu_dtype(HardwareKind.cpu, Dtype.fp32) is None


HEAP_PROBE = """
import sys, torch
from fsdp_lab.config import HardwareConfig
from fsdp_lab.engine import hardware

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

cfg = HardwareConfig(malloc_mmap_threshold=int(sys.argv[1]) or None)
assert hardware.set_host_allocator(cfg) == cfg.malloc_mmap_threshold
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
