"""Mixture-of-experts models: their presets and what the rest of fsdp_lab asks of their layers.

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

from fsdp_lab.config import ModelArch, ModelConfig


def moe_hf_config(cfg: ModelConfig, common: dict):
    """The transformers config of a mixture-of-experts preset: every layer sparse, dropout
    and router noise off (runs are then the same across world sizes and strategies)."""
    from transformers import MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    expert_width = cfg.expert_intermediate_size or cfg.intermediate_size
    shared = dict(
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        num_experts_per_tok=cfg.experts_per_token,
        attention_dropout=0.0,
        **common,
    )
    match cfg.arch:
        case ModelArch.qwen3_moe:
            return Qwen3MoeConfig(
                intermediate_size=cfg.intermediate_size,  # dense layers' (none here)
                moe_intermediate_size=expert_width,
                num_experts=cfg.num_experts,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                norm_topk_prob=True,
                head_dim=cfg.hidden_size // cfg.num_heads,
                **shared,
            )
        case ModelArch.mixtral:
            return MixtralConfig(
                intermediate_size=expert_width,
                num_local_experts=cfg.num_experts,
                router_jitter_noise=0.0,  # random noise in training: breaks exact parity
                **shared,
            )
        case ModelArch.olmoe:
            return OlmoeConfig(
                intermediate_size=expert_width,
                num_experts=cfg.num_experts,
                norm_topk_prob=False,
                **shared,
            )
        case _:
            raise ValueError(f"model.arch={cfg.arch} is not a mixture of experts")


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
    """``config._experts_implementation`` (read by the experts' forward on every call); None
    leaves transformers' own choice. A dense model's config ignores it."""
    if implementation is not None:
        hf_config._experts_implementation = implementation
