"""AdamW's parameter groups and the warmup + cosine schedule."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fsdp_lab.config import OptimConfig, OptimImpl
from fsdp_lab.train.optim import build_optimizer, build_scheduler, lr_factor


def test_warmup_then_cosine_down_to_the_floor():
    f = lambda step: lr_factor(step, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(9) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert f(14) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 20))


def test_only_matrices_decay_and_the_scheduler_drives_the_lr():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    cfg = OptimConfig(lr=1e-3, weight_decay=0.1, warmup_steps=2)
    opt = build_optimizer(model, cfg, implementation=OptimImpl.for_loop)
    decay, no_decay = opt.param_groups
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(no_decay["params"]) == 3  # the bias, the norm's weight and bias
    sched = build_scheduler(opt, cfg, max_steps=10)
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)  # step 0 of 2 warmup steps
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3)


def test_an_unresolved_implementation_is_a_bug():
    with pytest.raises(ValueError, match="unresolved"):
        build_optimizer(nn.Linear(2, 2), OptimConfig(), implementation=OptimImpl.auto)
