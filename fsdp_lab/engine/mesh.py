"""The device mesh a run lays over its ranks, and its sub-meshes: the one FSDP shards on
(every axis but TP and PP, the context axis folded into the shard axis) and expert
parallelism's view of it. The shapes are ``config.topology``'s; this builds them."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_lab.config import Config, ShardingConfig
from fsdp_lab.config.pipeline import PIPELINE_AXIS
from fsdp_lab.config.strategies import CONTEXT_AXIS, REPLICATE_AXIS, SHARD_AXIS, TENSOR_AXIS
from fsdp_lab.config.topology import (
    EXPERT_AXIS,
    EXPERT_SHARD_AXIS,
    Topology,
    expert_mesh_split,
    fsdp_mesh_shape,
    mesh_axes,
    mesh_shape,
    stage_topology,
)
from fsdp_lab.internals import torch_private


def build_mesh(
    cfg: ShardingConfig,
    topo: Topology,
    *,
    device_type: str,
    tensor: int = 1,
    context: int = 1,
    pipeline: int = 1,
) -> DeviceMesh:
    """Ranks are laid out replicate-major, so a shard group is contiguous ranks (one node when
    replicate_size is the number of nodes): the frequent all-gathers stay intra-node. The TP
    axis is innermost, a CP group the next closest; the pipeline axis outermost (a stage is
    ``world / pipeline`` contiguous ranks; only activations cross between stages)."""
    shape = mesh_shape(cfg, stage_topology(topo, pipeline), tensor, context=context)
    names = mesh_axes(cfg, tensor, context=context)
    if pipeline > 1:
        shape, names = (pipeline, *shape), (PIPELINE_AXIS, *names)
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


def data_parallel_mesh(mesh: DeviceMesh, cfg: ShardingConfig, topo: Topology) -> DeviceMesh:
    """The sub-mesh FSDP shards on (``topology.fsdp_mesh_shape``; ``topo``: a stage's): every
    axis but TP and PP, with the context axis folded into the shard axis (for no_shard, into
    the replicate axis)."""
    names = mesh.mesh_dim_names
    data = tuple(n for n in names if n not in (TENSOR_AXIS, PIPELINE_AXIS))
    if CONTEXT_AXIS not in names:
        return mesh[data] if data != names else mesh
    tensor = mesh.size(names.index(TENSOR_AXIS)) if TENSOR_AXIS in names else 1
    shape = fsdp_mesh_shape(cfg, topo, tensor, context=mesh.size(names.index(CONTEXT_AXIS)))
    flat = torch_private.flatten_mesh(mesh[data], "dp_cp")
    if len(shape) == 1:
        return flat
    names = (f"{REPLICATE_AXIS}_cp", f"{SHARD_AXIS}_cp")
    return torch_private.unflatten_mesh(flat, 0, shape, names)


def build_expert_mesh(
    cfg: ShardingConfig, topo: Topology, dp_mesh: DeviceMesh, *, expert: int
) -> DeviceMesh:
    """Expert parallelism's view of the data-parallel ranks: the shard axis unflattened into
    ``(efsdp, ep)``, ep innermost (``topology.expert_mesh_split``). The same ranks and process
    groups as ``dp_mesh``'s, so the experts' FSDP unit nests inside the dense layer's."""
    efsdp, ep = expert_mesh_split(cfg, topo, expert)
    axis = len(dp_mesh.shape) - 1  # the shard axis: the last of the strategy's axes
    return torch_private.unflatten_mesh(
        dp_mesh, axis, (efsdp, ep), (EXPERT_SHARD_AXIS, EXPERT_AXIS)
    )


def meshes(cfg: Config, topo: Topology, device: torch.device) -> tuple[DeviceMesh, DeviceMesh]:
    """The run's mesh (every axis) and the sub-mesh FSDP shards on (a pipeline stage's)."""
    p = cfg.parallel
    mesh = build_mesh(
        cfg.sharding,
        topo,
        device_type=device.type,
        tensor=p.tensor,
        context=p.context,
        pipeline=p.pipeline,
    )
    return mesh, data_parallel_mesh(mesh, cfg.sharding, stage_topology(topo, p.pipeline))
