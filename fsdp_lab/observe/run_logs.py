"""Where a run reports: per-rank log files, rank 0's console progress bar, metrics.jsonl."""

from __future__ import annotations

import json
import logging
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from fsdp_lab.observe.record import (
    EvalRecord,
    HarnessRecord,
    RunResults,
    SampleRecord,
    StepRecord,
    split_of,
    step_of,
)

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

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
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

    def update(self, record: StepRecord) -> None:
        if self._bar is None:
            return
        self._bar.set_postfix(
            loss=f"{record.loss:.4f}",
            lr=f"{record.lr:.2e}",
            tok_s=f"{record.tokens_per_s:.0f}",
            refresh=False,
        )
        self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def read_metrics(path: Path, split: str = "train") -> list[dict]:
    """The rows of one split of a metrics.jsonl as they are written: "train" (one per optimizer
    step), "val" (one per evaluation) or "profile", for tests, benchmarks and users (fsdp_lab's
    own code reads them typed: ``read_rows``)."""
    return [r for r in read_records(path) if split_of(r) == split]


def read_records(path: Path) -> list[dict]:
    """Every row of a metrics.jsonl in the order written (none if there is no file)."""
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def tracker_history(path: Path) -> list[dict]:
    """The rows a resumed run's trackers are sent again, every split as written (the trackers
    name their numbers from a row: ``observe.trackers.base.metrics_of``)."""
    return read_records(path)


@dataclass
class MetricRows:
    """A metrics.jsonl's train, val and harness rows, typed, in the order written."""

    train: list[StepRecord] = field(default_factory=list)
    val: list[EvalRecord] = field(default_factory=list)
    harness: list[HarnessRecord] = field(default_factory=list)


def read_rows(path: Path, *, whole_lines_only: bool = False) -> MetricRows:
    """A metrics.jsonl's train and val rows (none without a file). ``whole_lines_only``: skip a
    line that is not a JSON object, as a run killed mid-write leaves its last one, rather than
    raise ``ValueError``."""
    rows = MetricRows()
    if not path.is_file():
        return rows
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if whole_lines_only:
                continue
            raise
        if not isinstance(row, dict):
            if whole_lines_only:
                continue
            raise ValueError(f"{path}: a row that is not a JSON object: {line[:80]}")
        match split_of(row):
            case StepRecord.SPLIT:
                rows.train.append(StepRecord.from_dict(row))
            case EvalRecord.SPLIT:
                rows.val.append(EvalRecord.from_dict(row))
            case HarnessRecord.SPLIT:
                rows.harness.append(HarnessRecord.from_dict(row))
    return rows


def read_samples(path: Path) -> list[SampleRecord]:
    """samples.jsonl's lines (none without the file; a line cut short by a kill is skipped)."""
    if not path.is_file():
        return []
    samples = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            samples.append(SampleRecord.from_dict(json.loads(line)))
        except (ValueError, TypeError, AttributeError):
            continue
    return samples


def step_of_line(line: str) -> int | None:
    """The optimizer step of one line of metrics.jsonl (None for a blank one)."""
    return step_of(json.loads(line)) if line.strip() else None


class RunSummary:
    """A run's final and best values from its metric records: run.json and the trackers' summary."""

    def __init__(self) -> None:
        self._train: list[StepRecord] = []
        self._val: list[EvalRecord] = []
        self._harness: HarnessRecord | None = None  # the last

    def add(self, record: StepRecord | EvalRecord | HarnessRecord) -> None:
        """A train, val or harness record (a profile window's record is run.json's
        `profile`)."""
        if isinstance(record, HarnessRecord):
            self._harness = record
        else:
            (self._val if isinstance(record, EvalRecord) else self._train).append(record)

    def results(self) -> RunResults:
        """Steady-state figures are medians over this attempt's steps after its first (which
        includes warm-up: allocator growth, compile, first all-gathers)."""
        train, val = self._train, self._val
        steady = train[1:] or train
        return RunResults(
            final_loss=train[-1].loss if train else None,
            best_loss=min((r.loss for r in train), default=None),
            final_val_loss=val[-1].val_loss if val else None,
            best_val_loss=min((r.val_loss for r in val), default=None),
            final_val_ppl=val[-1].val_ppl if val else None,
            median_tokens_per_s=_median([r.tokens_per_s for r in steady]),
            median_tokens_per_s_per_rank=_median([r.tokens_per_s_per_rank for r in steady]),
            median_step_time_s=_median([r.step_time_s for r in steady]),
            median_mfu=_median([r.mfu for r in steady]),
            peak_mem_bytes=max((r.peak_mem_bytes for r in train), default=None),
            **harness_results(self._harness),
        )


def harness_results(record: HarnessRecord | None) -> dict:
    """RunResults' harness fields from the last harness record ({} without one)."""
    if record is None:
        return {}
    return {
        "harness": record.scores,
        "harness_step": record.step,
        "harness_source": record.source,
    }


def _median(values: list[float | None]) -> float | None:
    """The median of the values there are (mfu is None without a known peak)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None
