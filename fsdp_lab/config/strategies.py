"""The sharding strategies, one row each: the only place that says what a strategy means.

Every strategy is FSDP2 (``fully_shard``) on a device mesh, which keeps one code path for all
five; they differ only in the columns below. The FSDP2 engine, the XLA engine, the rules and the
plan read this table, and nothing else dispatches on the strategy's name.

| strategy     | mesh axes          | replicas        | reshard | ZeRO | hardware=tpu   | EP  |
| full         | (shard,)           | one: N shards   | True    | 3    | full           | yes |
| grad_op      | (shard,)           | one: N shards   | False   | 2    | refused: full  | yes |
| no_shard     | (replicate, shard) | every: (N,1) DDP| False   | 0    | no_shard       | no  |
| hybrid       | (replicate, shard) | groups: (R,N/R) | True    | 3    | hybrid         | yes |
| hybrid_zero2 | (replicate, shard) | groups: (R,N/R) | False   | 2    | refused: hybrid| yes |

Imports no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from fsdp_lab.config.sharding import ShardingConfig, ShardingStrategy

REPLICATE_AXIS, SHARD_AXIS = "replicate", "shard"
TENSOR_AXIS = "tp"  # parallel.tensor > 1: appended innermost, after the strategy's axes
CONTEXT_AXIS = "context"  # parallel.context > 1: after the strategy's axes, before tp


class Replicas(enum.Enum):
    """How many full copies of the model the ranks hold between them."""

    one = "one"
    """A 1D mesh over every rank: one copy, split N ways."""
    every_rank = "every_rank"
    """An (N, 1) mesh: every rank holds all of it and gradients are all-reduced (DDP)."""
    groups = "groups"
    """An (R, N/R) mesh: sharding.replicate_size copies (default: the node count, else 2), each
    split over a group of contiguous ranks, so the frequent all-gathers stay within a node."""


@dataclass(frozen=True)
class Strategy:
    replicas: Replicas
    reshard_after_forward: bool
    """The default of sharding.reshard_after_forward: free the gathered parameters after each
    unit's forward (True, ZeRO-3) or keep them until its backward (False, ZeRO-2)."""
    zero_stage: int
    """The ZeRO stage the strategy is named after (within a replica group for the hybrids)."""
    xla: ShardingStrategy
    """What hardware=tpu runs. When it is another strategy, this one is refused with a hint to
    use that one: on XLA the compiler, not a setting, decides when parameters are re-gathered."""
    expert_parallel: bool = True
    """parallel.expert > 1 was verified with it (EP borrows the shard axis: a strategy with a
    shard axis of 1, DDP's, has none to borrow)."""

    @property
    def has_replica_groups(self) -> bool:
        """sharding.replicate_size applies (the hybrids)."""
        return self.replicas is Replicas.groups

    @property
    def traffic(self) -> float:
        """Collective traffic per micro-batch in units of the model's parameter bytes (what
        `fsdp-lab tune` orders candidates by): one all-gather for forward, another for backward
        after resharding, a reduce-scatter of the gradients; DDP's all-reduce counts 2; the
        hybrids add the all-reduce of each gradient shard across the replica groups (0.5)."""
        if self.replicas is Replicas.every_rank:
            return 2.0
        gathers = 2.0 if self.reshard_after_forward else 1.0
        return gathers + 1.0 + (0.5 if self.has_replica_groups else 0.0)

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """Axis names, replicate-major: a shard group is contiguous ranks."""
        return (SHARD_AXIS,) if self.replicas is Replicas.one else (REPLICATE_AXIS, SHARD_AXIS)


S = ShardingStrategy
STRATEGIES: dict[ShardingStrategy, Strategy] = {
    S.full: Strategy(Replicas.one, reshard_after_forward=True, zero_stage=3, xla=S.full),
    S.grad_op: Strategy(Replicas.one, reshard_after_forward=False, zero_stage=2, xla=S.full),
    S.no_shard: Strategy(
        Replicas.every_rank,
        reshard_after_forward=False,
        zero_stage=0,
        xla=S.no_shard,
        expert_parallel=False,
    ),
    S.hybrid: Strategy(Replicas.groups, reshard_after_forward=True, zero_stage=3, xla=S.hybrid),
    S.hybrid_zero2: Strategy(
        Replicas.groups, reshard_after_forward=False, zero_stage=2, xla=S.hybrid
    ),
}
del S


def strategy_of(name: ShardingStrategy) -> Strategy:
    """The row of a strategy; a strategy without one is a bug, not a user error."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise RuntimeError(f"sharding.strategy {name} has no row in STRATEGIES") from None


def reshard_after_forward(cfg: ShardingConfig) -> bool | int:
    """sharding.reshard_after_forward, or the strategy's default where it is unset."""
    if cfg.reshard_after_forward is not None:
        return cfg.reshard_after_forward
    return strategy_of(cfg.strategy).reshard_after_forward


def with_expert_parallel() -> list[str]:
    """The strategies parallel.expert > 1 runs under, by name."""
    return [s.name for s, row in STRATEGIES.items() if row.expert_parallel]


def with_replica_groups() -> list[str]:
    """The strategies sharding.replicate_size applies to, by name."""
    return [s.name for s, row in STRATEGIES.items() if row.has_replica_groups]
