"""Runs and sweep jobs from train.py: what a failure ends.

A single run that fails exits non-zero at once. In a sweep (``-m``) a failed job is recorded in
its run.json with the reason and the sweep goes on; at the end train.py lists the failed jobs
and exits 1. A preemption signal or Ctrl-C still stops the whole sweep.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from omegaconf import DictConfig

from fsdp_lab import launch, preempt

# Sweep jobs that failed, "<job overrides>: <reason>", in the order they ran.
_FAILURES: list[str] = []


def run_job(dict_cfg: DictConfig, *, run_dir: Path, multirun: bool, job: str = "") -> None:
    code, config_error = launch.main(dict_cfg, run_dir=run_dir, multirun=multirun)
    if code == 0:
        return
    if not multirun or code in (preempt.EXIT_CODE, 130):
        sys.exit(code)
    _FAILURES.append(f"{job or run_dir}: {_record_failure(run_dir, code, config_error)}")
    print(f"fsdp_lab: sweep job {job or run_dir} failed (exit {code}); the sweep goes on",
          file=sys.stderr)


def exit_code() -> int:
    """After all jobs: list the failed ones; 1 if any failed, else 0."""
    if _FAILURES:
        print(f"fsdp_lab: {len(_FAILURES)} sweep job(s) failed:", file=sys.stderr)
        for line in _FAILURES:
            print(f"  {line}", file=sys.stderr)
    return 1 if _FAILURES else 0


def _record_failure(run_dir: Path, code: int, config_error: str | None) -> str:
    """The failed job's reason. A run that started has it in its run.json already (the launcher
    wrote it); a config error is written to a new run.json, never over another run's."""
    from fsdp_lab import worker

    path = run_dir / worker.RUN_FILE
    if config_error is None:
        facts = json.loads(path.read_text()) if path.is_file() else {}
        return facts.get("error") or f"exit {code}"
    run_dir.mkdir(parents=True, exist_ok=True)
    worker.create_run_file(run_dir, {"status": "failed", "error": config_error})
    return config_error
