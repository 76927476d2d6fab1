"""The GPU path's decisions, checked without a GPU by faking what torch.cuda reports; the TPU
path's without torch_xla."""

from __future__ import annotations

import pytest
import torch

from fsdp_lab.config import Backend, ConfigError, Dtype, HardwareConfig, HardwareKind
from fsdp_lab.engine.hardware import devices, process_group


@pytest.fixture
def fake_gpus(monkeypatch):
    def install(count: int, bf16: bool = True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16)

    return install


def test_auto_picks_gpu_only_when_cuda_is_there(fake_gpus):
    fake_gpus(0)
    assert devices.resolve_kind(HardwareConfig(kind=HardwareKind.auto)) is HardwareKind.cpu
    with pytest.raises(ConfigError, match="hardware=cpu"):
        devices.resolve_kind(HardwareConfig(kind=HardwareKind.gpu))
    fake_gpus(8)
    assert devices.resolve_kind(HardwareConfig(kind=HardwareKind.auto)) is HardwareKind.gpu
    assert devices.default_nproc_per_node(HardwareKind.gpu) == 8
    assert devices.default_nproc_per_node(HardwareKind.cpu) == 2


def test_gpu_rank_counts(fake_gpus):
    fake_gpus(4)
    devices.check_nproc(HardwareKind.gpu, 4)
    with pytest.raises(ConfigError, match="only 4 GPUs"):
        devices.check_nproc(HardwareKind.gpu, 5)
    devices.check_nproc(HardwareKind.cpu, 16)  # CPU ranks are processes, not devices


def test_gloo_on_gpu_lets_ranks_share_a_gpu_and_nccl_needs_one(fake_gpus, monkeypatch):
    fake_gpus(1)
    with pytest.raises(ConfigError, match=r"hardware\.backend=gloo") as e:
        devices.check_nproc(HardwareKind.gpu, 2, Backend.nccl)
    assert "\n" not in str(e.value)
    devices.check_nproc(HardwareKind.gpu, 2, Backend.gloo)  # both ranks on GPU 0
    assert process_group.backend(HardwareKind.gpu, Backend.gloo) == "gloo"
    assert process_group.backend(HardwareKind.gpu, Backend.nccl) == "cuda:nccl,cpu:gloo"
    for kind in (HardwareKind.cpu, HardwareKind.tpu):
        with pytest.raises(ConfigError, match=r"hardware\.backend=nccl needs hardware=gpu"):
            process_group.backend(kind, Backend.nccl)
        assert process_group.backend(kind, Backend.gloo) == "gloo"
    # Ranks share round-robin: rank r on GPU r mod count.
    monkeypatch.setattr(devices.torch.cuda, "set_device", lambda index: None)
    assert [devices.rank_device(HardwareKind.gpu, r).index for r in range(3)] == [0, 0, 0]
    fake_gpus(2)
    monkeypatch.setattr(devices.torch.cuda, "set_device", lambda index: None)
    assert [devices.rank_device(HardwareKind.gpu, r).index for r in range(3)] == [0, 1, 0]


def test_bf16_needs_a_gpu_that_has_it(fake_gpus):
    fake_gpus(1, bf16=False)
    with pytest.raises(ConfigError, match=r"precision\.param_dtype=bf16"):
        devices.check_dtype(HardwareKind.gpu, Dtype.bf16, "precision.param_dtype")
    devices.check_dtype(HardwareKind.gpu, Dtype.fp16, "precision.param_dtype")
    devices.check_dtype(HardwareKind.cpu, Dtype.bf16, "precision.param_dtype")


def test_cpu_threads_are_split_among_ranks():
    before = torch.get_num_threads()
    try:
        assert devices.set_threads(HardwareConfig(threads_per_rank=3), 2) == 3
        assert torch.get_num_threads() == 3
        assert devices.set_threads(HardwareConfig(), 10_000) == 1
    finally:
        torch.set_num_threads(before)


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
        devices.resolve_kind(HardwareConfig(kind=HardwareKind.tpu))


def test_tpu_with_a_mismatched_torch_names_the_pair(monkeypatch):
    import importlib.metadata
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.9.0")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    with pytest.raises(ConfigError, match=r"torch-xla 2\.9\.0 needs torch 2\.9\.0.*torch 2\.13\.0"):
        devices.resolve_kind(HardwareConfig(kind=HardwareKind.tpu))


def test_tpu_devices_and_processes_without_starting_xla(monkeypatch):
    """On tpu one process drives every device; the device count comes from the environment
    (PJRT CPU) without starting the XLA runtime, which a TPU lets only one process hold."""
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    assert devices.default_nproc_per_node(HardwareKind.tpu) == 4
    assert devices.processes_per_node(HardwareKind.tpu, 4) == 1
    assert devices.processes_per_node(HardwareKind.cpu, 4) == 4
    devices.check_nproc(HardwareKind.tpu, 4)
    with pytest.raises(ConfigError, match="SPMD uses all of them"):
        devices.check_nproc(HardwareKind.tpu, 2)
    assert process_group.backend(HardwareKind.tpu) == "gloo"  # the host processes' own group
    assert process_group.collective_device(torch.device("xla", 0)) == torch.device("cpu")
    assert process_group.collective_device(torch.device("cpu")) == torch.device("cpu")
    assert devices.device_summary(HardwareKind.tpu).startswith(
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


def test_a_cpu_without_native_bf16_is_named_before_a_slow_run(monkeypatch):
    """An AVX2 CPU computes bf16/fp16 matmuls in generic kernels, tens of times slower than
    fp32: the launch warns. Decided by oneDNN's own probe, and only for CPU compute."""
    for dtype, probe in (
        (Dtype.bf16, "_is_mkldnn_bf16_supported"),
        (Dtype.fp16, "_is_mkldnn_fp16_supported"),
    ):
        monkeypatch.setattr(torch.ops.mkldnn, probe, lambda: False, raising=False)
        assert f"no native {dtype.value} matmuls" in devices.slow_cpu_dtype(HardwareKind.cpu, dtype)
        assert devices.slow_cpu_dtype(HardwareKind.gpu, dtype) is None
        monkeypatch.setattr(torch.ops.mkldnn, probe, lambda: True, raising=False)
        assert devices.slow_cpu_dtype(HardwareKind.cpu, dtype) is None
    assert devices.slow_cpu_dtype(HardwareKind.cpu, Dtype.fp32) is None
