"""Experiment trackers beside metrics.jsonl: ``logger=wandb`` (the default), ``tensorboard``,
``mlflow``, several at once (``logger=[wandb,tensorboard]``) or none (``logger=none``).

Each option of the logger group is one YAML file that adds one key under ``logger``::

    # conf/logger/tensorboard.yaml
    tensorboard:
      tracker: fsdp_lab.observe.trackers.tensorboard.TensorBoardTracker
      flush_secs: 30

``tracker`` names the ``Tracker`` subclass (``base.py``); the other keys are its ``Settings``.
Nothing else in fsdp_lab names a tracker: the reporter drives a ``TrackerSet``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp_lab.config import ConfigError, first_line
from fsdp_lab.observe.trackers.base import RunInfo, Tracker, metrics_of, settings_of

log = logging.getLogger("fsdp_lab")

__all__ = ["RunInfo", "Tracker", "TrackerSet", "check", "chosen"]


@dataclass
class Chosen:
    """One tracker of the config: its name (its key under `logger`), class and settings."""

    name: str
    cls: type[Tracker]
    settings: Any


def chosen(logger: dict) -> list[Chosen]:
    """The trackers ``logger`` (the config's) names, their settings checked; ConfigError in
    one line for a tracker that cannot be found, lacks its package, or has a bad setting."""
    return [_load(name, dict(raw or {})) for name, raw in logger.items()]


def check(logger: dict) -> None:
    """The launcher's check, before any rank starts: imports no tracker's library."""
    chosen(logger)


def _load(name: str, raw: dict) -> Chosen:
    path = raw.pop("tracker", None)
    if not isinstance(path, str) or "." not in path:
        raise ConfigError(
            f"logger.{name}: no `tracker` naming its class (module.Class); every file in "
            "conf/logger/ sets one, see docs/experiments-and-wandb.md#adding-a-tracker"
        )
    module_name, _, class_name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"logger.{name}.tracker={path}: cannot import it ({e})") from e
    if not (isinstance(cls, type) and issubclass(cls, Tracker)):
        raise ConfigError(f"logger.{name}.tracker={path} is not a fsdp_lab Tracker subclass")
    for module, package in cls.requires:
        if importlib.util.find_spec(module) is None:
            ours = cls.__module__.startswith("fsdp_lab.")  # its package is in the trackers extra
            fix = f"pip install -e '.[trackers]' (or pip install {package})"
            fix = fix if ours else f"pip install {package}"
            raise ConfigError(
                f"logger={name} needs the {package} package: {fix}, or choose another logger"
            )
    try:
        settings = settings_of(cls, raw)
    except ValueError as e:
        raise ConfigError(f"logger.{name}: {e}") from e
    return Chosen(name, cls, settings)


class TrackerSet:
    """Rank 0's trackers. A tracker that fails to start, or fails later, is dropped after one
    warning: the run goes on, metrics.jsonl and the other trackers keep every record."""

    def __init__(self, started: dict[str, Tracker], *, skip_through: dict[str, int]) -> None:
        self._started = started
        self._skip_through = skip_through  # per tracker: it has the steps up to here already

    @classmethod
    def start(
        cls,
        logger: dict,
        run: RunInfo,
        *,
        resume: dict[str, dict],
        logged_through: int,
        history: list[dict],
    ) -> TrackerSet:
        """Start every tracker of ``logger``. A resumed run gives ``resume``, each tracker's
        run.json info from the attempt before, ``logged_through``, the last step the trackers
        were sent then, and ``history``, the records metrics.jsonl kept: a tracker that
        continues its run skips the steps it has; one that starts a new run (new to the run, not
        started last time, or unable to continue) is sent the history first."""
        started = {}
        for c in chosen(logger):
            try:
                tracker = c.cls.start(c.settings, run, resume=resume.get(c.name))
            except Exception as e:  # noqa: BLE001 - no tracker may end the run
                log.warning(
                    "logger=%s failed to start (%s); the run goes on, metrics.jsonl has every "
                    "record",
                    c.name,
                    first_line(e, limit=240),
                )
                continue
            if tracker is not None:
                started[c.name] = tracker
        skip = {name: logged_through if t.continues else -1 for name, t in started.items()}
        tracker_set = cls(started, skip_through=skip)
        if history:
            tracker_set.log(history)
        return tracker_set

    @property
    def info(self) -> dict[str, dict]:
        """run.json's `trackers`: each started tracker's info (ids, dirs, URIs)."""
        return {name: t.info for name, t in self._started.items()}

    def log(self, records: list[dict]) -> None:
        """Records of metrics.jsonl, each at its step, then a flush; a tracker is sent only
        the steps it does not have."""
        if not self._started:
            return
        # On resume the history is mostly steps every tracker has: converted only if wanted.
        wanted = min(self._skip_through[name] for name in self._started)
        numbers = [(metrics_of(r), r["step"]) for r in records if r["step"] > wanted]
        for name in list(self._started):
            mine = [(m, step) for m, step in numbers if step > self._skip_through[name]]
            if mine:
                self._call(name, lambda t, mine=mine: _send(t, mine))

    def log_samples(self, samples: list[dict], step: int) -> None:
        """One evaluation's generations (samples.jsonl's lines) to every tracker."""
        self._each(lambda t: t.log_samples(samples, step))

    def finish(self, *, status: str, summary: dict, files: list[Path]) -> None:
        """The run's files and summary; every tracker closed."""
        clean = {k: v for k, v in summary.items() if v is not None}
        self._each(lambda t: t.log_files([p for p in files if p.is_file()]))
        self._each(lambda t: t.finish(status=status, summary=clean))
        self._started = {}

    def _each(self, call) -> None:
        for name in list(self._started):
            self._call(name, call)

    def _call(self, name: str, call) -> None:
        try:
            call(self._started[name])
        except Exception as e:  # noqa: BLE001 - no tracker may end the run
            log.warning(
                "logger=%s stopped (%s); metrics.jsonl and the other trackers have every record",
                name,
                first_line(e, limit=240),
            )
            del self._started[name]


def _send(tracker: Tracker, numbers: list[tuple[dict[str, float], int]]) -> None:
    for values, step in numbers:
        tracker.log_metrics(values, step)
    tracker.flush()


def log_sweep_files(logger: dict, sweep_dir: Path, paths: list[Path]) -> None:
    """A sweep's report to the trackers that keep a sweep-level run (MLflow's parent run);
    never raises: the report is on disk either way."""
    try:
        wanted = chosen(logger)
    except ConfigError as e:
        log.warning("the sweep's report goes to no tracker: %s", e)
        return
    for c in wanted:
        try:
            c.cls.log_sweep_files(c.settings, sweep_dir, paths)
        except Exception as e:  # noqa: BLE001 - the report is written already
            log.warning("logger=%s: the sweep's report was not logged (%s)", c.name, e)
