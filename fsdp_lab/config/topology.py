"""Who runs where, and the mesh a strategy lays over those ranks. Imports no torch.

The launcher decides the topology once (from ``hardware`` locally, from the environment under
torchrun or srun); the rules check a config against it, and both engines build the mesh of
``mesh_shape`` from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from fsdp_lab.config.hardware import HardwareKind
from fsdp_lab.config.sharding import ShardingConfig
from fsdp_lab.config.strategies import CONTEXT_AXIS, TENSOR_AXIS, Replicas, strategy_of


@dataclass(frozen=True)
class Topology:
    """The data-parallel ranks: processes, or on tpu the XLA devices of the one process."""

    world_size: int
    nproc_per_node: int
    num_nodes: int
    device: HardwareKind  # cpu, gpu or tpu, never auto

    @classmethod
    def nodes(cls, nproc_per_node: int, num_nodes: int, device: HardwareKind) -> Topology:
        """num_nodes x nproc_per_node ranks: a plan's, or a local launch's one node (on tpu
        one rank per XLA device of the host)."""
        return cls(nproc_per_node * num_nodes, nproc_per_node, num_nodes, device)

    @classmethod
    def from_launcher(cls, env: Mapping[str, str], device: HardwareKind) -> Topology:
        """What the launcher that started this rank says (torchrun, srun, the local spawn):
        WORLD_SIZE ranks, LOCAL_WORLD_SIZE of them per node."""
        world = int(env["WORLD_SIZE"])
        per_node = int(env.get("LOCAL_WORLD_SIZE", world))
        return cls(world, per_node, world // per_node, device)


def stage_topology(topo: Topology, pipeline: int) -> Topology:
    """The ranks of one pipeline stage (``parallel.pipeline`` > 1): the pipeline axis is
    outermost, so a stage is ``world / pipeline`` contiguous ranks (whole nodes when the
    pipeline spans nodes; else a share of each node). Every data-parallel rule and mesh of a
    strategy applies within a stage."""
    if pipeline == 1:
        return topo
    nodes = max(1, topo.num_nodes // pipeline)
    world = topo.world_size // pipeline
    return Topology(world, world // nodes, nodes, topo.device)


def dp_size(topo: Topology, tensor: int = 1, *, context: int = 1) -> int:
    """The data-parallel ranks, those that read different rows: every rank, or one per TP
    group and per CP group (the ranks of either read the same rows)."""
    return topo.world_size // (tensor * context)


def replicate_size(
    cfg: ShardingConfig, topo: Topology, tensor: int = 1, *, context: int = 1
) -> int:
    """Ranks along the replicate axis: 1 on a 1D mesh, every data-parallel rank for no_shard."""
    match strategy_of(cfg.strategy).replicas:
        case Replicas.one:
            return 1
        case Replicas.every_rank:
            return dp_size(topo, tensor, context=context)
        case Replicas.groups:
            if cfg.replicate_size is not None:
                return cfg.replicate_size
            return topo.num_nodes if topo.num_nodes > 1 else 2
        case other:
            raise RuntimeError(f"no replicate size for replicas={other}")


def mesh_shape(
    cfg: ShardingConfig, topo: Topology, tensor: int = 1, *, context: int = 1
) -> tuple[int, ...]:
    """(N,) on a 1D mesh, (replicate, shard) on a 2D one; with context parallelism the context
    axis follows, then with tensor parallelism the TP axis, innermost (a TP group is
    contiguous ranks: one node; a CP group the next closest)."""
    dp = dp_size(topo, tensor, context=context)
    if len(strategy_of(cfg.strategy).mesh_axes) == 1:
        shape: tuple[int, ...] = (dp,)
    else:
        replicate = replicate_size(cfg, topo, tensor, context=context)
        shape = (replicate, dp // replicate)
    return (*shape, *((context,) if context > 1 else ()), *((tensor,) if tensor > 1 else ()))


def mesh_axes(cfg: ShardingConfig, tensor: int = 1, *, context: int = 1) -> tuple[str, ...]:
    """The axis names of ``mesh_shape``."""
    axes = strategy_of(cfg.strategy).mesh_axes
    return (
        *axes,
        *((CONTEXT_AXIS,) if context > 1 else ()),
        *((TENSOR_AXIS,) if tensor > 1 else ()),
    )


def fsdp_mesh_shape(
    cfg: ShardingConfig, topo: Topology, tensor: int = 1, *, context: int = 1
) -> tuple[int, ...]:
    """The mesh FSDP shards on: the strategy's axes with the context axis folded in. The ranks
    of a CP group hold the same model, so they split it too: the context axis joins the shard
    axis (torchtitan's ``dp_shard_cp``), and gradients reduce over replicate x shard x context.
    A strategy that keeps every element on every rank (no_shard) keeps it there too: the
    context axis joins its replicate axis."""
    row = strategy_of(cfg.strategy)
    shape = mesh_shape(cfg, topo, tensor, context=context)[: len(row.mesh_axes)]
    if row.replicas is Replicas.every_rank:
        return (shape[0] * context, *shape[1:])
    return (*shape[:-1], shape[-1] * context)


def context_chunks(context: int, rank: int) -> tuple[int, int]:
    """The two of ``2 * context`` equal chunks of every sequence that rank ``rank`` of a CP
    group holds: chunk ``rank`` and chunk ``2 * context - 1 - rank`` (head-tail). Under a causal
    mask a chunk's work grows with its position, so each rank's pair costs the same: the
    loader splits the rows by it, and the attention puts the gathered keys back in order by
    it."""
    if not 0 <= rank < context:
        raise RuntimeError(f"context rank {rank} outside a CP group of {context}")
    return rank, 2 * context - 1 - rank


EXPERT_SHARD_AXIS, EXPERT_AXIS = "efsdp", "ep"


def expert_mesh_split(cfg: ShardingConfig, topo: Topology, expert: int) -> tuple[int, int]:
    """(efsdp, ep): how expert parallelism splits the shard axis. EP borrows ``expert``
    contiguous ranks of it (innermost, as torchtitan and transformers lay it out: an
    all-to-all group is one node); the rest shard each expert's parameters with FSDP."""
    shard = mesh_shape(cfg, topo)[-1]
    return shard // expert, expert


def expert_shard_dim(local_experts: int, dim1s: tuple[int, ...], shards: int) -> int:
    """The dim FSDP shards a rank's experts on over ``shards`` ranks (torchtitan's rule): 0,
    whole experts, where they divide evenly (or a dim-1 size of the experts' parameters does
    not divide, so dim 1 cannot be split evenly either: dim 0 is padded); else 1, so that no
    rank holds an empty padded shard. The engine applies it; the plan counts by it."""
    if local_experts % shards == 0 or any(d % shards for d in dim1s):
        return 0
    return 1
