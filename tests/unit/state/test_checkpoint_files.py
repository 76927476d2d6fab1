"""Checkpoint files without a run: which checkpoint resume picks, damage found before any rank
starts, and nothing in a checkpoint able to run code. (Saving and resuming real runs:
tests/integration/test_checkpoint.py.)"""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fsdp_lab.config import CheckpointVerify
from fsdp_lab.state import checkpoint as ckpt
from fsdp_lab.state import integrity, safe_load


def _fake_checkpoint(root: Path, step: int, *, complete: bool = True) -> Path:
    d = root / ckpt.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "shard.bin").write_bytes(b"x" * 10)
    if complete:
        marker = {
            "version": integrity.MARKER_VERSION,
            "step": step,
            "format": "sharded",
            "world_size": 2,
            "files": integrity.file_entries(d, ["shard.bin"]),
        }
        (d / ckpt.MARKER).write_text(json.dumps(marker))
    return d


def test_resume_never_picks_an_incomplete_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 4)
    _fake_checkpoint(root, 8, complete=False)  # a save cut short before its marker
    (root / (ckpt.step_dir_name(12) + ".tmp")).mkdir()
    assert ckpt.latest_checkpoint(root) == root / ckpt.step_dir_name(4)
    (root / ckpt.LATEST).write_text(ckpt.step_dir_name(8))  # a pointer to an incomplete one
    assert ckpt.latest_checkpoint(root) == root / ckpt.step_dir_name(4)
    assert ckpt.resolve_resume("auto", root) == root / ckpt.step_dir_name(4)
    assert ckpt.resolve_resume("never", root) is None
    assert ckpt.resolve_resume(str(tmp_path), tmp_path / "elsewhere") == root / "step_00000004"
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        ckpt.resolve_resume(str(tmp_path / "nothing"), root)


def test_verify_names_a_missing_truncated_or_altered_file(tmp_path):
    d = _fake_checkpoint(tmp_path, 4)
    ckpt.verify(d)
    (d / "shard.bin").write_bytes(b"y" * 10)  # same size, other bytes
    with pytest.raises(ckpt.CheckpointError, match=r"shard\.bin does not match its checksum"):
        ckpt.verify(d)
    ckpt.verify(d, CheckpointVerify.size)  # a size check cannot see it
    (d / "shard.bin").write_bytes(b"x" * 3)
    with pytest.raises(ckpt.CheckpointError, match=r"shard\.bin has 3 bytes, expected 10"):
        ckpt.verify(d, CheckpointVerify.size)
    (d / "shard.bin").unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"shard\.bin is missing"):
        ckpt.verify(d)
    ckpt.verify(d, CheckpointVerify.none)  # the marker alone


def test_auto_falls_back_past_a_damaged_checkpoint_and_keeps_it(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    _fake_checkpoint(root, 4)
    bad = _fake_checkpoint(root, 8)
    (root / ckpt.LATEST).write_text(bad.name)
    (bad / "shard.bin").write_bytes(b"y" * 10)
    with pytest.raises(ckpt.CheckpointError, match="does not match its checksum"):
        ckpt.resolve_resume(str(bad), root)  # named explicitly: refused, left where it is
    assert bad.is_dir()
    assert ckpt.resolve_resume("auto", root) == root / ckpt.step_dir_name(4)
    assert not bad.exists() and (root / "step_00000008.damaged" / "shard.bin").is_file()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "shard.bin does not match" in warning and "resuming from step_00000004" in warning


def test_a_checkpoint_of_an_older_format_is_refused_not_set_aside(tmp_path):
    root = tmp_path / "checkpoints"
    old = _fake_checkpoint(root, 4)
    (old / ckpt.MARKER).write_text(json.dumps({"step": 4, "format": "sharded", "files": {}}))
    with pytest.raises(ckpt.CheckpointError, match=r"version 1 marker.*older fsdp_lab"):
        ckpt.resolve_resume("auto", root)
    assert old.is_dir()


# ---- no code from a checkpoint -----------------------------------------------------------


class _Touch:
    """Unpickled unsafely, creates a file: what a malicious checkpoint would do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_the_payload_runs_when_unpickled_unsafely(tmp_path):
    """So that the refusals below are of something live."""
    pickle.loads(pickle.dumps(_Touch(tmp_path / "ran")))
    assert (tmp_path / "ran").exists()


@pytest.fixture
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def dcp_checkpoint(tmp_path) -> Path:
    path = tmp_path / "ckpt"
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "optim": {"lr": 0.1, "b": (0.9,)}}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_and_items_are_read_safely(dcp_checkpoint, tmp_path):
    names = [p.name for p in dcp_checkpoint.iterdir()]
    marker = {"files": {n: {} for n in names}}
    safe_load.scan(dcp_checkpoint, marker)  # DCP's own metadata passes the allowlist
    meta = safe_load.read_metadata(dcp_checkpoint)
    assert tuple(meta.state_dict_metadata["model.w"].size) == (2, 3)
    state = {"model": {"w": torch.zeros(2, 3)}, "optim": {"lr": 0.0, "b": (0.0,)}}
    dcp.load(
        state,
        storage_reader=safe_load.Reader(dcp_checkpoint),
        planner=safe_load.LoadPlanner(dcp_checkpoint),
        no_dist=True,
    )
    assert state["optim"] == {"lr": 0.1, "b": (0.9,)} and state["model"]["w"][1, 2] == 5.0

    marker_file = tmp_path / "ran"
    meta.planner_data = _Touch(marker_file)
    (dcp_checkpoint / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match=r"\.metadata is not plain data.*posix\.system"):
        safe_load.read_metadata(dcp_checkpoint)
    assert not marker_file.exists()


def test_torch_files_and_byte_items_admit_plain_data_only(tmp_path):
    marker_file = tmp_path / "ran"
    evil = tmp_path / "rank0.pt"
    torch.save({"torch": torch.zeros(2), "numpy": _Touch(marker_file)}, evil)
    with pytest.raises(ckpt.CheckpointError, match=r"rank0\.pt is not plain data"):
        safe_load.load_plain(evil)
    blob = io.BytesIO()
    torch.save([_Touch(marker_file)], blob)
    blob.seek(0)
    with pytest.raises(ckpt.CheckpointError, match="the item x is not plain data"):
        safe_load.load_bytes(blob, "the item x", tmp_path)
    assert not marker_file.exists()
    plain = tmp_path / "plain.pt"
    torch.save({"t": torch.ones(1), "l": [1, 2.5, None, "s", (3,)]}, plain)
    assert safe_load.load_plain(plain)["l"] == [1, 2.5, None, "s", (3,)]


def _in_dcp_wrapper(error: BaseException) -> BaseException:
    """``error`` as DCP raises it: under the RuntimeError of the write it broke, wrapped in a
    CheckpointException of the failed ranks."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        try:
            raise error
        except BaseException as inner:
            raise RuntimeError("write failed") from inner
    except RuntimeError as e:
        return CheckpointException("save", {1: (e, None)})


def test_disk_errors_are_found_inside_dcp_s_wrapper(monkeypatch):
    import errno

    full = OSError(errno.ENOSPC, "No space left on device", "/x/__0_0.distcp")
    wrapped = _in_dcp_wrapper(full)
    assert integrity.disk_error(wrapped) is full
    monkeypatch.setattr(integrity, "free_bytes", lambda path: 3 * 2**20)
    line = integrity.describe_write_failure(wrapped, Path("/x"))
    assert line == "writing under /x failed: the disk is full (3.0 MiB free there)"
    eio = _in_dcp_wrapper(OSError(errno.EIO, "Input/output error", "/x/__1_0.distcp"))
    assert integrity.describe_write_failure(eio, Path("/x")) == (
        "writing /x/__1_0.distcp failed: EIO (Input/output error)"
    )


def test_a_full_disk_is_one_line_however_it_surfaced(monkeypatch):
    """ENOSPC from a plain write, or torch's zip writer's short write (its own words, the errno
    lost: the rank that reads another rank's error from DCP gets it without its cause): one
    line, whichever rank's file hit the limit, so every rank reports the same."""
    import errno

    monkeypatch.setattr(integrity, "free_bytes", lambda path: 0)

    def short(under: OSError | None = None) -> RuntimeError:
        e = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
        e.__context__ = under  # what the rank that wrote it sees; another rank gets it without
        return e

    seen = [
        OSError(errno.ENOSPC, "No space left on device", "/x/__1_0.distcp"),
        OSError(errno.ENOSPC, "No space left on device"),
        short(),
        _in_dcp_wrapper(short()),
        _in_dcp_wrapper(short(OSError(errno.ENOSPC, "No space left on device"))),
        RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed"),
    ]
    lines = {integrity.describe_write_failure(e, Path("/x")) for e in seen}
    assert lines == {"writing under /x failed: the disk is full (0.0 MiB free there)"}
