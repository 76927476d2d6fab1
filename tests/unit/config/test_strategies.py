"""The strategy table: a row per strategy, and no other place that dispatches on one."""

from __future__ import annotations

import re

import pytest
from conftest import assert_only_named_in

from fsdp_lab.config import HardwareKind, ShardingConfig, ShardingStrategy
from fsdp_lab.config.strategies import (
    REPLICATE_AXIS,
    SHARD_AXIS,
    STRATEGIES,
    Replicas,
    strategy_of,
    with_expert_parallel,
    with_replica_groups,
)
from fsdp_lab.config.topology import Topology, mesh_shape, replicate_size

S = ShardingStrategy


def test_every_strategy_has_one_row():
    assert set(STRATEGIES) == set(ShardingStrategy)


@pytest.mark.parametrize(
    "strategy,axes,reshard,zero,xla,shape",
    [
        (S.full, (SHARD_AXIS,), True, 3, S.full, (8,)),
        (S.grad_op, (SHARD_AXIS,), False, 2, S.full, (8,)),
        (S.no_shard, (REPLICATE_AXIS, SHARD_AXIS), False, 0, S.no_shard, (8, 1)),
        (S.hybrid, (REPLICATE_AXIS, SHARD_AXIS), True, 3, S.hybrid, (2, 4)),
        (S.hybrid_zero2, (REPLICATE_AXIS, SHARD_AXIS), False, 2, S.hybrid, (2, 4)),
    ],
)
def test_each_row_says_what_the_strategy_means(strategy, axes, reshard, zero, xla, shape):
    row = strategy_of(strategy)
    assert (row.mesh_axes, row.reshard_after_forward, row.zero_stage, row.xla) == (
        axes,
        reshard,
        zero,
        xla,
    )
    topo = Topology(world_size=8, nproc_per_node=8, num_nodes=1, device=HardwareKind.cpu)
    assert mesh_shape(ShardingConfig(strategy=strategy), topo) == shape
    assert len(shape) == len(axes)


def test_replica_groups_follow_nodes_unless_set():
    two_nodes = Topology(world_size=16, nproc_per_node=8, num_nodes=2, device=HardwareKind.gpu)
    assert replicate_size(ShardingConfig(strategy=S.hybrid), two_nodes) == 2
    assert replicate_size(ShardingConfig(strategy=S.hybrid, replicate_size=4), two_nodes) == 4
    assert replicate_size(ShardingConfig(strategy=S.no_shard), two_nodes) == 16
    assert with_replica_groups() == ["hybrid", "hybrid_zero2"]
    assert {r.replicas for r in STRATEGIES.values()} == set(Replicas)


NAMES = r"(full|grad_op|no_shard|hybrid|hybrid_zero2)"
NAMED = re.compile(rf"\b(ShardingStrategy|S)\.{NAMES}\b")
# A strategy's name as a string beside .name or .value: `s.strategy.name not in ("full", ...)`.
BY_STRING = re.compile(rf"strategy\.(name|value)\b[^\n]*[\"']{NAMES}[\"']")


def test_no_other_module_dispatches_on_a_strategy_name():
    # The sharding group names its default; the table is the one place that says what each means.
    allowed = {"config/strategies.py", "config/sharding.py"}
    what = "strategy dispatch outside config.strategies"
    assert_only_named_in(allowed, NAMED, ["if s is ShardingStrategy.hybrid:"], what)
    assert_only_named_in(allowed, BY_STRING, ['s.strategy.name not in ("full", "grad_op")'], what)


def test_expert_parallelism_is_a_column():
    assert with_expert_parallel() == ["full", "grad_op", "hybrid", "hybrid_zero2"]
    assert not strategy_of(S.no_shard).expert_parallel
