"""Checkpoints that are complete or invisible: save, find, verify, resume, retain.

Layout under the checkpoint root (default <run dir>/checkpoints):

    step_00000040/            a complete checkpoint: renamed into place only when whole
        .metadata, *.distcp   (sharded) model + optimizer, DCP format, any world size can load it
        model.pt, optim.pt    (full) consolidated state dicts written by rank 0
        trainer.json          step, tokens seen, data position, LR scheduler, grad scaler, config
        rng/rank{r}.pt        each rank's RNG states (tensors and plain containers)
        COMPLETE.json         written last: step, format, world size, every file's size and
                              xxh3-128 digest (integrity)
    step_00000030.damaged/    one that failed verification when resume=auto met it: kept, unused
    step_00000050.tmp/        a save in progress (or one a crash cut short): never resumed from
    latest                    the name of the newest complete checkpoint, replaced atomically

Model and optimizer state go through torch.distributed.checkpoint.state_dict get/set, keyed by
parameter name, so a checkpoint of one strategy or world size loads into any other. Nothing is
unpickled but through the guards of ``safe_load``, and every file is verified (``integrity``)
before any rank loads it.
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

from fsdp_lab.config import CheckpointConfig, CheckpointFormat, CheckpointVerify, OnSaveError
from fsdp_lab.engine import fsdp, hardware
from fsdp_lab.state import integrity, safe_load
from fsdp_lab.state.integrity import MARKER, CheckpointError, verify

__all__ = ["MARKER", "CheckpointError", "verify"]  # re-exported: where callers look for them

log = logging.getLogger(__name__)

LATEST, TRAINER_FILE = "latest", "trainer.json"
DAMAGED_SUFFIX = ".damaged"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointSaveError(CheckpointError):
    """A checkpoint that could not be written; the last complete one is still ``latest``."""


@dataclass(frozen=True)
class FrozenBase:
    """How much of the model a checkpoint holds. A fine-tune of a pretrained model
    (finetune=freeze or lora with model.pretrained=true) saves only its trainable parameters:
    the frozen base is read again from ``source`` at resume, and must then have
    ``fingerprint`` (``finetune.frozen_fingerprint``), or the resume is refused. Every other
    run saves the whole model (a random-init base cannot be read again from anywhere)."""

    trainable: frozenset[str] | None = None  # the names saved; None: the whole model
    fingerprint: str | None = None  # of the frozen parameters; None: nothing is frozen
    source: str | None = None  # model.name_or_path the base is read from

    @classmethod
    def of(cls, cfg, sharded) -> FrozenBase:
        from fsdp_lab.engine import finetune

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


def resolve_resume(
    resume: str, root: Path, mode: CheckpointVerify = CheckpointVerify.checksum
) -> Path | None:
    """The checkpoint this run starts from (None: fresh), verified and scanned as safe to
    read. Decided once, before launch.

    resume=auto over a checkpoint that fails verification falls back to the newest one that
    passes, saying so in one line; the failed one is renamed ``<name>.damaged`` (kept, never
    resumed from). An explicit path that fails is refused."""
    match resume:
        case "never":
            return None
        case "auto":
            return _newest_good(root, mode)
        case _:
            path = Path(resume).expanduser().resolve()
            if not (path / MARKER).is_file():
                found = [latest_checkpoint(c) for c in (path, path / "checkpoints")]
                path = next((p for p in found if p is not None), None)
            if path is None:
                raise CheckpointError(
                    f"resume={resume}: no complete checkpoint there (a checkpoint dir holds "
                    f"{MARKER}); point resume at a checkpoint, a run dir or a checkpoint root"
                )
            check(path, mode)
            return path


def check(path: Path, mode: CheckpointVerify) -> dict:
    """Verify ``path`` as ``mode`` says, then read its pickles through their guards; the
    marker. Raises CheckpointError naming the file."""
    marker = verify(path, mode)
    safe_load.scan(path, marker)
    return marker


def _newest_good(root: Path, mode: CheckpointVerify) -> Path | None:
    first = latest_checkpoint(root)
    candidates = [first] if first is not None else []
    candidates += [p for p in reversed(complete_checkpoints(root)) if p != first]
    for path in candidates:
        try:
            check(path, mode)
        except integrity.CheckpointDamaged as e:  # a refusal (unsafe, too old) is not damage
            kept = _set_aside(path)
            fallback = next((p.name for p in candidates if p.name < path.name), None)
            log.warning(
                "%s; %s (it is kept as %s)",
                e.args[0].split("; ")[0],
                f"resuming from {fallback} instead" if fallback else "no earlier checkpoint",
                kept.name,
            )
            continue
        return path
    return None


def _set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the resume candidates, keeping its files."""
    target = path.with_name(path.name + DAMAGED_SUFFIX)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED_SUFFIX}-{n}")
    path.rename(target)
    return target


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
    """Every RNG state as tensors and plain containers (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    version, py_state, py_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": [version, list(py_state), py_gauss],
        "device": hardware.device_rng_state(device),
    }


def _set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, py_state, py_gauss = state["python"]
    random.setstate((version, tuple(py_state), py_gauss))
    hardware.set_device_rng_state(device, state["device"])


class Checkpointer:
    """Saves and restores one run's training state; every rank calls every method.

    ``io`` writes and reads the sharded model and optimizer state when the engine has its own
    way (engine.xla on tpu); None: FSDP2's DTensors through torch's state-dict helpers."""

    # Many parameters: each part of the training state a checkpoint holds, named (keyword-only).
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
        frozen: FrozenBase | None = None,
    ) -> None:
        self.cfg, self.root, self.data, self.io = cfg, root, data, io
        self.frozen = frozen or FrozenBase()
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
    def save(self, step: int, tokens_seen: int, *, blocking: bool = False) -> bool:
        """Write the state after optimizer step ``step``; it becomes visible only when whole.
        False: it could not be written and checkpoint.on_save_error=continue went on without
        it (stop raises CheckpointSaveError on every rank). Either way ``latest`` and the
        checkpoints before it are as they were."""
        self.wait()  # one save in flight at a time
        tmp = self.root / (step_dir_name(step) + ".tmp")
        try:
            self._check_room(step)
            self._agree(self._prepare, tmp)
            self._agree(self._write_rng, tmp)
            future = self._write_state(tmp, blocking=blocking)
            if future is not None:
                self._pending = (future, tmp, step, tokens_seen)
                return True
            self._finalize(tmp, step, tokens_seen)
        except _SaveFailed as e:
            return self._failed(tmp, step, e.reason)
        return True

    def _prepare(self, tmp: Path) -> None:
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save a crash cut short
            (tmp / "rng").mkdir(parents=True)

    def _write_rng(self, tmp: Path) -> None:
        torch.save(_rng_state(self.device), tmp / "rng" / f"rank{self.rank}.pt")

    def _write_state(self, tmp: Path, *, blocking: bool):
        """The model and optimizer state; the future of an async save going on in the
        background, else None."""
        match self.cfg.format:
            case CheckpointFormat.sharded if self.io is not None:
                self._agree(lambda: self.io.save(self.model, self.optimizer, tmp))
            case CheckpointFormat.sharded:
                state = {
                    "model": self.frozen.keep(get_model_state_dict(self.model)),
                    "optim": get_optimizer_state_dict(self.model, self.optimizer),
                }
                if self.cfg.async_enabled and not blocking:
                    return dcp.async_save(
                        state, checkpoint_id=str(tmp), process_group=self._async_group
                    )
                # DCP gathers every rank's write result: all ranks raise, or none.
                self._collective(lambda: dcp.save(state, checkpoint_id=str(tmp)))
            case CheckpointFormat.full:
                opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
                model_sd = self.frozen.keep(get_model_state_dict(self.model, options=opts))
                optim_sd = get_optimizer_state_dict(self.model, self.optimizer, options=opts)

                def write() -> None:
                    if self.rank == 0:
                        torch.save(model_sd, tmp / "model.pt")
                        torch.save(optim_sd, tmp / "optim.pt")

                self._agree(write)
            case _:
                raise ValueError(f"cannot save checkpoint.format={self.cfg.format}")
        return None

    def _check_room(self, step: int) -> None:
        """Refuse a save that cannot fit: the free space on the checkpoint filesystem against
        the last checkpoint's size (the first: the state bytes every rank will write)."""
        last = latest_checkpoint(self.root)
        need = torch.tensor([0 if last is not None else self._state_bytes()], dtype=torch.int64)
        need = need.to(hardware.collective_device(self.device))
        dist.all_reduce(need)
        needed = integrity.checkpoint_bytes(last) if last is not None else int(need.item())
        verdict = [None]
        if self.rank == 0:
            free = integrity.free_bytes(self.root)
            if free < needed:
                verdict = [
                    f"checkpoint at step {step} needs about {_mb(needed)} and {self.root} has "
                    f"{_mb(free)} free"
                ]
        dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            raise _SaveFailed(verdict[0])

    def _state_bytes(self) -> int:
        """This rank's bytes of model and optimizer state (its shards): what it will write (of
        a fine-tune that leaves its base out, the trainable parameters only)."""
        held = fsdp.state_bytes(self.model, self.optimizer)
        if self.frozen.trainable is None:
            return held["params"] + held["optimizer"]
        trainable = (p for p in self.model.parameters() if p.requires_grad)
        return fsdp.nbytes(trainable) + held["optimizer"]

    def _collective(self, fn) -> None:
        """Run a collective write that raises on every rank or none (DCP's)."""
        try:
            fn()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            log.error("checkpoint write failed", exc_info=True)
            raise _SaveFailed(self._describe(e)) from e

    def _agree(self, fn, *args) -> list:
        """Run this rank's part of a save; if it failed on any rank, fail on every rank, with
        the first failing rank's reason. Else every rank's result of ``fn``, in rank order
        (one gather carries both)."""
        result = reason = None
        try:
            result = fn(*args)
        except Exception as e:  # reported below, on every rank
            log.error("checkpoint write failed on rank %d", self.rank, exc_info=True)
            reason = self._describe(e)
        gathered = hardware.gather_from_processes((reason, result))
        first = next((r for r, _ in gathered if r is not None), None)
        if first is not None:
            raise _SaveFailed(first)
        return [value for _, value in gathered]

    def _describe(self, e: BaseException) -> str:
        return integrity.describe_write_failure(e, self.root)

    def _failed(self, tmp: Path, step: int, reason: str) -> bool:
        """Remove the partial save; stop (raise on every rank) or go on without it."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        last = latest_checkpoint(self.root)
        kept = f"{last.name} is still the latest" if last is not None else "no checkpoint yet"
        message = f"{reason}; {kept}"
        if self.cfg.on_save_error is OnSaveError.stop:
            raise CheckpointSaveError(
                f"{message}; free space (or set checkpoint.dir elsewhere) and run the same "
                "command again to resume, or set checkpoint.on_save_error=continue to train on "
                "without checkpoints that cannot be written"
            )
        if self.rank == 0:
            log.warning(
                "checkpoint at step %d skipped: %s (checkpoint.on_save_error=continue)",
                step,
                message,
            )
        return False

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
        try:
            self._collective(future.result)
            self._finalize(tmp, step, tokens)
        except _SaveFailed as e:
            self._failed(tmp, step, e.reason)

    def _own_files(self, tmp: Path) -> list[str]:
        """The files this rank wrote: its DCP shards and its RNG states."""
        mine = [f"rng/rank{self.rank}.pt"]
        mine += sorted(p.name for p in tmp.glob(f"__{self.rank}_*.distcp"))
        return [n for n in mine if (tmp / n).is_file()]

    def _finalize(self, tmp: Path, step: int, tokens_seen: int) -> None:
        """After every rank wrote: each checksums its own files; rank 0 adds the trainer state,
        checksums the rest and writes the marker, renames the dir into place, then moves
        `latest`, then prunes old checkpoints, in that order."""
        every = self._agree(lambda: integrity.describe(tmp, self._own_files(tmp)))
        self._agree(self._publish, tmp, step, tokens_seen, every)

    def _publish(self, tmp: Path, step: int, tokens_seen: int, every: list[dict]) -> None:
        if self.rank != 0:
            return
        trainer = {
            "step": step,
            "tokens_seen": tokens_seen,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "data": self.data.state(step) if self.data is not None else None,
            "frozen_base": self.frozen.record(),
            "config": self.config,
        }
        _fsync_write(tmp / TRAINER_FILE, json.dumps(trainer, indent=1).encode())
        files: dict[str, dict] = {}
        for part in every:
            files.update(part)
        rest = [n for n in integrity.files_in(tmp) if n not in files]
        files.update(integrity.describe(tmp, rest))
        marker = {
            "version": integrity.MARKER_VERSION,
            "step": step,
            "format": self.cfg.format.name,
            "world_size": self.world,
            "checksum": integrity.DIGEST,
            "files": dict(sorted(files.items())),
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

    # ---- resume ---------------------------------------------------------------------------
    def load(self, path: Path) -> Restored:
        """Restore model, optimizer, scheduler, scaler and RNG from a complete checkpoint
        (verified and scanned by the launcher; read here through the same guards)."""
        marker = integrity.read_marker(path)
        trainer = json.loads((path / TRAINER_FILE).read_text())
        held = self._held(path, trainer)
        match CheckpointFormat[marker["format"]]:
            case CheckpointFormat.sharded if self.io is not None:
                self.io.load(self.model, self.optimizer, path, reader=safe_load.Reader(path))
            case CheckpointFormat.sharded:
                state = {
                    "model": held.keep(get_model_state_dict(self.model)),
                    "optim": get_optimizer_state_dict(self.model, self.optimizer),
                }
                dcp.load(
                    state,
                    storage_reader=safe_load.Reader(path),
                    planner=safe_load.LoadPlanner(path),
                )
                partial = StateDictOptions(strict=held.trainable is None)
                set_model_state_dict(self.model, state["model"], options=partial)
                set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
            case CheckpointFormat.full:
                opts = StateDictOptions(
                    full_state_dict=True,
                    broadcast_from_rank0=True,
                    strict=held.trainable is None,
                )
                model_sd = optim_sd = {}
                if self.rank == 0:
                    model_sd = safe_load.load_plain(path / "model.pt", mmap=True)
                # set_*_state_dict broadcasts from rank 0; other ranks pass empty dicts.
                set_model_state_dict(self.model, model_sd, options=opts)
                if self.rank == 0:
                    optim_sd = safe_load.load_plain(path / "optim.pt", mmap=True)
                set_optimizer_state_dict(self.model, self.optimizer, optim_sd, options=opts)
            case other:
                raise CheckpointError(f"checkpoint {path} has format {other}; cannot resume")
        self.scheduler.load_state_dict(trainer["scheduler"])
        if self.scaler is not None and trainer["scaler"] is not None:
            self.scaler.load_state_dict(trainer["scaler"])
        rng = path / "rng" / f"rank{self.rank}.pt"
        if marker["world_size"] == self.world and rng.is_file():
            _set_rng_state(safe_load.load_plain(rng), self.device)
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

    def _held(self, path: Path, trainer: dict) -> FrozenBase:
        """What of the model ``path`` holds. One without the frozen base resumes only onto the
        same base: its fingerprint must be the one this run's rank 0 read (every rank has both,
        so every rank refuses together)."""
        record = frozen_base_record(trainer)
        if record["saved"]:
            return FrozenBase()
        if record["fingerprint"] != self.frozen.fingerprint:
            raise CheckpointError(
                f"checkpoint {path} holds only the trainable parameters of a fine-tune of "
                f"{record['source']}, and the frozen base this run read from "
                f"model.name_or_path differs from that one (fingerprint "
                f"{str(self.frozen.fingerprint)[:12]}, not {record['fingerprint'][:12]}); set "
                f"model.name_or_path={record['source']} (the same weights) or resume=never"
            )
        return self.frozen


class _SaveFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape as stored in a checkpoint, read without loading any weights."""
    marker = integrity.read_marker(path)
    if marker["format"] == CheckpointFormat.full.name:
        sd = safe_load.load_plain(path / "model.pt", mmap=True)
        return {k: tuple(v.shape) for k, v in sd.items()}
    meta = safe_load.read_metadata(path).state_dict_metadata
    return {
        k.removeprefix("model."): tuple(v.size)
        for k, v in meta.items()
        if k.startswith("model.") and hasattr(v, "size")
    }


def frozen_base_record(trainer: dict) -> dict:
    """trainer.json's ``frozen_base`` (FrozenBase.record): whether the checkpoint holds the
    whole model (one written before fine-tuning existed does), else its base's source and
    fingerprint."""
    return trainer.get("frozen_base") or {"saved": True}


def check_compatible(path: Path, model: torch.nn.Module) -> dict:
    """A checkpoint of another model fails before launch, naming a parameter that differs.
    Returns its ``frozen_base_record``.

    ``model`` may be on the meta device: only names and shapes are compared. A fine-tune's
    checkpoint that leaves out the frozen base is compared on its trainable parameters; the
    base is checked by its fingerprint when the ranks have read it.
    """
    from fsdp_lab.engine import finetune

    saved = saved_shapes(path)
    record = frozen_base_record(json.loads((path / TRAINER_FILE).read_text()))
    expected = model.state_dict()
    if not record["saved"]:
        trainable = finetune.trainable_names(model)
        expected = {k: v for k, v in expected.items() if k in trainable}
    for name, tensor in expected.items():
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
    return record
