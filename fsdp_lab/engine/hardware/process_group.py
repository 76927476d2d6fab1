"""The process group: its backend, joining it, where collectives' tensors live, gathering
from every process, rank 0's solo work, and torch's flight recorder of the collectives."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_lab.config import Backend, ConfigError, HardwareKind
from fsdp_lab.config.hardware_kinds import hardware_row, kind_of
from fsdp_lab.internals import torch_private


def backend(kind: HardwareKind, chosen: Backend = Backend.auto) -> str:
    """torch's backend string. On GPU, NCCL for CUDA tensors plus gloo for CPU ones: with
    offload=cpu the gradient shards (and so clip_grad_norm_'s all-reduce) live on the CPU, which
    NCCL cannot reduce. ``hardware.backend=gloo`` puts CUDA tensors on gloo too (ranks sharing
    a GPU); nccl anywhere but gpu is refused."""
    nccl = hardware_row(kind).nccl
    if chosen is Backend.nccl and not nccl:
        raise ConfigError(
            f"hardware.backend=nccl needs hardware={kind_of('cuda').name} (this run is "
            f"hardware={kind.value}); remove hardware.backend (auto: gloo here)"
        )
    if nccl and chosen is not Backend.gloo:
        return "cuda:nccl,cpu:gloo"
    return "gloo"


def init_process_group(
    kind: HardwareKind, device: torch.device, timeout_s: int, chosen: Backend = Backend.auto
) -> None:
    """Join the group described by the launcher's RANK/WORLD_SIZE/MASTER_* variables."""
    dist.init_process_group(
        backend=backend(kind, chosen),
        timeout=datetime.timedelta(seconds=timeout_s),
        device_id=device if hardware_row(kind).nccl else None,
    )


def collective_device(device: torch.device) -> torch.device:
    """Where small tensors for the process group's collectives live: gloo and NCCL reduce CPU
    and CUDA tensors, not XLA ones (on tpu the process group only joins the host processes)."""
    return torch.device("cpu") if device.type == "xla" else device


# Rank 0 can work alone for longer than the collective timeout (which is there to catch dead
# ranks): reading a large pretrained model, tokenising a corpus. The other ranks wait for it on
# the rendezvous store, whose wait takes a timeout of its own, instead of inside a collective.
SOLO_WORK_TIMEOUT = datetime.timedelta(hours=2)


def gather_from_processes(value) -> list:
    """Every process's ``value`` (any picklable object), in rank order. A collective: every
    process of the group calls it."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# torch 2.13 names the tensor collectives *_single (the *_tensor names warn); older ones lack it.
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def all_gather_single(out: torch.Tensor, local: torch.Tensor, group) -> None:
    """``out`` = every rank's ``local``, concatenated on dim 0 in rank order."""
    _ALL_GATHER(out, local, group=group)


def reduce_scatter_single(out: torch.Tensor, whole: torch.Tensor, group) -> None:
    """``out`` = this rank's dim-0 part of the sum of every rank's ``whole``."""
    _REDUCE_SCATTER(out, whole, op=dist.ReduceOp.SUM, group=group)


def after_rank0(name: str) -> None:
    """Rank 0 calls this when its solo work ``name`` is done; the others block here until then
    (a failed rank 0 ends them anyway: the launcher or torchrun stops the group)."""
    key = f"fsdp_lab/{name}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store = torch_private.default_store()
    if dist.get_rank() == 0:
        store.set(key, "done")
    else:
        store.wait([key], SOLO_WORK_TIMEOUT)


# Older names torch still reads for the same settings: a user's value under either is kept.
_FR_ENV = {
    "TORCH_FR_BUFFER_SIZE": ("TORCH_NCCL_TRACE_BUFFER_SIZE",),
    "TORCH_FR_DUMP_TEMP_FILE": ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": (),
}


def set_flight_recorder(entries: int, dump_prefix: Path | None) -> None:
    """torch's flight recorder: the last ``entries`` collectives of each process group (0: off),
    read when the group is created. NCCL's watchdog also writes them to ``dump_prefix<rank>``
    on a timeout (gloo has no watchdog: the rank dumps, see ``flight_records``); torch reads that
    name when it dumps. A variable the user set wins."""
    wanted = {"TORCH_FR_BUFFER_SIZE": str(entries)}
    if entries and dump_prefix is not None:
        wanted["TORCH_FR_DUMP_TEMP_FILE"] = str(dump_prefix)
        wanted["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    for name, value in wanted.items():
        if not any(n in os.environ for n in (name, *_FR_ENV[name])):
            os.environ[name] = value


def flight_records() -> list[bytes]:
    """This process's flight recorders now, each collective with its Python stack: pickles of
    plain containers. NCCL keeps a recorder of its own (where CUDA is up), listed first; gloo's
    holds the CPU collectives (all of them on cpu; on gpu those of offloading)."""
    return torch_private.flight_records(nccl=torch.cuda.is_initialized())
