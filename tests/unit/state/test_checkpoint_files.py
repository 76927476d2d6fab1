"""Checkpoint files without a run: which checkpoint resume picks, and damage found before any
rank starts. (Saving and resuming real runs: tests/integration/test_checkpoint.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fsdp_lab.state import checkpoint as ckpt


def _fake_checkpoint(root: Path, step: int, *, complete: bool = True) -> Path:
    d = root / ckpt.step_dir_name(step)
    d.mkdir(parents=True)
    (d / "shard.bin").write_bytes(b"x" * 10)
    if complete:
        (d / ckpt.MARKER).write_text(
            json.dumps(
                {"step": step, "format": "sharded", "world_size": 2, "files": {"shard.bin": 10}}
            )
        )
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


def test_verify_names_a_missing_or_truncated_file(tmp_path):
    d = _fake_checkpoint(tmp_path, 4)
    ckpt.verify(d)
    (d / "shard.bin").write_bytes(b"x" * 3)
    with pytest.raises(ckpt.CheckpointError, match=r"shard\.bin has 3 bytes, expected 10"):
        ckpt.verify(d)
    (d / "shard.bin").unlink()
    with pytest.raises(ckpt.CheckpointError, match=r"shard\.bin is missing"):
        ckpt.verify(d)
