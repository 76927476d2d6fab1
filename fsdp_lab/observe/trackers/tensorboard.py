"""``logger=tensorboard``: TensorBoard event files in <run dir>/tensorboard, from rank 0.

One log dir per job under its run dir, so a sweep's jobs sit side by side in one view::

    tensorboard --logdir multirun/2026-11-22/06-00-00      # every job, named by its number
    tensorboard --logdir outputs                           # every single run

The config and the system's facts go in as hparams and a text summary. A resumed run appends to
the same log dir; steps the earlier attempt logged are not logged twice (the reporter skips
them).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from fsdp_lab.observe.trackers.base import RunInfo, Tracker

log = logging.getLogger("fsdp_lab")

LOG_DIR = "tensorboard"
_HPARAM_TYPES = (bool, int, float, str)


@dataclass
class TensorBoardSettings:
    flush_secs: int = 30
    """How often the event file is flushed to disk (TensorBoard's own default is 120)."""

    def __post_init__(self) -> None:
        if self.flush_secs <= 0:
            raise ValueError(f"flush_secs={self.flush_secs}: must be positive")


class TensorBoardTracker(Tracker):
    """Rank 0's SummaryWriter."""

    Settings = TensorBoardSettings
    requires = (("tensorboard", "tensorboard"),)

    def __init__(self, writer, log_dir: str) -> None:
        self._writer = writer
        self._log_dir = log_dir

    @classmethod
    def start(
        cls, settings: TensorBoardSettings, run: RunInfo, *, resume: dict | None
    ) -> TensorBoardTracker:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = run.run_dir / LOG_DIR
        writer = SummaryWriter(log_dir=str(log_dir), flush_secs=settings.flush_secs)
        if resume is None:  # a continued run has its config in the dir already
            params = {k: v for k, v in run.params.items() if isinstance(v, _HPARAM_TYPES)}
            writer.add_text("config", "```\n" + json.dumps(run.params, indent=1) + "\n```")
            writer.add_hparams(params, {}, run_name=".")
        log.info("TensorBoard: %s (`tensorboard --logdir %s`)", log_dir, run.run_dir)
        tracker = cls(writer, str(log_dir))
        tracker.continues = resume is not None  # the same dir: the earlier events are there
        return tracker

    @property
    def info(self) -> dict:
        return {"log_dir": self._log_dir}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)

    def log_samples(self, samples: list[dict], step: int) -> None:
        """Each prompt's completion as text (`samples/<index>`), at the evaluation's step."""
        for s in samples:
            text = f"prompt: {s['prompt']}\n\noutput ({s['tokens']} tokens): {s['output']}"
            self._writer.add_text(f"samples/{s['index']}", text, global_step=step)

    def finish(self, *, status: str, summary: dict) -> None:
        self._writer.add_text("summary", json.dumps({"status": status, **summary}, indent=1))
        self._writer.close()
