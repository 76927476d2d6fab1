"""Read back what an offline W&B run wrote, from its .wandb file, without a server.

The file is a 7-byte header (":W&B", u16 magic, u8 version) then LevelDB-log framing: 32 KiB
blocks of chunks (u32 crc, u16 length, u8 type: 1 full, 2 first, 3 middle, 4 last), each record
a ``wandb_internal_pb2.Record`` protobuf.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

_HEADER, _BLOCK, _CHUNK = 7, 32 * 1024, 7


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a .wandb file"
    out, pos, pending = [], _HEADER, b""
    while pos + _CHUNK <= len(data):
        left_in_block = _BLOCK - pos % _BLOCK
        if left_in_block < _CHUNK:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + _CHUNK])
        payload = data[pos + _CHUNK : pos + _CHUNK + length]
        pos += _CHUNK + length
        if kind == 0 and length == 0:
            continue
        pending = payload if kind in (1, 2) else pending + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


@dataclass
class OfflineRun:
    run_id: str = ""
    project: str = ""
    group: str = ""
    job_type: str = ""
    name: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    exit_code: int | None = None


def _items(items) -> dict:
    return {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in items}


def read_run(run_dir: Path) -> OfflineRun:
    """One offline-run-* directory (or its .wandb file) as plain data."""
    path = run_dir if run_dir.suffix == ".wandb" else next(run_dir.glob("*.wandb"))
    run = OfflineRun()
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.project = r.run.run_id, r.run.project
            run.group, run.job_type, run.name = r.run.run_group, r.run.job_type, r.run.display_name
            run.tags = list(r.run.tags)
            run.config.update(
                {
                    k: v.get("value", v) if isinstance(v, dict) else v
                    for k, v in _items(r.run.config.update).items()
                }
            )
        elif kind == "config":
            run.config.update(
                {
                    k: v.get("value", v) if isinstance(v, dict) else v
                    for k, v in _items(r.config.update).items()
                }
            )
        elif kind == "history":
            run.history.append(_items(r.history.item))
        elif kind == "summary":
            run.summary.update(_items(r.summary.update))
        elif kind == "exit":
            run.exit_code = r.exit.exit_code
    return run


def offline_runs(run_dir: Path) -> list[OfflineRun]:
    """Every W&B run a fsdp_lab run dir holds (a resumed run adds one per attempt), oldest first."""
    return [read_run(d) for d in sorted((run_dir / "wandb").glob("offline-run-*"))]
