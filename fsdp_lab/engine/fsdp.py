"""The device mesh and the only call site of ``fully_shard``: strategy -> mesh + reshard.

Every strategy is FSDP2 on a mesh, which keeps one code path for all five; what each means
(mesh axes, replicas, the reshard default) is a row of ``config.strategies.STRATEGIES``.
no_shard on an (N, 1) mesh is DDP: each rank holds every element and gradients are all-reduced.
``build_model`` is the FSDP2 engine of a run (an ``Fsdp2Model``); ``engine.xla.build_model`` the
torch_xla one (hardware=tpu). Both are ``engine.sharded.ShardedModel``s, which is all the worker
knows of either.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import Shard

from fsdp_lab.config import (
    Config,
    ParallelConfig,
    PrefetchConfig,
)
from fsdp_lab.config.sharding import offloaded
from fsdp_lab.config.strategies import (
    CONTEXT_AXIS,
    TENSOR_AXIS,
    reshard_after_forward,
)
from fsdp_lab.config.topology import (
    EXPERT_AXIS,
    Topology,
    expert_shard_dim,
)
from fsdp_lab.engine import activations, conversion, loading, low_precision, precision, wrap
from fsdp_lab.engine import pipeline as pipeline_lib
from fsdp_lab.engine.hardware import devices, memory, process_group
from fsdp_lab.engine.mesh import build_expert_mesh, meshes
from fsdp_lab.engine.nf4 import local_bytes
from fsdp_lab.engine.sharded import ShardedModel
from fsdp_lab.internals import torch_private


@dataclass(frozen=True)
class ExpertUnits:
    """Expert parallelism's FSDP units: each MoE layer's experts, whose parameters are already
    DTensors on ``ep``, sharded further over the expert mesh's other axes."""

    modules: list[nn.Module]
    mesh: DeviceMesh  # the expert mesh without ep
    dp: int  # the ranks the loss scale assumes every gradient is averaged over


def expert_placement(module: nn.Module, shards: int):
    """FSDP's dim for an experts unit's parameters (torchtitan's rule): whole experts (dim 0)
    where the rank's experts divide evenly over ``shards``; else dim 1 (2I rows of gate_up,
    H of down) where that divides, so no rank holds an empty padded shard; else dim 0, padded."""
    dim1s = tuple(p.shape[1] for p in module.parameters())
    dim = expert_shard_dim(module.num_experts, dim1s, shards)
    return lambda param: Shard(dim)


# Many parameters: the model, its units and each policy fully_shard takes (keyword-only).
def apply_fsdp(
    model: nn.Module,
    units: list[nn.Module],
    *,
    mesh: DeviceMesh,
    reshard_after_forward: bool | int,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy | None,
    prefetch: PrefetchConfig,
    experts: ExpertUnits | None = None,
    ignored: set[nn.Parameter] | None = None,
    roots: list[nn.Module] | None = None,
) -> None:
    """Shard the experts (with expert parallelism), each unit, then the root (which takes the
    parameters no unit claimed; under a pipeline, ``roots``: each stage's), then set the
    explicit prefetching.

    Units are sharded bottom-up so that nested units exclude their children's parameters. The
    last unit (in forward order) is not resharded after forward, as torchtitan does: backward
    starts with it, so resharding would only gather it again at once.

    An experts unit's gradient already sums the tokens of its EP peers (the all-to-all's
    backward brought them); reduced over its own mesh it holds the whole data-parallel batch's.
    The loss scale (train.loop: dp / targets) expects a division by the dp ranks, where FSDP
    would divide by the expert mesh's size: so the divisor is set to dp, with sum reductions and
    a separate division where ranks exchange gradients (gloo has no PREMUL_SUM).
    """
    kwargs = dict(
        mp_policy=mp_policy,
        offload_policy=offload_policy or OffloadPolicy(),
        ignored_params=ignored,
    )
    for module in experts.modules if experts else []:
        fully_shard(
            module,
            mesh=experts.mesh,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=expert_placement(module, experts.mesh.size()),
            **kwargs,
        )
        module.set_gradient_divide_factor(float(experts.dp))
        # Not on a 1-rank shard axis: torch 2.13 then divides twice (in its skipped
        # reduce-scatter's copy, and again after it): measured, expert gradients half the
        # unsharded model's at EP 2 on 2 ranks. It sends nothing there anyway.
        module.set_force_sum_reduction_for_comms(experts.mesh.size(experts.mesh.ndim - 1) > 1)
    kwargs["mesh"] = mesh
    for index in reversed(range(len(units))):
        last = index == len(units) - 1
        fully_shard(
            units[index], reshard_after_forward=False if last else reshard_after_forward, **kwargs
        )
    # The root's own parameters (embeddings, final norm, head) are needed again right at the start
    # of backward; None lets FSDP2 keep them gathered. With no units the root is the whole model,
    # and the strategy's choice holds.
    root_reshard = None if units else reshard_after_forward
    for root in roots or [model]:  # a pipeline: each stage is the root of its modules
        fully_shard(root, reshard_after_forward=root_reshard, **kwargs)
    apply_prefetch(units, prefetch)


def apply_prefetch(units: list[nn.Module], prefetch: PrefetchConfig) -> None:
    """FSDP1's forward_prefetch / backward_prefetch as FSDP2's explicit prefetching: each unit
    issues the all-gathers of the next ``forward`` units after its own in forward, and of the
    ``backward`` units before it in backward. forward=0 and backward=1 are FSDP2's defaults
    (implicit), left as they are."""
    for i, unit in enumerate(units):
        if prefetch.forward > 0:
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + prefetch.forward])
        if prefetch.backward > 1:
            unit.set_modules_to_backward_prefetch(units[max(0, i - prefetch.backward) : i][::-1])


def build_offload_policy(enabled: bool, *, pin_memory: bool) -> OffloadPolicy | None:
    return CPUOffloadPolicy(pin_memory=pin_memory) if enabled else None


@dataclass(kw_only=True)
class Fsdp2Model(ShardedModel):
    """The FSDP2 engine's model: DTensor shards on a device mesh, one rank per process."""

    device: torch.device  # this rank's
    unsplit: nn.Module | None = None  # a pipeline's whole model on meta (what an export writes)

    def place_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return devices.to_device(batch, self.device)

    def local_numels(self) -> list[int]:
        return process_group.gather_from_processes(local_numel(self.model))

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> list[dict[str, int]]:
        return process_group.gather_from_processes(state_bytes(self.model, optimizer))

    def export_names(self) -> dict:
        if self.unsplit is None:
            return self.owned_tensors()
        return conversion.owned_tensors(self.unsplit)

    def full_tensors(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """Each tensor gathered whole from its shards (an all-gather over its mesh: every rank
        holds it a moment, one tensor at a time); rank 0 keeps it, on the host. Under a
        pipeline, from the stage holding it (``engine.pipeline.Pipeline.full_tensors``)."""

        owned = self.owned_tensors()
        if self.pipeline is not None:
            like = {n: entry[2] for n, entry in self.export_names().items()}
            return self.pipeline.full_tensors(owned, names, like)
        rank0 = torch.distributed.get_rank() == 0
        out = {}
        for name in names:
            whole = loading.gather_whole(owned[name][2]).detach()
            if rank0:
                out[name] = whole.cpu()
            del whole
        return out if rank0 else None

    @contextlib.contextmanager
    def weights_kept_gathered(self, enabled: bool = True) -> Iterator[None]:
        """Every FSDP unit keeps its weights unsharded after its first forward in the block (as
        ``reshard_after_forward=False`` does) and reshards them at its end, restoring each
        unit's own setting: generation's forwards then all-gather once, not once a token. The
        whole model's weights (in param_dtype) stay on every rank meanwhile, as sharding=no_shard
        holds them."""
        units = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        if not enabled or not units:
            yield
            return
        with torch_private.kept_gathered(self.model, units):
            yield

    @contextlib.contextmanager
    def generation_model(self, keep_gathered: bool = True) -> Iterator[nn.Module]:
        """Under a pipeline, the whole model gathered on every rank for the block (each stage's
        tensors broadcast by it: ``engine.pipeline.Pipeline.gathered``), in fp32; else the
        sharded model."""
        if self.pipeline is None:
            with super().generation_model(keep_gathered) as model:
                yield model
            return
        with self.pipeline.gathered(self.owned_tensors(), self.unsplit) as model:
            yield model

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        return get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )


def apply_expert_parallel(
    model: nn.Module, cfg: Config, topo: Topology, dp_mesh: DeviceMesh
) -> ExpertUnits | None:
    """parallel.expert > 1: the experts split over the expert mesh's ep axis; the units that
    ``apply_fsdp`` shards on its other axes."""
    if cfg.parallel.expert == 1:
        return None
    from fsdp_lab.engine import expert_parallel

    expert_mesh = build_expert_mesh(cfg.sharding, topo, dp_mesh, expert=cfg.parallel.expert)
    modules = expert_parallel.apply(model, expert_mesh)
    fsdp_axes = tuple(a for a in expert_mesh.mesh_dim_names if a != EXPERT_AXIS)
    return ExpertUnits(modules, expert_mesh[fsdp_axes], dp_mesh.size())


def is_expert_unit(module: nn.Module, experts: ExpertUnits | None) -> bool:
    """An experts module is a unit of its own on the expert mesh: a wrap policy that picks it
    (wrap=size, or its class in wrap.classes) must leave it to ``apply_fsdp``'s experts."""
    return experts is not None and any(module is m for m in experts.modules)


def apply_model_parallel(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    """Tensor parallelism on the mesh's TP axis, then context parallelism's attention on its
    context axis (over the heads TP left this rank), where the mesh has them."""
    if cfg.tensor > 1:
        from fsdp_lab.engine import tensor_parallel

        tensor_parallel.apply(model, mesh[TENSOR_AXIS], cfg)
    if cfg.context > 1:
        from fsdp_lab.engine import context_parallel

        context_parallel.apply(model, mesh[CONTEXT_AXIS])


def build_model(
    cfg: Config, topo: Topology, device: torch.device, *, meta_model: nn.Module, source, loss=None
) -> Fsdp2Model:
    """FSDP2: units of the wrap policy, activation checkpointing and compile per unit, then
    ``fully_shard`` on the strategy's mesh with the dtype and offload policies, all on meta;
    only then storage, filled from ``source()`` (rank 0's full model), so no rank holds the
    whole model. A pipeline (``engine.pipeline``) first cuts it to this rank's stages, each the
    FSDP root of its modules; ``loss`` is what its last stage computes."""
    from fsdp_lab.engine import model as model_lib

    model, kind, p, offload = meta_model, topo.device, cfg.parallel, offloaded(cfg.offload)
    tied = model_lib.tied_groups(model)
    mesh, dp_mesh = meshes(cfg, topo, device)
    cut = pipeline_lib.cut(model, p, cfg.trainer.micro_batch_size, mesh)
    apply_model_parallel(model, mesh, p)  # TP and CP, then AC, compile, fully_shard
    # EP next: it swaps the experts' weights for DTensors on ep (which fully_shard then shards
    # on efsdp, as it does TP's) and their forward for the exchange (which AC recomputes).
    experts = apply_expert_parallel(model, cfg, topo, dp_mesh)
    lowp = low_precision.apply(model, cfg)  # torchao's float8 or NF4, sharded as themselves
    held_whole = low_precision.left_to_every_rank(model, dp_mesh.size(dp_mesh.ndim - 1))
    units = _select_units(model, cfg, cut, experts)
    units_desc = pipeline_lib.describe(wrap.summarize_units(model, units), cut)  # pre-rename
    units = activations.apply_activation_checkpointing(model, units, cfg.activation_checkpointing)
    checkpointed = [i for i, unit in enumerate(units) if activations.is_checkpointed(unit)]
    if cfg.compile:
        activations.compile_units(units)
    stage_modules = pipeline_lib.build_stages(model, cut, loss)  # over the units as wrapped
    apply_fsdp(
        model,
        units,
        mesh=dp_mesh,
        reshard_after_forward=reshard_after_forward(cfg.sharding),
        mp_policy=precision.build_mp_policy(cfg.precision),
        offload_policy=build_offload_policy(offload, pin_memory=memory.pin_memory(kind)),
        prefetch=cfg.sharding.prefetch,
        experts=experts,
        ignored=held_whole,
        roots=stage_modules,
    )
    model_lib.check_tied(model, tied)
    low_precision.after_sharding(model, cfg, device)
    if cut and isinstance(source, loading.InitialWeights):  # drawn as the unsplit model
        source = dataclasses.replace(source, layout=cut.whole)
    fingerprint = model_lib.materialize(model, device=device, source=source, offload=offload)
    model_lib.check_tied(model, tied)
    pipeline = cut and pipeline_lib.build_schedule(stage_modules, cut, mesh, device, cfg.precision)
    return Fsdp2Model(
        model=model,
        mesh_shape=list(mesh.shape),
        mesh_axes=list(mesh.mesh_dim_names),
        units_desc=units_desc,
        num_units=len(units) + 1,
        recomputed_units=checkpointed,
        device=device,
        frozen_fingerprint=fingerprint,
        low_precision=low_precision.measured(model, lowp, held_whole),
        post_step=low_precision.post_step(cfg),
        pipeline=pipeline,
        unsplit=cut.whole if cut else None,
    )


def _select_units(model: nn.Module, cfg: Config, cut, experts) -> list[nn.Module]:
    """The wrap policy's units, but the experts' (EP shards them apart); none on a pipeline
    rank that holds no decoder layer (a stage of the embedding or the head alone)."""
    if cut is not None and not cut.layers:
        return []
    return [u for u in wrap.select_units(model, cfg.wrap) if not is_expert_unit(u, experts)]


def local_numel(module: nn.Module) -> int:
    """Parameter elements this rank stores (its shards; everything for replicated params)."""
    return sum(_local(p).numel() for p in module.parameters())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def nbytes(tensors) -> int:
    """Bytes this rank stores of ``tensors`` (their local shards; an NF4 shard's own bytes)."""

    return sum(local_bytes(t) for t in tensors)


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The model state this rank holds, by what the tensors really occupy: its parameter
    shards, their gradients, and every tensor of the optimizer state (Adam's moments and step).
    Measured after an optimizer step, before zero_grad; ``fsdp-lab plan`` predicts it."""
    params = list(model.parameters())
    return {
        "params": nbytes(params),
        "grads": nbytes(p.grad for p in params if p.grad is not None),
        "optimizer": nbytes(
            v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ),
    }
