"""What happens to each FSDP unit before it is sharded: activation checkpointing, then compile.

The order is torchtitan's: checkpoint-wrap a block, compile it, then ``fully_shard`` it, so the
compiled region is the block's own computation and FSDP's all-gathers stay outside it.
Checkpointing wraps a unit in a module whose parameter names gain ``_checkpoint_wrapped_module.``;
torch.distributed's state-dict helpers drop that part, so checkpoints with and without
activation checkpointing hold the same keys and load into each other.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fsdp_lab.config import ActivationCheckpointingConfig, ActivationCheckpointingMode
from fsdp_lab.internals import torch_private

log = logging.getLogger(__name__)

WRAPPER_PREFIX = "_checkpoint_wrapped_module."
AC = ActivationCheckpointingMode


def clean_name(name: str) -> str:
    """A parameter or buffer name as it is without activation-checkpoint wrappers."""
    return name.replace(WRAPPER_PREFIX, "")


def checkpointed_indices(cfg: ActivationCheckpointingConfig, num_units: int) -> list[int]:
    match cfg.mode:
        case ActivationCheckpointingMode.none:
            return []
        case ActivationCheckpointingMode.full | ActivationCheckpointingMode.op:
            return list(range(num_units))
        case ActivationCheckpointingMode.selective:
            return list(range(0, num_units, cfg.every))
        case _:
            raise ValueError(f"unknown activation_checkpointing.mode {cfg.mode}")


def parents(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    out = {}
    for parent in model.modules():
        for name, child in parent.named_children():
            out[id(child)] = (parent, name)
    return out


def apply_activation_checkpointing(
    model: nn.Module, units: list[nn.Module], cfg: ActivationCheckpointingConfig
) -> list[nn.Module]:
    """Replace the chosen units in their parents by checkpoint wrappers; returns the new units
    list (wrappers where wrapped), which is what gets compiled and sharded."""
    chosen = set(checkpointed_indices(cfg, len(units)))
    if not chosen:
        return list(units)
    parents_of = parents(model)
    out = []
    for i, unit in enumerate(units):
        if i not in chosen:
            out.append(unit)
            continue
        parent, name = parents_of[id(unit)]
        # Non-reentrant: works with keyword arguments, FSDP2 hooks and torch.compile; the RNG
        # state is restored for the recomputation, so dropout masks match.
        extra = {"context_fn": keep_every_second_matmul} if cfg.mode is AC.op else {}
        wrapped = torch_private.checkpoint_wrapper(unit, **extra)
        parent.register_module(name, wrapped)
        out.append(wrapped)
    return out


# What activation_checkpointing=op keeps (torchtitan's ``_save_list``): the matmuls' outputs
# (every second one recomputed), attention's (every kernel's), reduce-scatters' and max's.
MATMULS = ("mm", "addmm")
KEPT = (
    "mm",
    "addmm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "max",
)


def keep_every_second_matmul():
    """A checkpoint's context for activation_checkpointing=op: its policy keeps the outputs of
    the operators in ``KEPT`` except every second matmul of the unit's forward (counted anew
    for each forward and its recomputation), and recomputes the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept = {getattr(torch.ops.aten, n).default for n in KEPT if hasattr(torch.ops.aten, n)}
    kept.add(torch_private.reduce_scatter_op())
    matmuls = {getattr(torch.ops.aten, n).default for n in MATMULS}
    counts = {False: 0, True: 0}

    def policy(ctx, func, *args, **kwargs):
        if func in matmuls:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def is_checkpointed(unit: nn.Module) -> bool:
    return torch_private.is_checkpoint_wrapper(unit)


def compile_units(units: list[nn.Module]) -> None:
    """torch.compile each unit in place (its parameter names do not change)."""
    for unit in units:
        unit.compile()
