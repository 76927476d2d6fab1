"""AdamW over the (sharded) parameters and the warmup + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from fsdp_lab.config import ConfigError, HardwareKind, OptimConfig, OptimImpl
from fsdp_lab.config.hardware_kinds import Feature, hardware_row


def resolve_implementation(
    cfg: OptimConfig, device: HardwareKind, *, grad_scaler: bool
) -> OptimImpl:
    """auto: fused where the device's row runs it (``Feature.fused_optimizer``; measured 3-4x
    faster than foreach for a 13M model's AdamW step on one CPU thread), else foreach, as with
    the fp16 grad scaler (FSDP2's ShardedGradScaler hands the optimizer a found-inf flag of
    shape [1], which torch's fused AdamW rejects). fused where the row refuses it was refused
    by the rules (``config.rules.refuse_for_hardware``) before any rank started."""
    if cfg.implementation is OptimImpl.auto:
        fused = hardware_row(device).runs(Feature.fused_optimizer) and not grad_scaler
        return OptimImpl.fused if fused else OptimImpl.foreach
    if cfg.implementation is OptimImpl.fused and grad_scaler:
        raise ConfigError(
            "optim.implementation=fused with precision.grad_scaler_enabled=true "
            "(fp16): FSDP2's sharded grad scaler does not drive torch's fused "
            "AdamW; use optim.implementation=foreach (or auto)"
        )
    return cfg.implementation


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, *, implementation: OptimImpl
) -> torch.optim.Optimizer:
    """Decay matrices only; norms and biases (1-D) are not decayed, as in GPT/Llama recipes.
    ``implementation`` is resolved (``resolve_implementation``): fused, foreach or for_loop.
    A fused AdamW also takes the fp16 grad scaler's unscaling and inf check on the device."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # A rank may hold none of one kind (a pipeline stage of the embedding alone): an empty
    # group carries nothing, and DCP cannot map one onto a checkpoint's groups.
    groups = [g for g in groups if g["params"]] or groups[:1]
    match implementation:
        case OptimImpl.fused:
            kernels = {"fused": True}
        case OptimImpl.foreach:
            kernels = {"foreach": True}
        case OptimImpl.for_loop:
            kernels = {"foreach": False}
        case _:
            raise ValueError(f"unresolved optim.implementation {implementation}")
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kernels
    )


def lr_factor(step: int, *, warmup_steps: int, max_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, *, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step, warmup_steps=cfg.warmup_steps, max_steps=max_steps, min_lr_ratio=cfg.min_lr_ratio
        ),
    )
