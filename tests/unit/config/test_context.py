"""Context parallelism's layout and rules, torch-free: the mesh with its context axis, the FSDP
mesh it folds into for every strategy, the head-tail chunks, and each bad input refused in one
line before launch."""

from __future__ import annotations

import pytest

from fsdp_lab.config import ConfigError, HardwareKind, ShardingConfig, ShardingStrategy, compose
from fsdp_lab.config.rules import validate
from fsdp_lab.config.topology import (
    Topology,
    context_chunks,
    dp_size,
    fsdp_mesh_shape,
    mesh_axes,
    mesh_shape,
)

S = ShardingStrategy


def topo(world: int, kind: HardwareKind = HardwareKind.cpu) -> Topology:
    return Topology(world_size=world, nproc_per_node=world, num_nodes=1, device=kind)


@pytest.mark.parametrize(
    "strategy,tensor,mesh,axes,fsdp",
    [
        # FSDP shards over shard x context: the ranks of a CP group hold the same model
        (S.full, 1, (4, 2), ("shard", "context"), (8,)),
        (S.grad_op, 2, (2, 2, 2), ("shard", "context", "tp"), (4,)),
        (S.hybrid, 1, (2, 2, 2), ("replicate", "shard", "context"), (2, 4)),
        (S.hybrid_zero2, 2, (2, 1, 2, 2), ("replicate", "shard", "context", "tp"), (2, 2)),
        # no_shard keeps its meaning: every element everywhere, replicated over data x context
        (S.no_shard, 1, (4, 1, 2), ("replicate", "shard", "context"), (8, 1)),
    ],
)
def test_the_context_axis_and_the_fsdp_mesh_of_each_strategy(strategy, tensor, mesh, axes, fsdp):
    cfg, t = ShardingConfig(strategy=strategy), topo(8)
    assert mesh_shape(cfg, t, tensor, context=2) == mesh
    assert mesh_axes(cfg, tensor, context=2) == axes
    assert fsdp_mesh_shape(cfg, t, tensor, context=2) == fsdp
    assert dp_size(t, tensor, context=2) == 8 // (2 * tensor)  # ranks reading different rows
    assert fsdp_mesh_shape(cfg, t, tensor) == mesh_shape(cfg, t, tensor)[: len(fsdp)]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_head_tail_chunks_cover_the_sequence_once_with_equal_causal_work(size):
    chunks = [context_chunks(size, r) for r in range(size)]
    assert sorted(c for pair in chunks for c in pair) == list(range(2 * size))
    # chunk c attends to c + 1 chunks of keys: every rank reads 2N + 1
    assert {a + 1 + b + 1 for a, b in chunks} == {2 * size + 1}
    with pytest.raises(RuntimeError):
        context_chunks(size, size)


def test_cp_composes_with_the_strategies_and_tp():
    for overrides, world in (
        (["parallel.context=2", "sharding=hybrid"], 4),  # CP 2 x FSDP 2: (2, 1, 2)
        (["parallel.context=2", "parallel.tensor=2"], 4),
        (["parallel.context=4", "sharding=no_shard"], 4),
        (["parallel.context=2", "parallel.tensor=2", "sharding=hybrid"], 8),
        (["parallel.context=2", "sharding.reshard_after_forward=2"], 8),  # 2 divides 8
    ):
        validate(compose(["hardware=cpu", *overrides]), topo(world))


@pytest.mark.parametrize(
    "overrides,world,kind,message",
    [
        (["parallel.context=3"], 4, "cpu", "parallel.context=3 does not divide the 4 ranks"),
        (
            ["parallel.context=2", "parallel.tensor=2"],
            6,
            "cpu",
            "parallel.context=2 x parallel.tensor=2 does not divide the 6 ranks",
        ),
        (
            ["parallel.context=2", "trainer.seq_len=66"],
            2,
            "cpu",
            "trainer.seq_len=66 is not a multiple of 2 x parallel.context=4 (each rank keeps 2 "
            "of 4 equal chunks of a sequence); set trainer.seq_len=64",
        ),
        (["parallel.context=0"], 2, "cpu", "parallel.context=0 must be > 0"),
        (["parallel.context=2"], 4, "tpu", "hardware=tpu cannot run parallel.context=2"),
        (
            ["parallel.context=2", "model=qwen3_moe_tiny", "parallel.expert=2"],
            4,
            "cpu",
            "parallel.context=2 cannot combine with parallel.expert=2",
        ),
        (
            ["parallel.context=2", "model=bert_tiny"],
            2,
            "cpu",
            "parallel.context=2 cannot combine with model.task=masked_lm",
        ),
    ],
)
def test_bad_input_is_one_line_before_launch(overrides, world, kind, message):
    with pytest.raises(ConfigError) as e:
        validate(compose([f"hardware={kind}", *overrides]), topo(world, HardwareKind[kind]))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "parallel.context=1" in str(e.value) or "set " in str(e.value)
