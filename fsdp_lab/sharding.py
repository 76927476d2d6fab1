"""The device mesh and the only call site of ``fully_shard``: strategy -> mesh + reshard.

Every strategy is FSDP2 on a mesh, which keeps one code path for all five:

| strategy     | mesh (replicate, shard) | reshard_after_forward |
| full         | 1D (N)                  | True                  |
| grad_op      | 1D (N)                  | False                 |
| no_shard     | 2D (N, 1)               | False                 |
| hybrid       | 2D (R, N/R)             | True                  |
| hybrid_zero2 | 2D (R, N/R)             | False                 |

no_shard on an (N, 1) mesh is DDP: each rank holds every element and gradients are all-reduced.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fsdp_lab.config import ShardingConfig, ShardingStrategy
from fsdp_lab.rules import Topology, resolve_replicate_size

REPLICATE_AXIS, SHARD_AXIS = "replicate", "shard"


def default_reshard_after_forward(strategy: ShardingStrategy) -> bool:
    match strategy:
        case ShardingStrategy.full | ShardingStrategy.hybrid:
            return True
        case ShardingStrategy.grad_op | ShardingStrategy.hybrid_zero2 | ShardingStrategy.no_shard:
            return False
        case _:
            raise ValueError(f"unknown sharding.strategy {strategy}")


def reshard_after_forward(cfg: ShardingConfig) -> bool | int:
    return cfg.reshard_after_forward if cfg.reshard_after_forward is not None else (
        default_reshard_after_forward(cfg.strategy))


def mesh_shape(cfg: ShardingConfig, topo: Topology) -> tuple[int, ...]:
    """(N,) for 1D strategies, (replicate, shard) for the 2D ones."""
    match cfg.strategy:
        case ShardingStrategy.full | ShardingStrategy.grad_op:
            return (topo.world_size,)
        case ShardingStrategy.no_shard | ShardingStrategy.hybrid | ShardingStrategy.hybrid_zero2:
            replicate = resolve_replicate_size(cfg, topo)
            return (replicate, topo.world_size // replicate)
        case _:
            raise ValueError(f"unknown sharding.strategy {cfg.strategy}")


def build_mesh(cfg: ShardingConfig, topo: Topology, *, device_type: str) -> DeviceMesh:
    """Ranks are laid out replicate-major, so a shard group is contiguous ranks (one node when
    replicate_size is the number of nodes): the frequent all-gathers stay intra-node."""
    shape = mesh_shape(cfg, topo)
    names = (SHARD_AXIS,) if len(shape) == 1 else (REPLICATE_AXIS, SHARD_AXIS)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def apply_fsdp(
    model: nn.Module,
    units: list[nn.Module],
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool | int,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None,
) -> None:
    """Shard each unit, then the root (which takes the parameters no unit claimed).

    Units are sharded bottom-up so that nested units exclude their children's parameters.
    """
    kwargs = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy or OffloadPolicy())
    for unit in reversed(units):
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **kwargs)
    # The root's own parameters (embeddings, final norm, head) are needed again right at the start
    # of backward; None lets FSDP2 keep them gathered. With no units the root is the whole model,
    # and the strategy's choice holds.
    root_reshard = None if units else reshard_after_forward
    fully_shard(model, reshard_after_forward=root_reshard, **kwargs)


def build_offload_policy(enabled: bool, *, pin_memory: bool) -> OffloadPolicy | None:
    return CPUOffloadPolicy(pin_memory=pin_memory) if enabled else None
