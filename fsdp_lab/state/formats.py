"""The checkpoint formats, one reader/writer each behind ``StateFormat``: the only place that
writes and reads a format's model and optimizer state (``safe_load.scan`` opens the same files
first, to read every pickle in them through its guard before any rank loads one).

| checkpoint.format | files                          | written by           | read by            |
| sharded           | .metadata, __{rank}_*.distcp   | every rank (DCP)     | any world size     |
| full              | model.pt, optim.pt             | rank 0, consolidated | rank 0, broadcast  |

An engine with its own sharded io (``engine.sharded.ShardedStateIO``: XLA's) replaces the DCP
writer of checkpoint=sharded with ``EngineSharded``; the files are DCP's all the same. The rest
of a checkpoint (trainer.json, RNG states, the marker, the atomic rename) is the
``checkpoint.Checkpointer``'s and the same for every format. A new format is a
``CheckpointFormat``, a class here and its row in ``STATE_FORMATS``.
"""

from __future__ import annotations

import re
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdp_lab.config import CheckpointFormat
from fsdp_lab.engine import finetune
from fsdp_lab.engine.sharded import ShardedStateIO
from fsdp_lab.state import integrity, safe_load


@dataclass(frozen=True)
class FrozenBase:
    """How much of the model a checkpoint holds. A fine-tune of a pretrained model
    (finetune=freeze or lora with model.pretrained=true) saves only its trainable parameters:
    the frozen base is read again from ``source`` at resume, and must then have
    ``fingerprint`` (``loading.frozen_fingerprint``), or the resume is refused. Every other
    run saves the whole model (a random-init base cannot be read again from anywhere)."""

    trainable: frozenset[str] | None = None  # the names saved; None: the whole model
    fingerprint: str | None = None  # of the frozen parameters; None: nothing is frozen
    source: str | None = None  # model.name_or_path the base is read from

    @classmethod
    def of(cls, cfg, sharded) -> FrozenBase:

        fingerprint = sharded.frozen_fingerprint
        if fingerprint is None or not cfg.model.pretrained:
            return cls(fingerprint=fingerprint)
        names = frozenset(finetune.trainable_names(sharded.model))
        return cls(trainable=names, fingerprint=fingerprint, source=cfg.model.name_or_path)

    def record(self) -> dict:
        """What trainer.json says of it."""
        return {
            "saved": self.trainable is None,
            "fingerprint": self.fingerprint,
            "source": self.source,
        }

    def keep(self, model_sd: dict) -> dict:
        """The entries of a model state dict a checkpoint holds."""
        if self.trainable is None:
            return model_sd
        return {k: v for k, v in model_sd.items() if k in self.trainable}


class SaveGuard(Protocol):
    """How a format's write fails: on every rank together (``save_guard.SaveGuard``; named by
    its interface here, as save_guard reads ``layout``, which imports this module)."""

    def agree(self, fn: Callable, *args) -> list:
        """Run this rank's part; if it failed on any rank, fail on every rank."""
        ...

    def collective(self, fn: Callable) -> None:
        """Run a collective write that raises on every rank or none (DCP's)."""
        ...


class StateFormat(ABC):
    """One format's writer and reader of the model and optimizer state. Every rank calls
    ``save`` and ``load``; ``saved_shapes`` and ``tensor_reader`` run in one process."""

    @abstractmethod
    def save(
        self, tmp: Path, *, model, optimizer, frozen: FrozenBase, guard: SaveGuard, async_group
    ):
        """Write the state under ``tmp``; the future of a write going on in the background
        (``async_group``: the process group it runs its collectives on; None: write now),
        else None."""

    @abstractmethod
    def load(self, path: Path, *, model, optimizer, held: FrozenBase) -> None:
        """Read the state back into the live model and optimizer."""

    @abstractmethod
    def saved_shapes(self, path: Path) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape as stored, read without loading any weights."""

    @abstractmethod
    def tensor_reader(self, path: Path) -> Callable[[dict[str, torch.Tensor]], None]:
        """``fill(tensors)``: the saved values of some model tensors (by name) copied into
        them, in this process alone: an export reads one group at a time."""

    def rank_files(self, tmp: Path, rank: int) -> list[str]:
        """The files of the state that rank ``rank`` wrote (it checksums them); rank 0
        checksums the rest."""
        return []


# The optimizer's state and its groups' settings keyed by parameter name
# (``param_groups.<name>.lr``), not by group index: ranks that hold different parameters (a
# pipeline's stages) or another grouping (a stage without 1-D parameters has one group) write
# keys that do not collide, and read back their own under any layout.
FLAT_OPTIMIZER = StateDictOptions(flatten_optimizer_state_dict=True)
# group 0's "lr", or the whole list as one item (torch_xla's writer, engine.xla)
_INDEXED_GROUP = re.compile(r"^optim\.param_groups(\.\d+\.[a-z_]+)?$")


class DcpSharded(StateFormat):
    """checkpoint=sharded on FSDP2: every rank writes its DTensor shards with
    torch.distributed.checkpoint, keyed by parameter name, so any strategy or world size loads
    it."""

    def save(
        self, tmp: Path, *, model, optimizer, frozen: FrozenBase, guard: SaveGuard, async_group
    ):
        state = {
            "model": frozen.keep(get_model_state_dict(model)),
            "optim": get_optimizer_state_dict(model, optimizer, options=FLAT_OPTIMIZER),
        }
        if async_group is not None:
            return dcp.async_save(state, checkpoint_id=str(tmp), process_group=async_group)
        # DCP gathers every rank's write result: all ranks raise, or none.
        guard.collective(lambda: dcp.save(state, checkpoint_id=str(tmp)))
        return None

    def load(self, path: Path, *, model, optimizer, held: FrozenBase) -> None:
        # A checkpoint from before the flat layout keys its optimizer groups by index.
        indexed = any(
            _INDEXED_GROUP.match(k) for k in safe_load.read_metadata(path).state_dict_metadata
        )
        optim = StateDictOptions() if indexed else FLAT_OPTIMIZER
        state = {
            "model": held.keep(get_model_state_dict(model)),
            "optim": get_optimizer_state_dict(model, optimizer, options=optim),
        }
        dcp.load(state, storage_reader=safe_load.Reader(path), planner=safe_load.LoadPlanner(path))
        partial = StateDictOptions(strict=held.trainable is None)
        set_model_state_dict(model, state["model"], options=partial)
        set_optimizer_state_dict(model, optimizer, state["optim"], options=optim)

    def saved_shapes(self, path: Path) -> dict[str, tuple[int, ...]]:
        meta = safe_load.read_metadata(path).state_dict_metadata
        return {
            k.removeprefix("model."): tuple(v.size)
            for k, v in meta.items()
            if k.startswith("model.") and hasattr(v, "size")
        }

    def tensor_reader(self, path: Path) -> Callable[[dict[str, torch.Tensor]], None]:
        def fill(tensors: dict[str, torch.Tensor]) -> None:
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(
                    {"model": tensors},
                    storage_reader=safe_load.Reader(path),
                    planner=safe_load.LoadPlanner(path),
                    no_dist=True,
                )

        return fill

    def rank_files(self, tmp: Path, rank: int) -> list[str]:
        return sorted(p.name for p in tmp.glob(f"__{rank}_*.distcp"))


class EngineSharded(DcpSharded):
    """checkpoint=sharded written and read by the engine's own io (XLA's SPMD planners). The
    files are DCP's, keyed by plain names: shapes and export read them as ``DcpSharded``."""

    def __init__(self, io: ShardedStateIO) -> None:
        self.io = io

    def save(
        self, tmp: Path, *, model, optimizer, frozen: FrozenBase, guard: SaveGuard, async_group
    ):
        guard.agree(lambda: self.io.save(model, optimizer, tmp))
        return None

    def load(self, path: Path, *, model, optimizer, held: FrozenBase) -> None:
        self.io.load(model, optimizer, path, reader=safe_load.Reader(path))


class FullState(StateFormat):
    """checkpoint=full: rank 0 writes the consolidated model and optimizer state dicts, and
    reads them back, broadcasting to the other ranks."""

    def save(
        self, tmp: Path, *, model, optimizer, frozen: FrozenBase, guard: SaveGuard, async_group
    ):
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_sd = frozen.keep(get_model_state_dict(model, options=opts))
        optim_sd = get_optimizer_state_dict(model, optimizer, options=opts)

        def write() -> None:
            if dist.get_rank() == 0:
                torch.save(model_sd, tmp / "model.pt")
                torch.save(optim_sd, tmp / "optim.pt")

        guard.agree(write)
        return None

    def load(self, path: Path, *, model, optimizer, held: FrozenBase) -> None:
        opts = StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True, strict=held.trainable is None
        )
        rank0 = dist.get_rank() == 0
        model_sd = optim_sd = {}
        if rank0:
            model_sd = safe_load.load_plain(path / "model.pt", mmap=True)
        # set_*_state_dict broadcasts from rank 0; other ranks pass empty dicts.
        set_model_state_dict(model, model_sd, options=opts)
        if rank0:
            optim_sd = safe_load.load_plain(path / "optim.pt", mmap=True)
        set_optimizer_state_dict(model, optimizer, optim_sd, options=opts)

    def saved_shapes(self, path: Path) -> dict[str, tuple[int, ...]]:
        sd = safe_load.load_plain(path / "model.pt", mmap=True)
        return {k: tuple(v.shape) for k, v in sd.items()}

    def tensor_reader(self, path: Path) -> Callable[[dict[str, torch.Tensor]], None]:
        saved = safe_load.load_plain(path / "model.pt", mmap=True)  # pages read as touched

        def fill(tensors: dict[str, torch.Tensor]) -> None:
            for name, t in tensors.items():
                t.copy_(saved[name])

        return fill


STATE_FORMATS: dict[CheckpointFormat, StateFormat] = {
    CheckpointFormat.sharded: DcpSharded(),
    CheckpointFormat.full: FullState(),
}


def format_for(fmt: CheckpointFormat, *, engine_io: ShardedStateIO | None = None) -> StateFormat:
    """The reader/writer of ``fmt`` (the engine's own for sharded, where it has one); a format
    without one (none) is a bug of the caller, which checks first."""
    if engine_io is not None and fmt is CheckpointFormat.sharded:
        return EngineSharded(engine_io)
    try:
        return STATE_FORMATS[fmt]
    except KeyError:
        raise RuntimeError(f"checkpoint.format={fmt.name} has no reader/writer") from None


def format_saved_in(path: Path, *, engine_io: ShardedStateIO | None = None) -> StateFormat:
    """The reader of a complete checkpoint, by its marker's format (the engine's own for
    sharded, where it has one). One it does not know, as a marker written by hand might say,
    is refused."""
    name = integrity.read_marker(path)["format"]
    fmt = CheckpointFormat.__members__.get(name)
    if fmt not in STATE_FORMATS:
        raise integrity.CheckpointError(f"checkpoint {path} has format {name}; cannot resume")
    return format_for(fmt, engine_io=engine_io)


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape as stored in a checkpoint, read without loading any weights."""
    return format_saved_in(path).saved_shapes(path)
