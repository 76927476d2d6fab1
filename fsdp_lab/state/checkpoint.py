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
parameter name, so a checkpoint of one strategy or world size loads into any other; each format's
reader/writer is in ``formats``, and finding checkpoints (latest, resume, compatibility) is
``layout``'s. Nothing is
unpickled but through the guards of ``safe_load``, and every file is verified (``integrity``)
before any rank loads it.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_lab.config import CheckpointConfig
from fsdp_lab.config.checkpoint_formats import format_row
from fsdp_lab.engine import finetune, finite, fsdp, loading
from fsdp_lab.engine.hardware import process_group
from fsdp_lab.engine.loading import FINGERPRINT_KINDS
from fsdp_lab.engine.sharded import ShardedStateIO
from fsdp_lab.state import integrity, rng, safe_load
from fsdp_lab.state.formats import FrozenBase, format_for, format_saved_in, saved_shapes
from fsdp_lab.state.integrity import MARKER, CheckpointError, verify
from fsdp_lab.state.layout import (
    DAMAGED_SUFFIX,
    LATEST,
    TRAINER_FILE,
    check,
    check_compatible,
    checkpoint_root,
    complete_checkpoints,
    frozen_base_record,
    latest_checkpoint,
    resolve_resume,
    step_dir_name,
)
from fsdp_lab.state.save_guard import SaveFailed, SaveGuard

# Re-exported: where callers look for them (the finding of checkpoints is state.layout's, the
# formats state.formats').
__all__ = [
    "DAMAGED_SUFFIX",
    "LATEST",
    "MARKER",
    "TRAINER_FILE",
    "CheckpointError",
    "FrozenBase",
    "check",
    "check_compatible",
    "checkpoint_root",
    "complete_checkpoints",
    "frozen_base_record",
    "latest_checkpoint",
    "legacy_fingerprint",
    "resolve_resume",
    "saved_shapes",
    "step_dir_name",
    "verify",
]

log = logging.getLogger(__name__)


@dataclass
class Restored:
    step: int
    tokens_seen: int
    data_state: dict | None = None  # the loader's position (rows consumed, epoch, data id)


class Checkpointer:
    """Saves and restores one run's training state; every rank calls every method.

    The model and optimizer state go through the format's reader/writer (``state.formats``);
    the rest (trainer state, RNG, marker, the rename into place) is written here, the same for
    every format. ``io`` is the engine's own io of checkpoint=sharded (engine.xla on tpu);
    None: FSDP2's DTensors through torch's state-dict helpers. Every write of a save goes
    through ``guard`` (``state.save_guard``): a failure fails every rank, in one line."""

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
        io: ShardedStateIO | None = None,
        frozen: FrozenBase | None = None,
    ) -> None:
        self.cfg, self.root, self.data, self.io = cfg, root, data, io
        # The writer of cfg.format (None: checkpoint=none); a resume reads the saved one's.
        self.format = format_for(cfg.format, engine_io=io) if self.enabled else None
        self.frozen = frozen or FrozenBase()
        self.model, self.optimizer = model, optimizer
        self.scheduler, self.scaler = scheduler, scaler
        self.config, self.device = config, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.guard = SaveGuard(cfg, root, device=device)
        self._pending: tuple | None = None  # (future, tmp dir, step, tokens) of an async save
        # Background saves run their collectives on a group of their own, so they never
        # interleave with the training step's collectives on the default group.
        self._async_group = dist.new_group(backend="gloo") if cfg.async_enabled else None

    @property
    def enabled(self) -> bool:
        return format_row(self.cfg.format).saves

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
            self.guard.check_room(step, self._state_bytes)
            self.guard.agree(self._prepare, tmp)
            self.guard.agree(self._write_rng, tmp)
            future = self._write_state(tmp, blocking=blocking)
            if future is not None:
                self._pending = (future, tmp, step, tokens_seen)
                return True
            self._finalize(tmp, step, tokens_seen)
        except SaveFailed as e:
            return self.guard.failed(tmp, step, e.reason)
        return True

    def _prepare(self, tmp: Path) -> None:
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save a crash cut short
            (tmp / "rng").mkdir(parents=True)

    def _write_rng(self, tmp: Path) -> None:
        torch.save(rng.rng_state(self.device), tmp / "rng" / f"rank{self.rank}.pt")

    def _write_state(self, tmp: Path, *, blocking: bool):
        """The model and optimizer state, as the format writes it; the future of an async
        save going on in the background, else None."""
        return self.format.save(
            tmp,
            model=self.model,
            optimizer=self.optimizer,
            frozen=self.frozen,
            guard=self.guard,
            async_group=None if blocking else self._async_group,
        )

    def _state_bytes(self) -> int:
        """This rank's bytes of model and optimizer state (its shards): what it will write (of
        a fine-tune that leaves its base out, the trainable parameters only)."""
        held = fsdp.state_bytes(self.model, self.optimizer)
        if self.frozen.trainable is None:
            return held["params"] + held["optimizer"]
        trainable = (p for p in self.model.parameters() if p.requires_grad)
        return fsdp.nbytes(trainable) + held["optimizer"]

    def poll(self) -> None:
        """Finish an async save once every rank's background write is done (call each step)."""
        if self._pending is None:
            return
        done = torch.tensor(
            [1.0 if self._pending[0].done() else 0.0],
            device=process_group.collective_device(self.device),
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
            self.guard.collective(future.result)
            self._finalize(tmp, step, tokens)
        except SaveFailed as e:
            self.guard.failed(tmp, step, e.reason)

    def _own_files(self, tmp: Path) -> list[str]:
        """The files this rank wrote: its DCP shards and its RNG states."""
        mine = [f"rng/rank{self.rank}.pt"]
        mine += self.format.rank_files(tmp, self.rank)
        return [n for n in mine if (tmp / n).is_file()]

    def _finalize(self, tmp: Path, step: int, tokens_seen: int) -> None:
        """After every rank wrote: each checksums its own files; rank 0 adds the trainer state,
        checksums the rest and writes the marker, renames the dir into place, then moves
        `latest`, then prunes old checkpoints, in that order."""
        every = self.guard.agree(lambda: integrity.file_entries(tmp, self._own_files(tmp)))
        self.guard.agree(self._publish, tmp, step, tokens_seen, every)

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
        integrity.fsync_write(tmp / TRAINER_FILE, json.dumps(trainer, indent=1).encode())
        files: dict[str, dict] = {}
        for part in every:
            files.update(part)
        rest = [n for n in integrity.files_in(tmp) if n not in files]
        files.update(integrity.file_entries(tmp, rest))
        marker = {
            "version": integrity.MARKER_VERSION,
            "step": step,
            "format": self.cfg.format.name,
            "world_size": self.world,
            "checksum": integrity.DIGEST,
            "files": dict(sorted(files.items())),
        }
        integrity.fsync_write(tmp / MARKER, json.dumps(marker, indent=1).encode())
        integrity.fsync_dir(tmp)
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
        integrity.fsync_write(pointer_tmp, final.name.encode())
        pointer_tmp.replace(self.root / LATEST)
        integrity.fsync_dir(self.root)
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
        reader = format_saved_in(path, engine_io=self.io)
        reader.load(path, model=self.model, optimizer=self.optimizer, held=held)
        self._check_finite(path)
        self.scheduler.load_state_dict(trainer["scheduler"])
        _fit_groups(self.scheduler, len(self.optimizer.param_groups))
        if self.scaler is not None and trainer["scaler"] is not None:
            self.scaler.load_state_dict(trainer["scaler"])
        rng_file = path / "rng" / f"rank{self.rank}.pt"
        if marker["world_size"] == self.world and rng_file.is_file():
            rng.set_rng_state(safe_load.load_plain(rng_file), self.device)
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

    def _check_finite(self, path: Path) -> None:
        """The restored model and optimizer state hold no NaN or inf (each rank its shards,
        one verdict for all): a damaged checkpoint is named here, not as a loss later."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        model = ((f"model tensor {n}", p) for n, p in self.model.named_parameters())
        optim = (
            (f"optimizer state {k} of {names.get(id(p), '?')}", v)
            for p, slots in self.optimizer.state.items()
            for k, v in slots.items()
            if torch.is_tensor(v)
        )
        if (found := finite.agree(finite.first_in(itertools.chain(model, optim)))) is not None:
            raise CheckpointError(
                f"checkpoint {path}: {found}; it is damaged: resume from an earlier checkpoint "
                "(resume=<its path>) or resume=never"
            )

    def _held(self, path: Path, trainer: dict) -> FrozenBase:
        """What of the model ``path`` holds. One without the frozen base resumes only onto the
        same base: its fingerprint must be the one this run's base has (every rank has both,
        so every rank refuses together)."""
        record = frozen_base_record(trainer)
        if record["saved"]:
            return FrozenBase()
        if legacy_fingerprint(record["fingerprint"]):  # recorded before per-rank loading
            own = finetune.frozen_fingerprint(self.model, lambda _, p: loading.gather_whole(p))
            if own == record["fingerprint"]:
                return self.frozen
        if record["fingerprint"] != self.frozen.fingerprint:
            raise CheckpointError(
                f"checkpoint {path} holds only the trainable parameters of a fine-tune of "
                f"{record['source']}, and the frozen base this run read from "
                f"model.name_or_path differs from that one (fingerprint "
                f"{str(self.frozen.fingerprint)[:12]}, not {record['fingerprint'][:12]}); set "
                f"model.name_or_path={record['source']} (the same weights) or resume=never"
            )
        return self.frozen


def _fit_groups(scheduler, groups: int) -> None:
    """The schedule's per-group lists as long as this rank's optimizer's groups: a rank may
    hold a different number of them than the one that saved (under a pipeline, a stage with
    no 1-D parameters has one). Every group follows the one schedule (``train.optim``)."""
    for name in ("base_lrs", "_last_lr"):
        values = getattr(scheduler, name, None)
        if values and len(values) != groups:
            setattr(scheduler, name, [values[0]] * groups)


def legacy_fingerprint(fingerprint) -> bool:
    """A fingerprint of the whole model's frozen tensors (fsdp_lab before 2026-11-27)."""

    return isinstance(fingerprint, str) and not fingerprint.startswith(FINGERPRINT_KINDS)
