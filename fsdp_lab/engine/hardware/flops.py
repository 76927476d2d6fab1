"""Peak FLOP/s of one device, what MFU divides by, and TF32, which decides which peak applies
to fp32 compute."""

from __future__ import annotations

import logging
import os

import torch

from fsdp_lab.config import Dtype, HardwareConfig, HardwareKind

log = logging.getLogger(__name__)


# Dense peak TFLOP/s per GPU from the vendors' datasheets (no sparsity): bf16/fp16 tensor
# cores, TF32 tensor cores, and fp32 without TF32. Matched in order against
# torch.cuda.get_device_name, so the more specific names come first.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0, 378.0, 51.0),
    ("H100 NVL", 835.0, 417.5, 60.0),
    ("H100", 989.0, 494.7, 67.0),
    ("H200", 989.0, 494.7, 67.0),
    ("H800", 989.0, 494.7, 67.0),
    ("B200", 2250.0, 1100.0, 80.0),
    ("A100", 312.0, 156.0, 19.5),
    ("A800", 312.0, 156.0, 19.5),
    ("L40S", 362.0, 183.0, 91.6),
    ("L4", 121.0, 60.0, 30.3),
    ("A10G", 70.0, 35.0, 31.2),
    ("A10", 125.0, 62.5, 31.2),
)


def set_tf32(kind: HardwareKind, enabled: bool) -> None:
    """precision.tf32: fp32 matmuls and convolutions on TF32 tensor cores (GPU only)."""
    if kind is HardwareKind.gpu:
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def peak_flops(
    cfg: HardwareConfig, kind: HardwareKind, compute: Dtype, *, tf32: bool = False
) -> float | None:
    """Peak FLOP/s of one device for MFU: ``hardware.peak_tflops`` when set, else the table
    above for a known GPU (the TF32 column for fp32 compute with ``tf32``); None (MFU not
    reported) for CPUs and unknown GPUs."""
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12
    if kind is HardwareKind.tpu:
        return _tpu_peak_flops(compute)
    if kind is not HardwareKind.gpu:
        return None
    name = torch.cuda.get_device_name(0)
    for key, low_precision, tf32_peak, fp32 in PEAK_TFLOPS:
        if key in name:
            if compute is not Dtype.fp32:
                return low_precision * 1e12
            return (tf32_peak if tf32 else fp32) * 1e12
    log.info("no peak FLOP/s known for %s: MFU not reported (set hardware.peak_tflops)", name)
    return None


# Peak bf16 TFLOP/s per TPU chip (one SPMD device each), from the Cloud TPU docs; matched
# against the accelerator type in the TPU VM's metadata (v5litepod-8, v4-32...).
TPU_PEAK_TFLOPS = (
    ("v5litepod", 197.0),
    ("v5e", 197.0),
    ("v5p", 459.0),
    ("v6e", 918.0),
    ("v4", 275.0),
)


def _tpu_peak_flops(compute: Dtype) -> float | None:
    if os.environ.get("PJRT_DEVICE") != "TPU" or compute is not Dtype.bf16:
        return None  # XLA's CPU devices; fp32 matmuls on TPUs run as several bf16 passes
    try:
        from torch_xla._internal import tpu

        accelerator = tpu.get_tpu_type()
    except Exception:  # noqa: BLE001 - no metadata server: no MFU, never a failed run
        return None
    return next((t * 1e12 for key, t in TPU_PEAK_TFLOPS if accelerator.startswith(key)), None)
