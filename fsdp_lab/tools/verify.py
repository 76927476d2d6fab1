"""``fsdp-lab verify CKPT``: every file of a checkpoint against its marker, and every pickle in it
read through the guards that keep code out (no weights are loaded, no ranks started)."""

from __future__ import annotations

from pathlib import Path

from fsdp_lab.config import CheckpointVerify
from fsdp_lab.state import checkpoint as ckpt
from fsdp_lab.state import integrity, safe_load


def checkpoints_at(path: Path) -> list[Path]:
    """A checkpoint dir itself; a run dir or checkpoint root: every complete checkpoint in it."""
    path = path.expanduser().resolve()
    if (path / ckpt.MARKER).is_file():
        return [path]
    for root in (path, path / "checkpoints"):
        found = ckpt.complete_checkpoints(root)
        if found:
            return found
    raise ckpt.CheckpointError(
        f"verify {path}: no complete checkpoint there (a checkpoint dir holds {ckpt.MARKER}); "
        "point it at a checkpoint, a run dir or a checkpoint root"
    )


def verify_one(path: Path, mode: CheckpointVerify, out) -> bool:
    """Print one line per file and one for the pickles; True if all is well."""
    try:
        marker = integrity.read_marker(path)
    except ckpt.CheckpointError as e:
        print(f"{path}: REFUSED: {e}", file=out)
        return False
    print(
        f"{path}: step {marker['step']}, {marker['format']}, {marker['world_size']} ranks, "
        f"checked by {mode.name}",
        file=out,
    )
    checks = integrity.check_files(path, marker, mode)
    width = max(len(f"{c.size:,}") for c in checks)
    for c in checks:
        status = "ok" if c.problem is None else "DAMAGED"
        if mode is CheckpointVerify.none:
            status = "unread"
        note = "" if c.problem is None else f"  {c.problem}"
        print(f"  {status:8s} {c.size:>{width},} bytes  {c.name}{note}", file=out)
    damaged = [c for c in checks if c.problem is not None]
    safe = None
    try:
        if not damaged:  # a damaged file may fail to unpickle for that reason alone
            safe_load.scan(path, marker)
            safe = True
    except ckpt.CheckpointError as e:
        safe = False
        print(f"  UNSAFE   {e}", file=out)
    if safe:
        print("  ok       every pickle in it is plain data (tensors and containers)", file=out)
    verdict = "ok" if not damaged and safe else "DAMAGED" if damaged else "UNSAFE"
    print(f"  {verdict}: {len(checks) - len(damaged)} of {len(checks)} files as written", file=out)
    return verdict == "ok"


def verify_command(path: Path, mode: CheckpointVerify, out) -> int:
    """0: every checkpoint at ``path`` is whole and safe; 1: one is not."""
    results = [verify_one(p, mode, out) for p in checkpoints_at(path)]
    return 0 if all(results) else 1
