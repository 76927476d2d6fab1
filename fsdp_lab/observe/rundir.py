"""The files of a run dir, and who may write them: config.yaml (the resolved config the ranks
run), run.json (facts and status: ``record.RunRecord``), metrics.jsonl (its rows:
``record.StepRecord``, ``EvalRecord``), logs/, checkpoints/, hf/, and the trackers'
own (wandb/, tensorboard/)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
from pathlib import Path

from omegaconf import OmegaConf

from fsdp_lab.config import Config, to_container, to_typed
from fsdp_lab.observe.record import RunRecord

CONFIG_FILE, METRICS_FILE, RUN_FILE, LOG_DIR = "config.yaml", "metrics.jsonl", "run.json", "logs"
HF_EXPORT_DIR = "hf"
SAMPLES_FILE = "samples.jsonl"  # eval.prompts' completions, one line per prompt and evaluation
STUDY_FILE = "study.json"  # a sweep dir's Optuna study (hydra/sweeper=study), see launch.study


def create_run_file(run_dir: Path, record: RunRecord) -> bool:
    """Write run.json only if there is none (O_EXCL: of two writers, one wins); False if one
    exists. Claims a fresh run dir, and records a failure without touching another run's."""
    try:
        fd = os.open(run_dir / RUN_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, json.dumps(record.to_dict()).encode() + b"\n")
    os.close(fd)
    return True


def read_run_file(run_dir: Path) -> RunRecord:
    """run.json (an empty record if there is none; one of status "unknown" if it holds no JSON
    object). ``ValueError`` if it is not JSON (a report says so and goes on)."""
    path = run_dir / RUN_FILE
    if not path.is_file():
        return RunRecord()
    data = json.loads(path.read_text())
    return RunRecord.from_dict(data) if isinstance(data, dict) else RunRecord(status="unknown")


def write_run_file(run_dir: Path, record: RunRecord) -> None:
    write_json(run_dir / RUN_FILE, record.to_dict())


def write_json(path: Path, data: dict) -> None:
    """Indented JSON, written atomically (run.json, a study's study.json, tune.json)."""
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def write_atomic(path: Path, text: str | bytes) -> None:
    """Through a temporary file and a rename: a reader sees the old or the new file, never half
    of one (the pid in the temporary's name keeps two writers apart)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if isinstance(text, bytes):
        tmp.write_bytes(text)
    else:
        tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_png(path: Path, figure) -> Path:
    """A matplotlib ``Figure`` as a PNG, written atomically (a re-drawn plot replaces the old
    one, never half of it); its path. Takes the figure, so this module needs no matplotlib."""
    png = io.BytesIO()
    figure.savefig(png, format="png", dpi=120, bbox_inches="tight")
    write_atomic(path, png.getvalue())
    return path


def update_run_file(run_dir: Path, **changes) -> None:
    """Change some of run.json's fields (``status="failed", error=...``), keeping the others."""
    write_run_file(run_dir, dataclasses.replace(read_run_file(run_dir), **changes))


def error_file(run_dir: Path, rank: int) -> Path:
    return run_dir / LOG_DIR / f"rank{rank}.error.json"


def pid_file(run_dir: Path, rank: int) -> Path:
    """The process id of a running local rank (for py-spy, gdb or kill); gone once it ends."""
    return run_dir / LOG_DIR / f"rank{rank}.pid"


def load_run_config(run_dir: Path) -> Config:
    return to_typed(OmegaConf.load(run_dir / CONFIG_FILE))


def save_run_config(cfg: Config, run_dir: Path) -> None:
    OmegaConf.save(OmegaConf.create(to_container(cfg)), run_dir / CONFIG_FILE)
