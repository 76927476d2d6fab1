"""The losses, one row each: the only place that says what a loss needs and where it runs.

``train.loss_code`` holds each loss's code (a registry from kind to implementation) and
``train.loss`` resolves loss=auto; the rules, the plan and the launch checks read this
table, and nothing else dispatches on a loss's name. A new loss is a ``LossKind``, a row
here, its implementation in ``train.loss_code.FUSED_LOSSES`` (from the hidden states and
the head's weight) or ``train.loss_code.LOGIT_LOSSES`` (from the model's logits), and a
``conf/loss/`` file.

| loss.kind | fused | package           | device   | hardware=tpu | plan's memory model |
| hf        | no    |                   | any      | yes          | its own             |
| z_loss    | no    |                   | any      | refused      | as hf's             |
| chunked   | yes   |                   | any      | refused      | its own             |
| liger     | yes   | liger-kernel      | GPU only | refused      | as chunked's        |
| cce       | yes   | cut-cross-entropy | GPU only | refused      | as chunked's        |

``auto`` has no row: it is not a loss but a choice among these (``train.loss.resolve_loss``).
Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config.training import LossKind


@dataclass(frozen=True)
class Package:
    """A package a loss imports, which fsdp_lab does not require."""

    module: str
    """The name it is imported by (checked with importlib before any rank starts)."""
    pip: str
    """The name it is installed by, for the error's fix."""


@dataclass(frozen=True)
class LossRow:
    fused: bool
    """Takes the final hidden states and the head's weight and never builds fp32 B x T x V
    logits (the model's own loss does). Only causal LMs whose head is a plain linear layer can
    take one (``config.families``, fused_loss), and not with LoRA on the head."""
    package: Package | None = None
    """The package it needs, or None (torch alone)."""
    triton: bool = False
    """It runs Triton kernels (the hardware rows that refuse ``Feature.triton`` refuse it)."""
    own: bool = False
    """The model's own loss (its forward computes it), which every engine runs; XLA compiles
    only that one into its step (a fused loss's autograd function would be traced and compiled
    as it is, which nobody has measured: ``Feature.custom_loss``)."""
    memory_as: LossKind | None = None
    """The loss whose working memory ``fsdp-lab plan`` counts for this one (and says so in a
    note), and whose operators its time model traces for a GPU-only one (Triton kernels do
    not run on the meta device). None only for the two the plan models: hf (the fp32 logits)
    and chunked (a chunk's); a new row names the nearer of the two (test_losses holds this)."""


L = LossKind
LOSSES: dict[LossKind, LossRow] = {
    L.hf: LossRow(fused=False, own=True),
    L.z_loss: LossRow(fused=False, memory_as=L.hf),
    L.chunked: LossRow(fused=True),
    L.liger: LossRow(
        fused=True,
        package=Package("liger_kernel", "liger-kernel"),
        triton=True,
        memory_as=L.chunked,
    ),
    L.cce: LossRow(
        fused=True,
        package=Package("cut_cross_entropy", "cut-cross-entropy"),
        triton=True,
        memory_as=L.chunked,
    ),
}
del L


def loss_of(kind: LossKind) -> LossRow:
    """The row of a resolved loss; one without a row (auto, or a new kind left out) is a bug."""
    try:
        return LOSSES[kind]
    except KeyError:
        raise RuntimeError(
            f"loss.kind {kind} has no row in LOSSES (auto is resolved first)"
        ) from None


def loss_runs_anywhere(kind: LossKind) -> bool:
    """auto (which resolves to a loss the device runs) or the model's own loss."""
    return kind is LossKind.auto or loss_of(kind).own


def loss_is_fused(kind: LossKind) -> bool:
    """A fused loss set by name (auto may resolve to one, or not: ``resolve_loss`` says)."""
    return kind is not LossKind.auto and loss_of(kind).fused


def loss_needs_triton(kind: LossKind) -> bool:
    return kind is not LossKind.auto and loss_of(kind).triton
