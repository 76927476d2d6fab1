"""How a checkpoint save fails: on every rank together, with one reason, never past ``latest``.

Each part of a save runs through the ``SaveGuard``: ``agree`` for a rank's own writes (any
rank's failure fails every rank, with the first failing rank's reason), ``collective`` for a
write that raises on every rank together (DCP's: every rank reports rank 0's reason). A failed
save is removed; then the run stops (``CheckpointSaveError`` on every rank) or trains on without
it (``checkpoint.on_save_error``). One failure reads as one line whichever rank met it first
(``integrity.describe_write_failure``), and the launcher prints it once.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_lab.config import CheckpointConfig, OnSaveError
from fsdp_lab.engine.hardware import process_group
from fsdp_lab.state import integrity
from fsdp_lab.state.integrity import CheckpointError
from fsdp_lab.state.layout import latest_checkpoint

log = logging.getLogger(__name__)


class CheckpointSaveError(CheckpointError):
    """A checkpoint that could not be written; the last complete one is still ``latest``."""


class SaveFailed(Exception):
    """A part of a save failed (on this rank or another): raised on every rank, one reason."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class SaveGuard:
    """What the saves of one run's checkpoints (under ``root``) fail through; every rank calls
    every method."""

    def __init__(self, cfg: CheckpointConfig, root: Path, *, device: torch.device) -> None:
        self.cfg, self.root, self.device = cfg, root, device
        self.rank = dist.get_rank()

    def check_room(self, step: int, state_bytes: Callable[[], int]) -> None:
        """Refuse a save that cannot fit: the free space on the checkpoint filesystem against
        the last checkpoint's size (the first: ``state_bytes()``, what this rank will write,
        summed over the ranks)."""
        last = latest_checkpoint(self.root)
        need = torch.tensor([0 if last is not None else state_bytes()], dtype=torch.int64)
        need = need.to(process_group.collective_device(self.device))
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
            raise SaveFailed(verdict[0])

    def collective(self, fn) -> None:
        """Run a collective write that raises on every rank or none (DCP's); if it raised,
        every rank fails with rank 0's reason."""
        try:
            fn()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            log.error("checkpoint write failed", exc_info=True)
            # Each rank sees the failure its own way (DCP hands a rank the others' errors
            # unpickled, their causes lost), so one reason is chosen for all, as agree does.
            reasons = process_group.gather_from_processes(self._reason(e))
            raise SaveFailed(reasons[0]) from e

    def agree(self, fn, *args) -> list:
        """Run this rank's part of a save; if it failed on any rank, fail on every rank, with
        the first failing rank's reason. Else every rank's result of ``fn``, in rank order
        (one gather carries both)."""
        result = reason = None
        try:
            result = fn(*args)
        except Exception as e:  # reported below, on every rank
            log.error("checkpoint write failed on rank %d", self.rank, exc_info=True)
            reason = self._reason(e)
        gathered = process_group.gather_from_processes((reason, result))
        first = next((r for r, _ in gathered if r is not None), None)
        if first is not None:
            raise SaveFailed(first)
        return [value for _, value in gathered]

    def _reason(self, e: BaseException) -> str:
        return integrity.describe_write_failure(e, self.root)

    def failed(self, tmp: Path, step: int, reason: str) -> bool:
        """Remove the partial save; stop (raise on every rank) or go on without it (False)."""
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


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
