"""Mixed-precision policy and gradient scaling: what the `precision` group maps to."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_lab.config import PrecisionConfig
from fsdp_lab.engine.hardware.devices import TORCH_DTYPES


def build_mp_policy(cfg: PrecisionConfig) -> MixedPrecisionPolicy:
    """FSDP2 casts the all-gathered params to param_dtype; the sharded fp32 params stay the
    master weights the optimizer updates, so only compute and communication change dtype."""
    return MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPES[cfg.param_dtype],
        reduce_dtype=TORCH_DTYPES[cfg.reduce_dtype],
        output_dtype=TORCH_DTYPES[cfg.output_dtype] if cfg.output_dtype else None,
    )


def build_grad_scaler(cfg: PrecisionConfig, device: torch.device):
    """A loss scaler whose unscale and inf-check work on sharded (DTensor) gradients, or None.

    ``ShardedGradScaler`` all-reduces the found-inf flag, so every rank skips the same steps.
    """
    if not cfg.grad_scaler_enabled:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device.type)
