"""Checkpoints that are complete or invisible: save, find, verify, resume, retain.

Layout under the checkpoint root (default <run dir>/checkpoints):

    step_00000040/            a complete checkpoint: renamed into place only when whole
        .metadata, *.distcp   (sharded) model + optimizer, DCP format, any world size can load it
        model.pt, optim.pt    (full) consolidated state dicts written by rank 0
        trainer.pt            step, tokens seen, data position, LR scheduler, grad scaler, config
        rng/rank{r}.pt        each rank's RNG states
        COMPLETE.json         written last: step, format, world size, every file and its size
    step_00000050.tmp/        a save in progress (or one a crash cut short): never resumed from
    latest                    the name of the newest complete checkpoint, replaced atomically

Model and optimizer state go through torch.distributed.checkpoint.state_dict get/set, keyed by
parameter name, so a checkpoint of one strategy or world size loads into any other.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
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

from fsdp_lab.config import CheckpointConfig, CheckpointFormat, ConfigError
from fsdp_lab.engine import hardware

log = logging.getLogger(__name__)

MARKER, LATEST, TRAINER_FILE = "COMPLETE.json", "latest", "trainer.pt"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: names the checkpoint, the file and what to do."""


@dataclass
class Restored:
    step: int
    tokens_seen: int
    data_state: dict | None = None  # the loader's position (rows consumed, epoch, data id)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_root(cfg: CheckpointConfig, run_dir: Path) -> Path:
    return Path(cfg.dir).expanduser().resolve() if cfg.dir else run_dir / "checkpoints"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first (a dir counts once its marker exists)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names, if complete; else the newest complete one."""
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if (named / MARKER).is_file():
            return named
    done = complete_checkpoints(root)
    return done[-1] if done else None


def resolve_resume(resume: str, root: Path) -> Path | None:
    """The checkpoint this run starts from (None: fresh). Decided once, before launch."""
    match resume:
        case "never":
            return None
        case "auto":
            return latest_checkpoint(root)
        case _:
            path = Path(resume).expanduser().resolve()
            if (path / MARKER).is_file():
                return path
            for candidate in (path, path / "checkpoints"):
                found = latest_checkpoint(candidate)
                if found is not None:
                    return found
            raise CheckpointError(
                f"resume={resume}: no complete checkpoint there (a checkpoint dir holds "
                f"{MARKER}); point resume at a checkpoint, a run dir or a checkpoint root"
            )


def verify(path: Path) -> dict:
    """Check every file the marker lists is there at its size; return the marker."""
    marker = json.loads((path / MARKER).read_text())
    for rel, size in marker["files"].items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(
                f"checkpoint {path} is damaged: {rel} is missing; resume from an earlier "
                "checkpoint (resume=<its path>) or remove this one"
            )
        if f.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {rel} has {f.stat().st_size} bytes, expected "
                f"{size}; resume from an earlier checkpoint (resume=<its path>) or remove this one"
            )
    return marker


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state(device: torch.device) -> dict:
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "device": hardware.device_rng_state(device),
    }


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    hardware.set_device_rng_state(device, state["device"])


class Checkpointer:
    """Saves and restores one run's training state; every rank calls every method.

    ``io`` writes and reads the sharded model and optimizer state when the engine has its own
    way (engine.xla on tpu); None: FSDP2's DTensors through torch's state-dict helpers."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        root: Path,
        *,
        model,
        optimizer,
        scheduler,
        scaler,
        config: dict,
        device: torch.device,
        data=None,
        io=None,
    ) -> None:
        self.cfg, self.root, self.data, self.io = cfg, root, data, io
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler = scheduler, scaler
        self.config, self.device = config, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._pending: tuple | None = None  # (future, tmp dir, step, tokens) of an async save
        # Background saves run their collectives on a group of their own, so they never
        # interleave with the training step's collectives on the default group.
        self._async_group = dist.new_group(backend="gloo") if cfg.async_enabled else None

    @property
    def enabled(self) -> bool:
        return self.cfg.format is not CheckpointFormat.none

    def should_save(self, step: int) -> bool:
        n = self.cfg.every_n_steps
        return self.enabled and n > 0 and step % n == 0

    # ---- save -----------------------------------------------------------------------------
    def save(self, step: int, tokens_seen: int, *, blocking: bool = False) -> None:
        """Write the state after optimizer step ``step``; it becomes visible only when whole."""
        self.wait()  # one save in flight at a time
        final = self.root / step_dir_name(step)
        tmp = self.root / (final.name + ".tmp")
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save a crash cut short
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        torch.save(_rng_state(self.device), tmp / "rng" / f"rank{self.rank}.pt")
        match self.cfg.format:
            case CheckpointFormat.sharded if self.io is not None:
                self.io.save(self.model, self.optimizer, tmp)
            case CheckpointFormat.sharded:
                state = {
                    "model": get_model_state_dict(self.model),
                    "optim": get_optimizer_state_dict(self.model, self.optimizer),
                }
                if self.cfg.async_enabled and not blocking:
                    future = dcp.async_save(
                        state, checkpoint_id=str(tmp), process_group=self._async_group
                    )
                    self._pending = (future, tmp, step, tokens_seen)
                    return
                dcp.save(state, checkpoint_id=str(tmp))
            case CheckpointFormat.full:
                opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
                model_sd = get_model_state_dict(self.model, options=opts)
                optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
                if self.rank == 0:
                    torch.save(model_sd, tmp / "model.pt")
                    torch.save(optim_sd, tmp / "optim.pt")
            case _:
                raise ValueError(f"cannot save checkpoint.format={self.cfg.format}")
        self._finalize(tmp, step, tokens_seen)

    def poll(self) -> None:
        """Finish an async save once every rank's background write is done (call each step)."""
        if self._pending is None:
            return
        done = torch.tensor(
            [1.0 if self._pending[0].done() else 0.0],
            device=hardware.collective_device(self.device),
        )
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item() == 1.0:
            self.wait()

    def wait(self) -> None:
        """Block until an async save in flight is written and made visible."""
        if self._pending is None:
            return
        future, tmp, step, tokens = self._pending
        self._pending = None
        future.result()
        self._finalize(tmp, step, tokens)

    def _finalize(self, tmp: Path, step: int, tokens_seen: int) -> None:
        """After every rank wrote: rank 0 adds the trainer state and the marker, renames the
        dir into place, then moves `latest`, then prunes old checkpoints, in that order."""
        dist.barrier()
        if self.rank == 0:
            torch.save(
                {
                    "step": step,
                    "tokens_seen": tokens_seen,
                    "scheduler": self.scheduler.state_dict(),
                    "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                    "data": self.data.state(step) if self.data is not None else None,
                    "config": self.config,
                },
                tmp / TRAINER_FILE,
            )
            files = {
                str(p.relative_to(tmp)): p.stat().st_size
                for p in sorted(tmp.rglob("*"))
                if p.is_file()
            }
            marker = {
                "step": step,
                "format": self.cfg.format.name,
                "world_size": self.world,
                "files": files,
            }
            _fsync_write(tmp / MARKER, json.dumps(marker, indent=1).encode())
            _fsync_dir(tmp)
            final = self.root / step_dir_name(step)
            if final.exists():  # the same step saved again (a rerun): swap, never half-replace
                old = final.with_name(final.name + ".replaced")
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                tmp.rename(final)
                shutil.rmtree(old)
            else:
                tmp.rename(final)
            pointer_tmp = self.root / (LATEST + ".tmp")
            _fsync_write(pointer_tmp, final.name.encode())
            pointer_tmp.replace(self.root / LATEST)
            _fsync_dir(self.root)
            for old in complete_checkpoints(self.root)[: -self.cfg.keep_last]:
                shutil.rmtree(old)
            log.info("checkpoint saved: %s", final)
        dist.barrier()

    # ---- resume ---------------------------------------------------------------------------
    def load(self, path: Path) -> Restored:
        """Restore model, optimizer, scheduler, scaler and RNG from a complete checkpoint."""
        marker = json.loads((path / MARKER).read_text())
        trainer = torch.load(path / TRAINER_FILE, weights_only=False)
        match CheckpointFormat[marker["format"]]:
            case CheckpointFormat.sharded if self.io is not None:
                self.io.load(self.model, self.optimizer, path)
            case CheckpointFormat.sharded:
                state = {
                    "model": get_model_state_dict(self.model),
                    "optim": get_optimizer_state_dict(self.model, self.optimizer),
                }
                dcp.load(state, checkpoint_id=str(path))
                set_model_state_dict(self.model, state["model"])
                set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
            case CheckpointFormat.full:
                opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
                model_sd = optim_sd = {}
                if self.rank == 0:
                    model_sd = torch.load(path / "model.pt", mmap=True, weights_only=True)
                # set_*_state_dict broadcasts from rank 0; other ranks pass empty dicts.
                set_model_state_dict(self.model, model_sd, options=opts)
                if self.rank == 0:
                    optim_sd = torch.load(path / "optim.pt", mmap=True, weights_only=False)
                set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=opts)
            case other:
                raise CheckpointError(f"checkpoint {path} has format {other}; cannot resume")
        self.scheduler.load_state_dict(trainer["scheduler"])
        if self.scaler is not None and trainer["scaler"] is not None:
            self.scaler.load_state_dict(trainer["scaler"])
        rng = path / "rng" / f"rank{self.rank}.pt"
        if marker["world_size"] == self.world and rng.is_file():
            _set_rng_state(torch.load(rng, weights_only=False), self.device)
        elif self.rank == 0:
            log.warning(
                "checkpoint from %d ranks resumed on %d: RNG states are not restored",
                marker["world_size"],
                self.world,
            )
        log.info("resumed from %s (step %d)", path, trainer["step"])
        return Restored(
            step=trainer["step"], tokens_seen=trainer["tokens_seen"], data_state=trainer.get("data")
        )


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape as stored in a checkpoint, read without loading any weights."""
    marker = json.loads((path / MARKER).read_text())
    if marker["format"] == CheckpointFormat.full.name:
        sd = torch.load(path / "model.pt", mmap=True, weights_only=True)
        return {k: tuple(v.shape) for k, v in sd.items()}
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {
        k.removeprefix("model."): tuple(v.size)
        for k, v in meta.items()
        if k.startswith("model.") and hasattr(v, "size")
    }


def check_compatible(path: Path, model: torch.nn.Module) -> None:
    """A checkpoint of another model fails before launch, naming a parameter that differs.

    ``model`` may be on the meta device: only names and shapes are compared.
    """
    saved = saved_shapes(path)
    for name, tensor in model.state_dict().items():
        if name not in saved:
            raise CheckpointError(
                f"checkpoint {path} has no {name}: it is of another model; set resume=never "
                "or point resume at a checkpoint of this model"
            )
        if saved[name] != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {path} holds {name} with shape {list(saved[name])}, this model "
                f"has {list(tensor.shape)}: it is of another model; set resume=never or point "
                "resume at a checkpoint of this model"
            )
