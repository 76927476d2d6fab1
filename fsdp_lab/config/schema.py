"""The typed config: the root ``Config``, one field per group. Each group's enums, dataclass
and single-field rules live in the group's module (``sharding``, ``hardware``, ``model``,
``data``, ``training``, ``profiling``); ``rules`` runs them all and holds the rules across groups.

YAML under ``conf/`` holds the values; these dataclasses hold the types, so a typo or a wrong type
fails at compose. ``load.to_typed`` turns a composed config into them and applies
``rules.check_fields``; the rules that need the world size are ``rules.validate``.
This package imports no torch: the parent checks a config in well under a second.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict

from omegaconf import OmegaConf

from fsdp_lab.config.data import DataConfig
from fsdp_lab.config.evaluation import EvalConfig
from fsdp_lab.config.hardware import HardwareConfig
from fsdp_lab.config.model import FinetuneConfig, ModelConfig
from fsdp_lab.config.profiling import ProfileConfig
from fsdp_lab.config.sharding import (
    ActivationCheckpointingConfig,
    OffloadConfig,
    ParallelConfig,
    PrecisionConfig,
    ShardingConfig,
    WrapConfig,
)
from fsdp_lab.config.training import CheckpointConfig, LossConfig, OptimConfig, TrainerConfig


class Objective(enum.Enum):
    """What train.py returns to a sweeper (hydra/sweeper=study), read from the run's run.json."""

    val_loss = "val_loss"  # the last validation loss (minimize)
    best_val_loss = "best_val_loss"  # the lowest validation loss of the run (minimize)
    tokens_per_s = "tokens_per_s"  # median steady-state throughput, all ranks (maximize)
    harness = "harness"  # the last lm-eval score eval.objective_metric names (maximize)


@dataclass
class Config:
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    wrap: WrapConfig = field(default_factory=WrapConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: Dict[str, Any] = field(default_factory=dict)
    """The trackers beside metrics.jsonl, one key each (conf/logger/: wandb, tensorboard, mlflow;
    logger=[wandb,tensorboard] for several, logger=none for none), each with a `tracker` naming
    its class and that class's settings; fsdp_lab.observe.trackers checks them before launch."""
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    compile: bool = False
    """torch.compile each FSDP unit (after activation checkpointing, before sharding)."""
    resume: str = "auto"
    """auto: continue from the latest complete checkpoint of this run dir, if it has one;
    never: always start fresh; a path: a checkpoint dir, or a run dir / checkpoint root to take
    the latest complete checkpoint of."""
    objective: Objective = Objective.val_loss
    """What the run returns to a search (hydra/sweeper=study, hparams_search=...): val_loss (the
    last validation loss), best_val_loss, tokens_per_s (to maximize), or harness (an lm-eval score
of eval.harness_tasks, eval.objective_metric names which; to maximize)."""
    seed: int = 0
    """Seeds the model init (done once, on rank 0) and the data; the same seed gives the same run
    whatever the world size or strategy."""


def to_container(cfg: Config) -> dict:
    """The typed config as plain YAML-able data (enums as their names)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
