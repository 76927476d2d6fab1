"""Every private name of torch that fsdp_lab uses, each with the public API it waits for.

A name is looked up when it is used, so an upgrade that moves one fails at that use with a
line naming it and the torch version; ``check()`` looks all of them up at once (the tests run
it on the installed torch). Where torch has a public way, the code here uses it instead."""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fsdp_lab.internals import lookup

Private = functools.partial(lookup.Private, "torch")

NAMES = {
    "flatten": Private(
        "torch.distributed.device_mesh",
        "DeviceMesh._flatten",
        "a public DeviceMesh.flatten (the mesh's axes merged into one)",
    ),
    "unflatten": Private(
        "torch.distributed.device_mesh",
        "DeviceMesh._unflatten",
        "a public DeviceMesh.unflatten (one axis split into named ones)",
    ),
    "fsdp_state": Private(
        "torch.distributed.fsdp",
        "FSDPModule._get_fsdp_state",
        "an FSDPModule getter beside set_reshard_after_forward",
    ),
    "all_gather_base": Private(
        "torch.distributed.fsdp._fully_shard._fsdp_collectives",
        "DefaultAllGather",
        "a public base class for set_custom_all_gather's hook",
    ),
    "all_to_all": Private(
        "torch.distributed._functional_collectives",
        "all_to_all_single_autograd",
        "public functional collectives with autograd",
    ),
    "wait_tensor": Private(
        "torch.distributed._functional_collectives",
        "wait_tensor",
        "public functional collectives",
    ),
    "reduce_scatter_op": Private(
        "torch",
        "ops._c10d_functional.reduce_scatter_tensor.default",
        "a public name for the functional reduce-scatter operator",
    ),
    "checkpoint_wrapper": Private(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "checkpoint_wrapper",
        "a public module wrapper for torch.utils.checkpoint",
    ),
    "CheckpointImpl": Private(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "CheckpointImpl",
        "a public module wrapper for torch.utils.checkpoint",
    ),
    "CheckpointWrapper": Private(
        "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
        "CheckpointWrapper",
        "a public module wrapper for torch.utils.checkpoint",
    ),
    "local_shape_and_offset": Private(
        "torch.distributed.tensor._utils",
        "compute_local_shape_and_global_offset",
        "a public DTensor method for the local shard's offset",
    ),
    "TorchDispatchMode": Private(
        "torch.utils._python_dispatch",
        "TorchDispatchMode",
        "a public dispatch-mode base class",
    ),
    "tree_leaves": Private("torch.utils._pytree", "tree_leaves", "a public torch.utils.pytree"),
    "grouped_mm": Private("torch", "_grouped_mm", "torch.nn.functional.grouped_mm"),
    "record_memory_history": Private(
        "torch.cuda.memory",
        "_record_memory_history",
        "a public memory-history recorder (documented under its private name)",
    ),
    "dump_snapshot": Private(
        "torch.cuda.memory", "_dump_snapshot", "a public memory snapshot (documented, private)"
    ),
    "snapshot": Private(
        "torch.cuda.memory", "_snapshot", "a public memory snapshot (documented, private)"
    ),
    "trace_plot": Private(
        "torch.cuda._memory_viz", "trace_plot", "a public HTML view of a memory snapshot"
    ),
    "oom_observer": Private(
        "torch._C",
        "_cuda_attach_out_of_memory_observer",
        "a public out-of-memory callback",
        cuda=True,
    ),
    "c10d": Private("torch._C", "_distributed_c10d", "a public flight-recorder dump"),
    "default_store": Private(
        "torch.distributed.distributed_c10d",
        "_get_default_store",
        "a public handle on the default group's store",
    ),
    "scale_async": Private(
        "torch.amp",
        "GradScaler._get_scale_async",
        "a GradScaler.get_scale that stays on the device",
    ),
    "storage_cdata": Private(
        "torch",
        "UntypedStorage._cdata",
        "a public identity of a storage (data_ptr is 0 for every meta tensor)",
    ),
}
# Loggers named by module path: quieted, so a moved one only speaks again.
REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


def check() -> list[str]:
    """Each name this torch lacks, as a line (empty: every one is where fsdp_lab looks)."""
    public_grouped_mm = hasattr(torch.nn.functional, "grouped_mm")  # then that one is used
    return lookup.missing(
        private
        for key, private in NAMES.items()
        if not (key == "grouped_mm" and public_grouped_mm)
        and not (private.cuda and not torch.backends.cuda.is_built())
    )


# -- DeviceMesh ---------------------------------------------------------------------------------


def flatten_mesh(mesh, name: str):
    """``mesh``'s axes merged into one named ``name`` (the same ranks and process groups)."""
    return NAMES["flatten"].get()(mesh, name)


def unflatten_mesh(mesh, dim: int, sizes: Sequence[int], names: Sequence[str]):
    """``mesh``'s axis ``dim`` split into ``sizes``, named ``names``."""
    return NAMES["unflatten"].get()(mesh, dim, tuple(sizes), tuple(names))


# -- FSDP2 --------------------------------------------------------------------------------------


@contextlib.contextmanager
def kept_gathered(root: nn.Module, units: list[nn.Module]) -> Iterator[None]:
    """Each of ``units`` (FSDP units of ``root``) keeps its parameters gathered after its
    forward in the block; at its end each is resharded and its own setting restored. FSDP2
    has a setter and no getter: each unit's setting is read from its state once the root's
    first-forward set-up (which sets the root's own) has run. Waits for a getter of
    ``reshard_after_forward`` on FSDPModule."""
    state_of = NAMES["fsdp_state"].get()
    state_of(root)._lazy_init()
    saved = []
    for unit in units:
        state = state_of(unit)
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g for g in [state._fsdp_param_group] if g is not None]
        infos = [(g, g.post_forward_mesh_info) for g in groups]
        saved.append((state, getattr(state, "_auto_reshard_after_forward", None), infos))
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
        for state, auto, infos in saved:
            if auto is not None:
                state._auto_reshard_after_forward = auto
            for group, info in infos:
                group.post_forward_mesh_info = info


def all_gather_base() -> type:
    """The base of FSDP2's all-gather hooks (``set_custom_all_gather``)."""
    return NAMES["all_gather_base"].get()


# -- collectives, checkpointing, DTensor --------------------------------------------------------


def all_to_all_single_autograd(send, out_sizes, in_sizes, group):
    """An all-to-all whose backward is the reverse all-to-all, waited on (kernels read raw
    pointers)."""
    recv = NAMES["all_to_all"].get()(send, out_sizes, in_sizes, group)
    return NAMES["wait_tensor"].get()(recv)


def reduce_scatter_op():
    """The functional reduce-scatter's operator (selective checkpointing saves its output)."""
    return NAMES["reduce_scatter_op"].get()


def checkpoint_wrapper(module: nn.Module, **kwargs) -> nn.Module:
    """``module`` recomputed in backward (torch.utils.checkpoint, non-reentrant)."""
    impl = NAMES["CheckpointImpl"].get()
    return NAMES["checkpoint_wrapper"].get()(module, checkpoint_impl=impl.NO_REENTRANT, **kwargs)


def is_checkpoint_wrapper(module: nn.Module) -> bool:
    return isinstance(module, NAMES["CheckpointWrapper"].get())


def local_shape_and_offset(shape, mesh, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A DTensor's local shard: its shape and its offset in the full tensor."""
    return NAMES["local_shape_and_offset"].get()(shape, mesh, placements)


def dispatch_mode_base() -> type:
    """The base class of a mode that sees every aten operator a region runs."""
    return NAMES["TorchDispatchMode"].get()


def tree_leaves(tree) -> list:
    return NAMES["tree_leaves"].get()(tree)


def grouped_mm() -> Callable:
    """torch's grouped GEMM: the public ``torch.nn.functional.grouped_mm`` where it exists."""
    return getattr(torch.nn.functional, "grouped_mm", None) or NAMES["grouped_mm"].get()


def default_store():
    """The default process group's key-value store (rank 0's TCPStore under a launcher)."""
    return NAMES["default_store"].get()()


def scale_on_device(scaler) -> torch.Tensor:
    """A GradScaler's scale as a tensor on its device (``get_scale`` reads it to the host)."""
    return NAMES["scale_async"].get()(scaler)


def storage_key(t: torch.Tensor) -> tuple[int, Any]:
    """A key the same for tensors sharing one storage, meta ones included, and the storage."""
    storage = t.untyped_storage()
    return NAMES["storage_cdata"].get().__get__(storage), storage


# -- a module's own tensors ---------------------------------------------------------------------


def own_tensors(module: nn.Module, *, persistent: bool = True) -> list[tuple[str, torch.Tensor]]:
    """``module``'s own parameters, then its buffers (with ``persistent``, only those its state
    dict holds), by attribute: shared ones repeated, unset ones left out."""
    skip = non_persistent_buffers(module) if persistent else set()
    return list(module.named_parameters(recurse=False, remove_duplicate=False)) + [
        (n, b)
        for n, b in module.named_buffers(recurse=False, remove_duplicate=False)
        if n not in skip
    ]


def non_persistent_buffers(module: nn.Module) -> set[str]:
    """The names of ``module``'s own buffers its state dict leaves out (rotary ``inv_freq``).
    Waits for a public ``persistent=`` filter on ``named_buffers``."""
    return set(module._non_persistent_buffers_set)


@contextlib.contextmanager
def lent(tensors: Sequence[tuple[nn.Module, str, Any]]) -> Iterator[None]:
    """Each (module, attribute, tensor): the module's parameter or buffer of that name is
    ``tensor`` (a plain tensor, a Parameter or a DTensor's local part) until the block ends,
    then its own again. Waits for a public way to lend a module tensors for a call other than
    its forward (``torch.func.functional_call`` lends them to forward only)."""
    saved = []
    try:
        for module, attr, tensor in tensors:
            store = module._parameters if attr in module._parameters else module._buffers
            saved.append((store, attr, store[attr]))
            store[attr] = tensor
        yield
    finally:
        for store, attr, value in reversed(saved):
            store[attr] = value


# -- state dicts --------------------------------------------------------------------------------


def set_element(root: dict, path: Sequence[str | int], value: Any) -> None:
    """``value`` at ``path`` in the nested dicts and lists of ``root`` (DCP's object path: a
    str key makes a dict, an int one a list), as DCP's own loader sets a read item."""
    container: Any = root
    for key, nxt in itertools.pairwise(path):
        empty = {} if isinstance(nxt, str) else []
        if isinstance(container, Mapping):
            container = container.setdefault(key, empty)
        else:
            container.extend([None] * (key + 1 - len(container)))
            if container[key] is None:
                container[key] = empty
            container = container[key]
    last = path[-1]
    if isinstance(last, int):
        container.extend([None] * (last + 1 - len(container)))
    container[last] = value


# -- CUDA memory and the flight recorder --------------------------------------------------------


def record_memory_history(max_entries: int | None) -> None:
    """Every allocation and free recorded with its stack from now; None stops recording."""
    record = NAMES["record_memory_history"].get()
    if max_entries is None:
        record(enabled=None)
    else:
        record(max_entries=max_entries)


def dump_memory_snapshot(path: str) -> None:
    NAMES["dump_snapshot"].get()(path)


def memory_history_html() -> str:
    """torch's own HTML view of the recorded history."""
    return NAMES["trace_plot"].get()(NAMES["snapshot"].get()())


def on_out_of_memory(callback: Callable[[], None]) -> None:
    NAMES["oom_observer"].get()(lambda *args: callback())


def flight_records(nccl: bool) -> list[bytes]:
    """The flight recorders' dumps: NCCL's first (where asked and built), then gloo's."""
    c10d = NAMES["c10d"].get()
    has_nccl = nccl and hasattr(c10d, "_dump_nccl_trace")
    return ([c10d._dump_nccl_trace()] if has_nccl else []) + [c10d._dump_fr_trace()]
