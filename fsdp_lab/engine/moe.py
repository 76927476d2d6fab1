"""Mixture-of-experts models: what the rest of fsdp_lab asks of their layers.

transformers 5 builds Qwen3-MoE, Mixtral and OLMoE alike: each sparse decoder layer's ``mlp`` is
a block with a ``gate`` (the router: ``weight [E, H]``, returning logits, top-k weights and
top-k indices) and ``experts`` (fused 3-D ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H,
I]``). FSDP units stay the decoder layers (``_no_split_modules``): the router and the experts
are sharded with the rest of their layer, the experts on dim 0 like any parameter. Where the
shard count does not divide E, FSDP2 pads dim 0: ranks hold ceil(E / shards) experts, the last
ones fewer or none (``tests/unit/engine/test_moe_layout.py``); all-gather restores every
expert before the layer runs, so the maths is the same, only the padding costs memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fsdp_lab.internals import transformers_private


def moe_blocks(model: nn.Module) -> list[nn.Module]:
    """The sparse MoE blocks, in layer order: modules with a router ``gate`` (a ``weight [E,
    H]`` and ``top_k``) and ``experts`` (3-D ``gate_up_proj``/``down_proj``)."""
    blocks = []
    for module in model.modules():
        gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
        if (
            isinstance(gate, nn.Module)
            and hasattr(gate, "top_k")
            and isinstance(experts, nn.Module)
            and getattr(getattr(experts, "gate_up_proj", None), "ndim", 0) == 3
        ):
            blocks.append(module)
    return blocks


@dataclass(frozen=True)
class ExpertCounts:
    """A model's experts as counted on meta: what MFU and run.json say of them."""

    num_layers: int  # MoE layers
    num_experts: int  # per layer
    top_k: int
    expert_params: int  # every expert's parameters, all layers

    @property
    def inactive_params(self) -> int:
        """Expert parameters a token does not use: (E - k) of every E experts."""
        if not self.num_experts:
            return 0
        return self.expert_params * (self.num_experts - self.top_k) // self.num_experts


def expert_counts(model: nn.Module) -> ExpertCounts:
    """Experts per layer, top-k and the experts' parameters (zeros for a dense model)."""
    blocks = moe_blocks(model)
    if not blocks:
        return ExpertCounts(0, 0, 0, 0)
    first = blocks[0]
    params = sum(p.numel() for b in blocks for p in b.experts.parameters())
    return ExpertCounts(
        num_layers=len(blocks),
        num_experts=first.experts.gate_up_proj.shape[0],
        top_k=first.gate.top_k,
        expert_params=params,
    )


@dataclass
class MoeStep:
    """One step's router numbers, still on the device (the same on every rank): what the
    loss (``train.moe_loss``) hands the metrics window."""

    aux_loss: torch.Tensor  # the mean over micro-batches of the global aux loss (no coef)
    tokens_per_expert: torch.Tensor  # [layers, experts]: the global batch's top-k assignments


def set_experts_implementation(hf_config, implementation: str | None) -> None:
    """The experts' kernel ``hf_config`` names (read by the experts' forward on every call);
    None leaves transformers' own choice. A dense model's config ignores it."""
    if implementation is not None:
        transformers_private.set_implementation(hf_config, "experts", implementation)
