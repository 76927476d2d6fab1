"""Where a run reports: per-rank log files, rank 0's console progress bar, metrics.jsonl."""

from __future__ import annotations

import json
import logging
import statistics
import sys
from pathlib import Path

from tqdm import tqdm

LOG_FORMAT = "%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s"


def setup_rank_logging(log_dir: Path, rank: int) -> Path:
    """Every rank logs to logs/rank{r}.log; rank 0 also to the console (INFO, short form)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"rank{rank}.log"
    root = logging.getLogger()
    root.handlers.clear()
    root.setLevel(logging.INFO)
    file_handler = logging.FileHandler(path)
    file_handler.setFormatter(logging.Formatter(LOG_FORMAT.format(rank=rank)))
    root.addHandler(file_handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter("[fsdp_lab] %(message)s"))
        console.setLevel(logging.INFO)
        # Tracebacks go to the log file; the launcher prints one line about them.
        console.addFilter(lambda record: record.exc_info is None)
        root.addHandler(console)
    for noisy in ("transformers", "torch.distributed", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # A tracker's HTTP retries: the tracker's own warning says what failed, once.
    logging.getLogger("urllib3").setLevel(logging.ERROR)
    return path


class MetricsWriter:
    """Rank 0's record of every optimizer step and evaluation, one JSON object per line with
    its "split" (train or val), flushed as written."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class Progress:
    """A console progress bar on rank 0 (no-op elsewhere or when disabled)."""

    def __init__(self, total: int, *, enabled: bool, initial: int = 0) -> None:
        self._bar = (
            tqdm(
                total=total,
                initial=initial,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
            if enabled
            else None
        )

    def update(self, record: dict) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix(
            loss=f"{record['loss']:.4f}",
            lr=f"{record['lr']:.2e}",
            tok_s=f"{record['tokens_per_s']:.0f}",
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def read_metrics(path: Path, split: str = "train") -> list[dict]:
    """The records of one split of a metrics.jsonl: "train" (one per optimizer step) or "val"
    (one per evaluation), for tests, reports and users."""
    return [r for r in read_records(path) if r.get("split", "train") == split]


def read_records(path: Path) -> list[dict]:
    """Every record of a metrics.jsonl in the order written (none if there is no file)."""
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class RunSummary:
    """A run's final and best values from its metric records: run.json and the trackers' summary."""

    def __init__(self) -> None:
        self._train: list[dict] = []
        self._val: list[dict] = []

    def add(self, record: dict) -> None:
        """A train or val record (a profile window's record is run.json's `profile`)."""
        if record["split"] in ("train", "val"):
            (self._val if record["split"] == "val" else self._train).append(record)

    def as_dict(self) -> dict:
        """Steady-state figures are medians over this attempt's steps after its first (which
        includes warm-up: allocator growth, compile, first all-gathers)."""
        steady = self._train[1:] or self._train
        summary = {
            "final_loss": self._train[-1]["loss"] if self._train else None,
            "best_loss": min((r["loss"] for r in self._train), default=None),
            "final_val_loss": self._val[-1]["val_loss"] if self._val else None,
            "best_val_loss": min((r["val_loss"] for r in self._val), default=None),
            "final_val_ppl": self._val[-1]["val_ppl"] if self._val else None,
        }
        for key in ("tokens_per_s", "tokens_per_s_per_rank", "step_time_s", "mfu"):
            values = [r[key] for r in steady if r.get(key) is not None]
            summary[f"median_{key}"] = statistics.median(values) if values else None
        summary["peak_mem_bytes"] = max((r["peak_mem_bytes"] for r in self._train), default=None)
        return summary
