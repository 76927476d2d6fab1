"""A pipeline's plan (``parallel.pipeline`` > 1): each pipeline rank holds other stages, so
each is planned apart (``plan_model.inspect_model`` with its ``pipeline_rank``) and the plans
combined here; and a rank's activations from a micro-batch's, by what its schedule keeps in
flight."""

from __future__ import annotations

import dataclasses

from fsdp_lab.config import Config, HardwareKind
from fsdp_lab.planning import activation_memory
from fsdp_lab.planning.plan_model import ModelShape, PipelineShare, inspect_model
from fsdp_lab.planning.plan_result import StrategyPlan, Unavailable


def activations(
    act: activation_memory.Activations, share: PipelineShare
) -> activation_memory.Activations:
    """A pipeline rank's activations from a micro-batch's: its layers' for the microbatches
    its schedule keeps in flight; the head's and the loss's (the last stage's) for the one
    microbatch it runs at a time; none of them elsewhere."""
    one = 1 / share.microbatches
    head = act.head * one if share.head else 0
    return dataclasses.replace(
        act,
        saved=int((act.saved - act.head) * share.in_flight + head),
        head=int(head),
        loss_grad=int(act.loss_grad * one) if share.head else 0,
    )


def combined(plans: list[StrategyPlan | Unavailable]) -> StrategyPlan | Unavailable:
    """One strategy's plans, one per pipeline rank (one plan: no pipeline), as one: every
    rank's state in rank order, the figures of the rank with the highest peak, the step of
    the slowest (the others wait for it at each send)."""
    for plan in plans:
        if not isinstance(plan, StrategyPlan):
            return plan
    if len(plans) == 1:
        return plans[0]
    worst = max(range(len(plans)), key=lambda i: plans[i].peak)
    return dataclasses.replace(
        plans[worst],
        per_rank=[r for part in plans for r in part.per_rank],
        time=max((part.time for part in plans), key=lambda t: t.step_s),
        parts=tuple(plans),
        counted=worst * len(plans[0].per_rank),
    )


def stage_facts(cfg: Config, kind: HardwareKind, whole: ModelShape) -> list[ModelShape]:
    """The model as each pipeline rank holds it; without a pipeline, ``whole``."""
    if cfg.parallel.pipeline == 1:
        return [whole]
    return [inspect_model(cfg, kind, pipeline_rank=r) for r in range(cfg.parallel.pipeline)]


def notes(stages: list[ModelShape], chosen: StrategyPlan | Unavailable) -> list[str]:
    """Which pipeline rank the figures are of, and what its schedule keeps and idles."""
    if len(stages) == 1 or not isinstance(chosen, StrategyPlan):
        return []
    return [stages[chosen.counted // len(chosen.parts[0].per_rank)].pipeline.note]
