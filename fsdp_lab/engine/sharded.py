"""What the worker knows of an engine: a model sharded for training, and the few things that
depend on how it is sharded, as methods.

Two engines implement ``ShardedModel``: ``engine.fsdp.Fsdp2Model`` (FSDP2 on a device mesh,
cpu and gpu) and ``engine.xla.XlaModel`` (torch_xla SPMD, hardware=tpu). Per-rank lists have
one entry per data-parallel rank (per XLA device on tpu).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from torch import nn


class ShardedStateIO(Protocol):
    """An engine's own writer and reader of checkpoint=sharded, for an engine whose parameters
    torch's state-dict helpers cannot read (XLA's: ``engine.xla.XlaCheckpointIO``). The FSDP2
    engine has none: its DTensors go through ``state.formats``' DCP format."""

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
        """Write the model and optimizer state under ``path``; every rank calls it."""
        ...

    def load(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path, *, reader
    ) -> None:
        """Read them back in place; ``reader`` is the checkpoint's guarded storage reader
        (``state.safe_load.Reader``)."""
        ...


@dataclass(kw_only=True)
class ShardedModel(ABC):
    """A model sharded for training. The fields are facts the report and checkpoints read; the
    methods are what differs between the engines."""

    model: nn.Module
    mesh_shape: list[int]
    mesh_axes: list[str]
    units_desc: str  # the FSDP units, as wrap.summarize_units says them
    num_units: int  # units plus the root
    recomputed_units: list[int]  # activation checkpointing: the units recomputed in backward
    checkpoint_io: ShardedStateIO | None = None  # sharded checkpoints' io; None: DTensors
    param_specs: dict[str, str] | None = None  # XLA sharding annotation per parameter
    frozen_fingerprint: str | None = None  # of the frozen base (loading.frozen_fingerprint)
    low_precision: dict | None = None  # float8 / NF4 layers (engine.low_precision's record)
    post_step: Callable[[nn.Module], None] | None = None  # after each optimizer step
    pipeline: object | None = None  # engine.pipeline.Pipeline: this rank's stages; None: no PP

    @contextlib.contextmanager
    def weights_kept_gathered(self, enabled: bool = True) -> Iterator[None]:
        """Within the block, many small forwards (generation's, one token at a time) gather
        each unit's weights once instead of at every forward, where the engine can (FSDP2);
        the weights are sharded again after it. This default: as every forward does."""
        yield

    @contextlib.contextmanager
    def generation_model(self, keep_gathered: bool = True) -> Iterator[nn.Module]:
        """The model generation and harness scoring run, for the block: this one, its
        weights kept gathered where ``keep_gathered`` (``weights_kept_gathered``)."""
        with self.weights_kept_gathered(keep_gathered):
            yield self.model

    def after_optimizer_step(self) -> None:
        """What the engine does once the weights moved (float8: their scales, precomputed)."""
        if self.post_step is not None:
            self.post_step(self.model)

    @abstractmethod
    def place_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This process's rows of a micro-batch onto its devices."""

    @abstractmethod
    def local_numels(self) -> list[int]:
        """Parameter elements per rank (a collective on FSDP2: every rank calls it)."""

    @abstractmethod
    def state_bytes(self, optimizer: torch.optim.Optimizer) -> list[dict[str, int]]:
        """Model state bytes per rank: params, grads, optimizer (after a step, before
        zero_grad)."""

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Whole weights on the host of rank 0 (others: {}); every rank calls it."""

    def owned_tensors(self) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
        """Every parameter and persistent buffer once, by the name the plain Hugging Face model
        gives it (``conversion.owned_tensors``: without the engine's wrappers), cached."""
        if not hasattr(self, "_owned"):
            from fsdp_lab.engine import conversion

            self._owned = {
                self.clean_name(name): entry
                for name, entry in conversion.owned_tensors(self.model).items()
            }
        return self._owned

    def export_names(self) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
        """What an export writes, by plain name (``full_tensors`` reads them): this rank's
        tensors, or under a pipeline the unsplit model's (on meta)."""
        return self.owned_tensors()

    @staticmethod
    def clean_name(name: str) -> str:
        """A name without what this engine wraps the model in, beyond activation checkpointing
        (which ``conversion.owned_tensors`` strips already)."""
        return name

    def full_tensors(self, names: list[str]) -> dict[str, torch.Tensor] | None:
        """The whole tensors ``names`` (clean names) on the host of rank 0 (others: None); every
        rank calls it with the same names. An export's read, one group at a time. This default
        gathers the whole state once (an engine without per-tensor gathers: XLA's)."""
        if not hasattr(self, "_whole"):
            self._whole = self.full_state_dict()
        return {n: self._whole[n] for n in names} if self._whole else None
