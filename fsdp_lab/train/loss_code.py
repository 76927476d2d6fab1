"""Each loss's code, by kind: the second half of ``config.losses``' table (its rows say what a
loss needs; here is what it computes). A fused loss takes the final hidden states and the head's
weight (``FUSED_LOSSES``; computed by the head of a model built with ``fused_mixin``, a subclass
of its class); a logit loss takes the model's logits (``LOGIT_LOSSES``). Every one returns a SUM
of token losses (``train.loss`` divides by the global batch's targets once).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_lab.config import LossConfig, LossKind
from fsdp_lab.data.labels import IGNORE_INDEX, shifted_targets
from fsdp_lab.train.linear_ce import linear_cross_entropy


class FusedLoss(Protocol):
    """A fused loss's code: the loss of ``hidden @ weight.T`` against ``targets`` (IGNORE_INDEX
    skipped), mean or sum, from ``hidden`` (N, H) and ``weight`` (V, H) in the compute dtype."""

    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        *,
        reduction: str,
        chunk_size: int,
        compiled: bool,
    ) -> torch.Tensor: ...


def _chunked(hidden, weight, targets, *, reduction: str, chunk_size: int, compiled: bool):
    return linear_cross_entropy(
        hidden, weight, targets, chunk_size=chunk_size, reduction=reduction, compiled=compiled
    )


def _liger(hidden, weight, targets, *, reduction: str, chunk_size: int, compiled: bool):
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss,
    )

    return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction=reduction)(
        weight, hidden, targets
    )


def _cce(hidden, weight, targets, *, reduction: str, chunk_size: int, compiled: bool):
    from cut_cross_entropy import linear_cross_entropy as cce

    # filter_eps=None: exact gradients (CCE's default skips those below a threshold).
    return cce(
        hidden, weight, targets, ignore_index=IGNORE_INDEX, reduction=reduction, filter_eps=None
    )


class LogitLoss(Protocol):
    """A loss from the model's logits: the SUM over ``targets`` (N; IGNORE_INDEX skipped) of
    its token losses, from ``logits`` (N, V) (a causal LM's in fp32, as the model's own)."""

    def __call__(
        self, logits: torch.Tensor, targets: torch.Tensor, *, cfg: LossConfig
    ) -> torch.Tensor: ...


def _cross_entropy(logits, targets, *, cfg: LossConfig) -> torch.Tensor:
    return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _z_loss(logits, targets, *, cfg: LossConfig) -> torch.Tensor:
    """PaLM's: the cross-entropy plus ``cfg.z_loss_coef`` x log(Z)^2 of each learned token,
    Z the softmax's normaliser (one logsumexp more over the logits)."""
    learned = targets != IGNORE_INDEX
    log_z = torch.logsumexp(logits, dim=-1)
    return (
        _cross_entropy(logits, targets, cfg=cfg)
        + cfg.z_loss_coef * (log_z.square() * learned).sum()
    )


# The code of each row of config.losses (a test checks every row has exactly one).
LOGIT_LOSSES: dict[LossKind, LogitLoss] = {
    LossKind.hf: _cross_entropy,
    LossKind.z_loss: _z_loss,
}
FUSED_LOSSES: dict[LossKind, FusedLoss] = {
    LossKind.chunked: _chunked,
    LossKind.liger: _liger,
    LossKind.cce: _cce,
}


# --- the model's forward with a fused loss ----------------------------------------------------


@dataclass(frozen=True)
class FusedLossSpec:
    """What a fused head computes: its loss's code, the chunk, whether the chunk is compiled."""

    kind: LossKind
    chunk_size: int
    compiled: bool


class FusedLossHead(nn.Linear):
    """A causal LM's output head under a fused loss: the logits as the Linear computes them;
    given ``targets``, the loss of its input against them instead. It holds the head it
    replaces' weight (the same parameter: a tied embedding stays tied, the name is unchanged)."""

    def __init__(self, head: nn.Linear, spec: FusedLossSpec) -> None:
        weight = head.weight
        super().__init__(
            head.in_features, head.out_features, bias=False, device="meta", dtype=weight.dtype
        )
        self.weight = weight
        self.fused_loss = spec

    def forward(self, hidden, targets=None, reduction: str = "mean"):
        if targets is None:
            return F.linear(hidden, self.weight)
        spec = self.fused_loss
        return FUSED_LOSSES[spec.kind](
            hidden.flatten(0, 1),
            self.weight,
            targets.flatten(),
            reduction=reduction,
            chunk_size=spec.chunk_size,
            compiled=spec.compiled,
        )


class FusedLossLM:
    """A causal LM under a fused loss, mixed into its class at construction
    (``engine.model.build_meta_model``'s ``mixin``; ``fused_mixin`` gives the class for a
    spec): its head is a ``FusedLossHead`` (through ``set_output_embeddings``), and its
    forward runs the base model, then the head on the hidden states and the targets, the head
    computing the loss. Only model types whose own forward is exactly ``lm_head(base(...))``
    then ``ForCausalLMLoss`` take it (``config.families``' fused_loss column)."""

    fused_loss: FusedLossSpec  # on the class: fused_mixin's

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        head = self.get_output_embeddings()
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise RuntimeError(
                f"{type(self).__name__}'s output head is not a bias-free Linear; "
                "it cannot take a fused loss"
            )
        self.set_output_embeddings(FusedLossHead(head, self.fused_loss))

    def forward(
        self,
        input_ids=None,
        labels=None,
        loss_reduction: str = "mean",
        logits_to_keep=0,
        labels_shifted: bool = False,
        **kwargs,
    ):
        """``model(input_ids=..., labels=...)`` returns an output whose ``.loss`` is the mean
        over the predicted tokens (``loss_reduction="sum"``: their sum); without labels, the
        logits (``logits_to_keep``: of the last positions only, as transformers' for decoding).
        ``labels_shifted``: the labels are the targets already (a context-parallel split
        shifts them before cutting the sequence)."""
        from transformers.modeling_outputs import CausalLMOutput

        hidden = self.base_model(input_ids=input_ids, **kwargs).last_hidden_state
        head = self.get_output_embeddings()
        if labels is None:
            kept = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
            return CausalLMOutput(logits=head(kept))
        targets = labels if labels_shifted else shifted_targets(labels)
        return CausalLMOutput(loss=head(hidden, targets, loss_reduction))


@functools.cache
def fused_mixin(spec: FusedLossSpec) -> type:
    """The mixin that builds a causal LM computing ``spec``'s loss (one class per spec)."""
    return type("FusedLossLM", (FusedLossLM,), {"fused_loss": spec, "__module__": __name__})
