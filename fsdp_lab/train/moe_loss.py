"""The router's load-balancing loss of a mixture-of-experts model, over the global batch.

transformers adds ``router_aux_loss_coef * aux`` to a MoE model's loss only when it is given
``labels``; fsdp_lab never passes them (its losses are sums it computes itself, and the fused
ones call the base model, whose output carries no aux loss), so the step adds it here.

The aux loss (Switch Transformer's, as ``load_balancing_loss_func`` computes it) is
``E * sum_e f_e * P_e``: ``f_e`` the share of top-k assignments that went to expert e, ``P_e``
its mean router probability, both over every layer's rows. It is not linear in the batch: the
mean of the ranks' aux losses is not the aux loss of their global batch. So each rank sums its
rows' assignments and probabilities, the sums are all-reduced over the ranks, and every rank
computes the same global aux. The all-reduce's backward sums every rank's gradient of the
probability sums, so each rank's router gets ``dp`` times its rows' share of the gradient, and
FSDP's average over dp makes it exactly the single process's gradient
(``tests/unit/train/test_moe_loss.py``). A TP group's ranks hold the same rows: the world's
sums are divided by ``tp_ranks``.

Rows are the positions the main loss learns from (a target): padding and prompt tokens are left
out as the cross-entropy leaves them, the same mask in the reference. The logits are captured
by forward hooks on the routers, only inside ``recording()`` (the loss's own forward): the
recomputation of activation checkpointing runs the routers again in backward, uncounted.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.engine.moe import MoeStep, expert_counts, moe_blocks


def routing_sums(
    logits: list[torch.Tensor], mask: torch.Tensor, *, num_experts: int, top_k: int
) -> torch.Tensor:
    """One rank's sums, to be added over ranks: [P sums (E, with gradient) | rows (1) |
    assignments per layer (L x E)]. ``logits``: each layer's ``[rows, E]``; ``mask``: ``[rows]``,
    1 for a counted row. As ``load_balancing_loss_func`` with an attention mask computes them;
    no host sync (``scatter_add_``, not ``bincount``)."""
    weight = mask.reshape(-1).float()
    probs_sum = torch.zeros(num_experts, dtype=torch.float32, device=weight.device)
    counts = []
    for layer in logits:
        if layer.shape[0] != weight.shape[0]:
            raise RuntimeError(
                f"router logits have {layer.shape[0]} rows, the batch {weight.shape[0]} positions"
            )
        probs = torch.softmax(layer.float(), dim=-1)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        counts.append(
            torch.zeros(num_experts, dtype=torch.float32, device=weight.device).scatter_add_(
                0, chosen.reshape(-1), weight.repeat_interleave(top_k)
            )
        )
        probs_sum = probs_sum + (probs * weight[:, None]).sum(0)
    rows = (weight.sum() * len(logits)).reshape(1)
    return torch.cat([probs_sum, rows, torch.stack(counts).flatten()])


def aux_from_sums(sums: torch.Tensor, *, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the aux loss ``E * sum_e f_e * P_e``, assignments per layer ``[L, E]``) from the global
    ``routing_sums``. No counted row: 0."""
    probs_sum, rows = sums[:num_experts], sums[num_experts].clamp(min=1.0)
    per_layer = sums[num_experts + 1 :].view(-1, num_experts)
    tokens = per_layer.detach().sum(0) / rows
    return num_experts * (tokens * probs_sum / rows).sum(), per_layer.detach()


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward all-reduces the gradient too: each rank's input then
    gets the sum of every rank's gradient of the shared output (as
    ``torch.distributed.nn.functional.all_reduce``, deprecated in torch 2.13 for the functional
    collectives, whose all_reduce has no backward)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class RouterAux:
    """The routers' logits of a forward, the global aux loss from them, and the step's numbers.

    ``coef``: the aux loss's weight in the objective (0: measured, not trained on);
    ``tp_ranks``: ranks that hold the same rows (a TP group)."""

    def __init__(
        self,
        routers: list[nn.Module],
        *,
        num_experts: int,
        top_k: int,
        coef: float,
        tp_ranks: int = 1,
    ) -> None:
        self.num_experts, self.top_k, self.coef = num_experts, top_k, coef
        self.tp_ranks = tp_ranks
        self._recording = False
        self._logits: list[torch.Tensor] = []
        self._aux_sum: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._micro = 0
        for router in routers:
            router.register_forward_hook(self._capture)

    def _capture(self, module, args, output) -> None:
        if self._recording:
            self._logits.append(output[0] if isinstance(output, tuple) else output)

    @contextlib.contextmanager
    def recording(self):
        """Capture the routers' logits of the forward run inside."""
        self._logits, self._recording = [], True
        try:
            yield
        finally:
            self._recording = False

    def loss(self, mask: torch.Tensor) -> torch.Tensor:
        """``coef`` x the global aux loss of the recorded forward (every rank calls it at the
        same micro-batch: an all-reduce), with its gradient; the step's numbers accumulate."""
        logits, self._logits = self._logits, []
        sums = routing_sums(logits, mask, num_experts=self.num_experts, top_k=self.top_k)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            sums = _SumOverRanks.apply(sums) / self.tp_ranks
        aux, counts = aux_from_sums(sums, num_experts=self.num_experts)
        detached = aux.detach()
        self._aux_sum = detached if self._aux_sum is None else self._aux_sum + detached
        self._counts = counts if self._counts is None else self._counts + counts
        self._micro += 1
        return aux * self.coef

    def take(self) -> MoeStep | None:
        """The step's numbers (None: no forward recorded since the last take), and a reset."""
        if self._aux_sum is None:
            return None
        step = MoeStep(aux_loss=self._aux_sum / self._micro, tokens_per_expert=self._counts)
        self._aux_sum, self._counts, self._micro = None, None, 0
        return step


def build_router_aux(model: nn.Module, *, tp_ranks: int = 1) -> RouterAux | None:
    """The aux loss of a MoE model (None for a dense one), weighted by the config's
    ``router_aux_loss_coef`` (``model.router_aux_loss_coef`` set it, or the model's default)."""
    blocks = moe_blocks(model)
    if not blocks:
        return None
    counts = expert_counts(model)
    coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
    return RouterAux(
        [b.gate for b in blocks],
        num_experts=counts.num_experts,
        top_k=counts.top_k,
        coef=coef,
        tp_ranks=tp_ranks,
    )
