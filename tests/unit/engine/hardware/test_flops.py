"""Peak FLOP/s for MFU, and TF32."""

from __future__ import annotations

import pytest
import torch

from fsdp_lab.config import Dtype, HardwareConfig, HardwareKind
from fsdp_lab.engine.hardware import flops


@pytest.mark.parametrize(
    "compute,tf32,peak",
    [(Dtype.bf16, True, 989.0), (Dtype.fp32, True, 494.7), (Dtype.fp32, False, 67.0)],
)
def test_mfu_peak_follows_the_compute_dtype_and_tf32(monkeypatch, compute, tf32, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    got = flops.peak_flops(HardwareConfig(), HardwareKind.gpu, compute, tf32=tf32)
    assert got == peak * 1e12


def test_tf32_is_set_on_gpu_only(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    flops.set_tf32(HardwareKind.cpu, True)
    assert torch.backends.cuda.matmul.allow_tf32 is False
    flops.set_tf32(HardwareKind.gpu, True)
    assert torch.backends.cuda.matmul.allow_tf32 is True
    flops.set_tf32(HardwareKind.gpu, False)
    assert torch.backends.cuda.matmul.allow_tf32 is False
