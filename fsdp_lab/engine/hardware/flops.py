"""Peak FLOP/s of one device, what MFU divides by, and TF32, which decides which peak applies
to fp32 compute."""

from __future__ import annotations

import logging
import os

import torch

from fsdp_lab.config import Dtype, HardwareConfig, HardwareKind
from fsdp_lab.config.hardware_kinds import hardware_row
from fsdp_lab.config.hardware_profiles import peak_tflops
from fsdp_lab.config.precisions import dtype_row

log = logging.getLogger(__name__)


def set_tf32(kind: HardwareKind, enabled: bool) -> None:
    """precision.tf32: fp32 matmuls and convolutions on TF32 tensor cores (GPU only)."""
    if hardware_row(kind).device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = enabled
        torch.backends.cudnn.allow_tf32 = enabled


def peak_flops(
    cfg: HardwareConfig, kind: HardwareKind, compute: Dtype, *, tf32: bool = False
) -> float | None:
    """Peak FLOP/s of one device for MFU: ``hardware.peak_tflops`` when set, else
    ``config.hardware_profiles.PEAK_TFLOPS`` for a known GPU (the TF32 column for fp32
    compute with ``tf32``); None (MFU not reported) for CPUs and unknown GPUs."""
    if cfg.peak_tflops is not None:
        return cfg.peak_tflops * 1e12
    match hardware_row(kind).device_type:
        case "xla":
            return _tpu_peak_flops(compute)
        case "cuda":
            return _gpu_peak_flops(compute, tf32=tf32)
        case _:
            return None


def _gpu_peak_flops(compute: Dtype, *, tf32: bool) -> float | None:
    """The known GPU's peak at ``compute`` (``config.hardware_profiles.PEAK_TFLOPS``)."""
    name = torch.cuda.get_device_name(0)
    peaks = peak_tflops(name)  # config.hardware_profiles' table: (bf16, tf32, fp32)
    if peaks is not None:
        low_precision, tf32_peak, fp32 = peaks
        if dtype_row(compute).half:
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
    if os.environ.get("PJRT_DEVICE") != "TPU" or not dtype_row(compute).half:
        return None  # XLA's CPU devices; fp32 matmuls on TPUs run as several bf16 passes
    try:
        from torch_xla._internal import tpu

        accelerator = tpu.get_tpu_type()
    except Exception:  # noqa: BLE001 - no metadata server: no MFU, never a failed run
        return None
    return next((t * 1e12 for key, t in TPU_PEAK_TFLOPS if accelerator.startswith(key)), None)
