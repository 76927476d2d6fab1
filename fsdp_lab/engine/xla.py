"""hardware=tpu: the sharding, precision, wrap, activation-checkpointing and checkpoint groups on
torch_xla's SPMD FSDP (FSDPv2). With ``engine.hardware``, the only module that imports torch_xla.

One process drives every XLA device of the host; each device is one data-parallel rank. The
model is written once, as one global program: parameters carry a sharding annotation over a
device mesh, the global batch is split along its first dimension over every mesh axis, and the
XLA compiler inserts the all-gathers, reduce-scatters and all-reduces.

The mesh is the FSDP2 engine's, with the shard axis named ``fsdp`` as FSDPv2 wants it: (N,)
for full (sharded over all N devices), (N, 1) for no_shard (replicated: DDP), (R, N/R) for
hybrid (sharded within a row, replicated across). grad_op and hybrid_zero2 differ from full and
hybrid only in when parameters are re-gathered, which the XLA compiler schedules; the strategy
table's ``xla`` column says so and ``config.rules`` refuses them (and the other settings XLA
cannot honour) before anything starts. FSDPv2 shards each parameter along its largest dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import torch_xla
import torch_xla.distributed.spmd as xs
from torch import nn
from torch_xla.distributed.fsdp import checkpoint_module
from torch_xla.experimental.distributed_checkpoint import (
    SPMDLoadPlanner,
    SPMDSavePlanner,
    prime_optimizer,
)
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
    SpmdFullyShardedDataParallel as FSDPv2,
)

from fsdp_lab.config import Config, ShardingConfig
from fsdp_lab.config.precisions import dtype_row
from fsdp_lab.config.strategies import REPLICATE_AXIS
from fsdp_lab.config.topology import Topology, mesh_shape
from fsdp_lab.engine import activations, wrap
from fsdp_lab.engine import model as model_lib
from fsdp_lab.engine.hardware import devices
from fsdp_lab.engine.sharded import ShardedModel, ShardedStateIO
from fsdp_lab.internals import torch_private

FSDP_AXIS = "fsdp"  # the axis name FSDPv2 shards parameters along
WRAPPER_PREFIX = "_orig_module."  # FSDPv2 keeps the wrapped module under this name


def _run_pending() -> None:
    """Compile and run the operations recorded so far, and wait until their results exist."""
    devices.synchronize(torch_xla.device())


def clean_name(name: str) -> str:
    """A parameter name as in the plain Hugging Face model (and in checkpoints of cpu/gpu runs)."""
    return activations.clean_name(name.replace(WRAPPER_PREFIX, ""))


def build_mesh(cfg: ShardingConfig, topo: Topology) -> xs.Mesh:
    """The same shape as the FSDP2 mesh of this strategy, over the XLA devices in order (one
    host's devices are contiguous, so a shard row stays on a host when R is the host count)."""
    shape = mesh_shape(cfg, topo)
    names = (FSDP_AXIS,) if len(shape) == 1 else (REPLICATE_AXIS, FSDP_AXIS)
    return xs.Mesh(np.arange(topo.world_size), shape, names)


def _batch_spec(mesh: xs.Mesh, ndim: int) -> tuple:
    """Dimension 0 over every mesh axis (every device is a data-parallel rank), the rest whole."""
    axes = tuple(mesh.axis_names)
    return (axes if len(axes) > 1 else axes[0],) + (None,) * (ndim - 1)


def _output_tensor(output) -> torch.Tensor | None:
    """The batch-major tensor of a module's output: a tensor, a tuple's first, a Hugging Face
    ModelOutput's logits or hidden states (its loss, a scalar, is skipped)."""
    if isinstance(output, torch.Tensor):
        return output
    values = (
        output.to_tuple()
        if hasattr(output, "to_tuple")
        else (output if isinstance(output, (tuple, list)) else ())
    )
    return next((v for v in values if isinstance(v, torch.Tensor) and v.dim() >= 2), None)


def _shard_output(output, mesh: xs.Mesh) -> None:
    """Annotate a unit's output batch-sharded: this is what makes the compiler gather the
    parameters (FSDP) rather than the activations."""
    tensor = _output_tensor(output)
    if tensor is not None:
        xs.mark_sharding(tensor, mesh, _batch_spec(mesh, tensor.dim()))


def build_model(
    cfg: Config, topo: Topology, device: torch.device, *, meta_model: nn.Module, source
) -> XlaModel:
    """The full model from ``source()`` on the host (seeded init or pretrained weights: the
    same start as a cpu/gpu run), moved to the XLA device and wrapped with FSDPv2: each unit of
    the wrap policy (checkpointed where activation_checkpointing chose it), then the root.
    ``meta_model`` is not needed: XLA shards tensors that exist."""
    model = source()
    if dtype_row(cfg.precision.param_dtype).half:
        # XLA's autocast has no rule for scaled_dot_product_attention, which then meets fp32 q/k
        # (after the rotary embedding) and a bf16 v; eager attention's matmuls are autocast.
        model.set_attn_implementation("eager")
    units = wrap.select_units(model, cfg.wrap)
    units_desc = wrap.summarize_units(model, units)
    chosen = set(activations.checkpointed_indices(cfg.activation_checkpointing, len(units)))
    tied = model_lib.tied_groups(model)
    model.to(device)
    _retie(model, tied)
    mesh = build_mesh(cfg.sharding, topo)
    parents = activations.parents(model)
    for i in reversed(range(len(units))):  # bottom-up: inner units claim their params first
        unit = checkpoint_module(units[i]) if i in chosen else units[i]
        parent, name = parents[id(units[i])]
        parent.register_module(name, FSDPv2(unit, mesh=mesh, shard_output=_shard_output))
    root = FSDPv2(model, mesh=mesh, shard_output=_shard_output)
    if model_lib.tied_groups(root, clean_name) != tied:
        raise RuntimeError(
            f"tied parameters {tied} were untied on the XLA device "
            f"(now {model_lib.tied_groups(root, clean_name)})"
        )
    if dtype_row(cfg.precision.param_dtype).half:
        _autocast_forward(root, torch.bfloat16)
    # checkpoint_module patches a unit's forward in place, leaving this mark
    checkpointed = [
        i for i, unit in enumerate(units) if hasattr(unit, "_xla_checkpointed_forward_original")
    ]
    return XlaModel(
        model=root,
        mesh_shape=list(mesh.mesh_shape),
        mesh_axes=list(mesh.axis_names),
        units_desc=units_desc,
        num_units=len(units) + 1,
        recomputed_units=checkpointed,
        checkpoint_io=XlaCheckpointIO(),
        param_specs={clean_name(k): sharding_spec(p) for k, p in root.named_parameters()},
        device=device,
        mesh=mesh,
        num_devices=topo.world_size,
    )


@dataclass(kw_only=True)
class XlaModel(ShardedModel):
    """The XLA engine's model: one process drives every device of the host, each device a
    data-parallel rank; per-rank lists come from the shards' placement, without collectives."""

    device: torch.device
    mesh: xs.Mesh
    num_devices: int

    def place_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return place_batch(batch, self.device, self.mesh)

    def local_numels(self) -> list[int]:
        return local_numels(self.model, self.num_devices)

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> list[dict[str, int]]:
        return state_bytes(self.model, optimizer, self.num_devices)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model)

    @staticmethod
    def clean_name(name: str) -> str:
        return clean_name(name)


def _retie(model: nn.Module, groups: list[list[str]]) -> None:
    """Moving a module to an XLA device gives every module its own new Parameter, so a tied
    input/output embedding becomes two (trained apart: GPT-2's loss drifted by 5e-4 in a step);
    point the others back at the first."""
    for first, *others in groups:
        shared = model.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, shared)


def _autocast_forward(module: nn.Module, dtype: torch.dtype) -> None:
    """bf16 as XLA expects it: fp32 master weights, matmuls under autocast in bf16 (losses and
    reductions stay fp32); the backward follows the forward's dtypes. Entered by a forward
    pre-hook and left by a forward hook that runs even when the forward raises."""
    entered: list[torch.autocast] = []

    def enter(_module, _args):
        entered.append(torch.autocast("xla", dtype=dtype))
        entered[-1].__enter__()

    def leave(_module, _args, _output):
        entered.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def place_batch(
    batch: dict[str, torch.Tensor], device: torch.device, mesh: xs.Mesh
) -> dict[str, torch.Tensor]:
    """The host's rows of a global micro-batch onto the devices, split along the batch."""
    out = {}
    for key, value in batch.items():
        value = value.to(device)
        xs.mark_sharding(value, mesh, _batch_spec(mesh, value.dim()))
        out[key] = value
    return out


def sharding_spec(tensor: torch.Tensor) -> str:
    """XLA's HloSharding of a tensor ("" when it has none), e.g. "{devices=[4,1]0,1,2,3}"."""
    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def _device_numels(tensor: torch.Tensor, num_devices: int) -> list[int]:
    """Elements each device holds (shard shapes only; no data leaves the devices)."""
    if not sharding_spec(tensor):
        return [tensor.numel()] * num_devices
    placed = torch_xla._XLAC._get_local_shard_replica_and_indices([tensor])[0]
    return [
        tensor.numel() if indices is Ellipsis else math.prod(s.stop - s.start for s in indices)
        for _, indices in placed
    ]


def _device_bytes(tensors, num_devices: int, *, per_element: bool = True) -> list[int]:
    """Bytes (or with ``per_element=False``, elements) each device holds of ``tensors``."""
    total = [0] * num_devices
    for t in tensors:
        for d, n in enumerate(_device_numels(t, num_devices)):
            total[d] += n * (t.element_size() if per_element else 1)
    return total


def local_numels(model: nn.Module, num_devices: int) -> list[int]:
    """Parameter elements per device (the counterpart of each FSDP2 rank's shards)."""
    return _device_bytes(model.parameters(), num_devices, per_element=False)


def state_bytes(
    model: nn.Module, optimizer: torch.optim.Optimizer, num_devices: int
) -> list[dict[str, int]]:
    """Per device: parameter, gradient and optimizer-state bytes as the devices hold them (after
    an optimizer step, before zero_grad), the numbers engine.fsdp.state_bytes gives per FSDP2 rank.
    The step's graph runs first: asking a pending tensor for its shards would compile a graph
    of its own for each one."""
    _run_pending()
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [
        v
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.device.type == "xla"
    ]
    parts = {
        "params": _device_bytes(params, num_devices),
        "grads": _device_bytes(grads, num_devices),
        "optimizer": _device_bytes(states, num_devices),
    }
    return [
        {k: v[d] for k, v in parts.items()} | {"total": sum(v[d] for v in parts.values())}
        for d in range(num_devices)
    ]


# ---- checkpoints: torch.distributed.checkpoint with torch_xla's SPMD planners ---------------
# Keys are the plain parameter names and the optimizer state is keyed by them, the layout
# torch's get_model/optimizer_state_dict give FSDP2 runs, so the launcher's shape check and
# resume rules are the same for both.


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The plain name of each parameter in the optimizer's order (its state_dict's indices)."""
    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    names, raw = _param_names(model, optimizer), optimizer.state_dict()
    return {
        "state": {names[i]: s for i, s in raw["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in raw["param_groups"]
        ],
    }


def state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The live (sharded, on-device) training state, keyed by plain names."""
    return {
        "model": {clean_name(k): v for k, v in model.state_dict().items()},
        "optim": _optimizer_state(model, optimizer),
    }


class XlaCheckpointIO(ShardedStateIO):
    """What checkpoint=sharded saves and loads on hardware=tpu (``engine.sharded.ShardedStateIO``):
    every host writes the shards its devices hold; loading writes into the live sharded tensors
    in place."""

    def save(self, model, optimizer, path: Path) -> None:
        _run_pending()
        dcp.save(state_dict(model, optimizer), checkpoint_id=str(path), planner=SPMDSavePlanner())

    def load(self, model, optimizer, path: Path, *, reader=None) -> None:
        """``reader``: the checkpoint's storage reader (state.safe_load's, whose metadata
        unpickler admits only DCP's own types); BYTE_IO items are read with weights_only."""
        if not optimizer.state:  # DCP loads in place: the moments must exist first
            prime_optimizer(optimizer)
            optimizer.zero_grad(set_to_none=True)  # its zero gradients, full-size, go now
        state = state_dict(model, optimizer)
        dcp.load(
            state, checkpoint_id=str(path), storage_reader=reader, planner=_PlainBytesLoadPlanner()
        )
        by_name = {name: i for i, name in enumerate(_param_names(model, optimizer))}
        optim = state["optim"]
        optimizer.load_state_dict(
            {
                "state": {by_name[n]: s for n, s in optim["state"].items()},
                "param_groups": [
                    {**g, "params": [by_name[n] for n in g["params"]]}
                    for g in optim["param_groups"]
                ],
            }
        )
        _run_pending()


class _PlainBytesLoadPlanner(SPMDLoadPlanner):
    """torch_xla's planner, reading BYTE_IO items (the optimizer's param_groups) as plain data
    only: its own load_bytes calls torch.load without weights_only."""

    def load_bytes(self, read_item, value) -> None:
        value = torch.load(value, weights_only=True)
        torch_private.set_element(
            self.original_state_dict, self.mappings[read_item.dest_index.fqn], value
        )


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer whole on the host (each copy gathers a sharded tensor)."""
    _run_pending()
    return {clean_name(k): v.cpu() for k, v in model.state_dict().items()}
