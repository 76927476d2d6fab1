"""Shared helpers: run train.py as a user does, and an unsharded reference of the same run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")


def train(run_dir: Path, *overrides: str, timeout: int = 300,
          extra_args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python train.py`` with the run dir pinned and the progress bar off."""
    cmd = [sys.executable, str(ROOT / "train.py"), *extra_args, f"hydra.run.dir={run_dir}",
           "trainer.progress_bar=false", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
