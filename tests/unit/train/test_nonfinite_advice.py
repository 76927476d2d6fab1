"""A non-finite loss says what was checked before it advises: the weights as they were read,
the last finite step's gradient norm; then the fix the evidence points at."""

from __future__ import annotations

import dataclasses

from fsdp_lab.config import Config
from fsdp_lab.observe.metrics import StepMetrics
from fsdp_lab.train.loop import NonFiniteLoss
from fsdp_lab.train.worker import _nonfinite_advice


def _step(step: int, grad_norm: float) -> StepMetrics:
    return StepMetrics(step, 2.5, grad_norm, 1e-3, 0.1, 1.0, 64, 0, [0])


def test_the_message_says_what_was_checked_and_where_the_evidence_points():
    cfg = dataclasses.replace(Config(), resume="never")
    fresh = _nonfinite_advice(cfg, 0, NonFiniteLoss(7, float("nan"), _step(6, 812.5)), False)
    assert fresh.startswith("loss is nan at step 7 (the gradient norm at step 6 was 812.5)")
    assert "lower optim.lr" in fresh and "finite as they were read" not in fresh
    pretrained = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, pretrained=True))
    first = _nonfinite_advice(pretrained, 0, NonFiniteLoss(1, float("nan")), True)
    assert first.startswith("loss is nan at step 1 (the weights were finite as they were read);")
    resumed = dataclasses.replace(cfg, resume="/runs/a/checkpoints/step_00000100")
    line = _nonfinite_advice(resumed, 100, NonFiniteLoss(103, float("inf"), _step(102, 3.0)), True)
    assert "finite as they were read; the gradient norm at step 102 was 3)" in line
    assert "3 step(s) after resuming" in line and "suspect the checkpoint" in line
