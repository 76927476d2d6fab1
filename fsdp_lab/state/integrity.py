"""A checkpoint's files as they lie on disk: the marker, checksums, verification, free space.

``COMPLETE.json`` (the marker, written last) lists every file of a checkpoint with its size and
its xxh3-128 digest. xxh3 because checking must not cost more than reading: it hashes at
3.1 GB/s on this machine's 2 cores (blake2b 0.46, sha256 0.93, zlib's crc32 1.8), about the
speed of reading the file from the page cache. A checksum finds damage (a bad disk, a copy cut
short, a bit flipped in transit); it is not a signature: whoever can rewrite a file can rewrite
the marker too. What keeps a tampered checkpoint from running code is ``safe_load``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import xxhash

from fsdp_lab.config import CheckpointVerify, ConfigError

MARKER = "COMPLETE.json"
# 2: checksums, trainer.json and RNG states without pickled objects. Version 1 markers (a size
# per file) belong to checkpoints whose trainer.pt can only be read by unpickling it.
MARKER_VERSION = 2
DIGEST = "xxh3_128"
_CHUNK = 8 * 2**20


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used: names the checkpoint, the file and what to do."""


class CheckpointDamaged(CheckpointError):
    """A file is missing, truncated or not as written (resume=auto falls back past it)."""


def file_digest(path: Path) -> str:
    """The hex xxh3-128 digest of a file's bytes."""
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def fsync_write(path: Path, data: bytes) -> None:
    """Write ``data`` and wait until it is on disk (the marker and ``latest`` are written
    this way: a crash leaves them whole or absent)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Make a directory's renames durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_entries(path: Path, names: list[str]) -> dict[str, dict]:
    """{relative name: {"size", "xxh3_128"}} of the named files under ``path``."""
    return {n: {"size": (path / n).stat().st_size, DIGEST: file_digest(path / n)} for n in names}


def files_in(path: Path) -> list[str]:
    """Every file under ``path``, relative, sorted (what a marker must list)."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def read_marker(path: Path) -> dict:
    """The marker of a complete checkpoint, refused in one line if it predates safe loading."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointDamaged(f"checkpoint {path} is damaged: {MARKER} ({e})") from None
    version = marker.get("version", 1) if isinstance(marker, dict) else None
    if version != MARKER_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has a version {version} marker, not {MARKER_VERSION}: it was "
            "written by an older fsdp_lab, whose trainer state can only be read by unpickling "
            "it, which could run code; resume it with the fsdp_lab that wrote it, or "
            "start fresh (resume=never)"
        )
    return marker


@dataclass(frozen=True)
class FileCheck:
    name: str
    size: int
    problem: str | None  # None: as the marker says


def check_files(path: Path, marker: dict, mode: CheckpointVerify) -> list[FileCheck]:
    """Each file the marker lists, checked as ``mode`` says (none: not opened)."""
    out = []
    for name, want in marker["files"].items():
        f = path / name
        problem = None
        if mode is CheckpointVerify.none:
            pass
        elif not f.is_file():
            problem = "is missing"
        elif (size := f.stat().st_size) != want["size"]:
            problem = f"has {size} bytes, expected {want['size']}"
        elif mode is CheckpointVerify.checksum and file_digest(f) != want[DIGEST]:
            problem = f"does not match its checksum ({DIGEST} {want[DIGEST][:12]}...)"
        out.append(FileCheck(name, want["size"], problem))
    return out


def verify(path: Path, mode: CheckpointVerify = CheckpointVerify.checksum) -> dict:
    """Raise CheckpointError naming the first damaged file; return the marker."""
    marker = read_marker(path)
    for check in check_files(path, marker, mode):
        if check.problem is not None:
            raise CheckpointDamaged(
                f"checkpoint {path} is damaged: {check.name} {check.problem}; resume from an "
                "earlier checkpoint (resume=<its path>) or remove this one"
            )
    return marker


def checkpoint_bytes(path: Path) -> int:
    """What a complete checkpoint holds on disk, by its marker."""
    return sum(f["size"] for f in read_marker(path)["files"].values())


def free_bytes(path: Path) -> int:
    """Free space (for an unprivileged writer) on the filesystem ``path`` is on, or would be."""
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def _causes(e: BaseException) -> list[BaseException]:
    """``e`` and everything under it: DCP wraps each rank's exception in a CheckpointException
    (``failures``: rank -> (exception, traceback)); the rest chain a cause or a context."""
    seen: dict[int, BaseException] = {}
    todo = [e]
    while todo:
        cur = todo.pop(0)
        if cur is None or id(cur) in seen:
            continue
        seen[id(cur)] = cur
        failures = getattr(cur, "failures", None)
        if isinstance(failures, dict):
            todo.extend(f[0] if isinstance(f, tuple) else f for f in failures.values())
        todo.extend([cur.__cause__, cur.__context__])
    return list(seen.values())


def disk_error(e: BaseException) -> OSError | None:
    """The OSError with an errno at the root of ``e``, if any."""
    return next((c for c in _causes(e) if isinstance(c, OSError) and c.errno), None)


# How torch's zip writer (torch.save, and DCP's tensor records) reports a write the OS cut
# short: its own words, without the OS's errno.
_SHORT_WRITE = ("unexpected pos", "file write failed")


def disk_full(e: BaseException) -> bool:
    """Whether ``e`` is a full disk, however it surfaced: ENOSPC from a plain write, or a short
    write inside torch's zip writer, which loses the errno."""
    return any(
        (isinstance(c, OSError) and c.errno == errno.ENOSPC)
        or any(words in str(c) for words in _SHORT_WRITE)
        for c in _causes(e)
    )


def describe_write_failure(e: BaseException, root: Path) -> str:
    """A failed checkpoint write in one line: the path and errno where the OS gave one.

    A full disk is one line whichever write met it first (a rank's shard, its RNG states, the
    marker) and however it surfaced, so every rank that reports it says the same: the root,
    not the file that happened to hit the limit."""
    free = lambda: f"{free_bytes(root) / 2**20:.1f} MiB free there"
    if disk_full(e):
        return f"writing under {root} failed: the disk is full ({free()})"
    cause = disk_error(e)
    if cause is not None:
        name = errno.errorcode.get(cause.errno, str(cause.errno))
        where = cause.filename or root
        return f"writing {where} failed: {name} ({os.strerror(cause.errno)})"
    innermost = _causes(e)[-1]
    first = (str(innermost).strip().splitlines() or [""])[0]
    return f"writing under {root} failed: {type(innermost).__name__}: {first} ({free()})"
