"""Shared helpers: run train.py as a user does, and an unsharded reference of the same run."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def _train_command(run_dir: Path, overrides: tuple[str, ...]) -> list[str]:
    """``python train.py`` with the run dir pinned and the progress bar off."""
    return [
        sys.executable,
        str(ROOT / "train.py"),
        f"hydra.run.dir={run_dir}",
        "trainer.progress_bar=false",
        *overrides,
    ]


def train(run_dir: Path, *overrides: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run train.py to the end."""
    return subprocess.run(
        _train_command(run_dir, overrides),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def start_train(run_dir: Path, *overrides: str) -> subprocess.Popen:
    """Start train.py in the background (to signal or kill it mid-run)."""
    return subprocess.Popen(
        _train_command(run_dir, overrides),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


def rank_pid(run_dir: Path, rank: int, timeout: float = 60) -> int:
    """The pid of a running rank of the local launcher whose run dir is ``run_dir``."""
    path = run_dir / "logs" / f"rank{rank}.pid"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):  # not yet written, or half-written
            return int(path.read_text())
        time.sleep(0.1)
    raise AssertionError(f"no worker of rank {rank} found ({path})")
