"""What a tracker is: the interface the reporter drives, and what every tracker is given.

A tracker (W&B, TensorBoard, MLflow, or one of yours) runs on rank 0 only, beside
metrics.jsonl, which always has every record. The reporter calls, in order: ``start`` (or
continue, after a preemption), ``log_metrics`` at each step, ``log_files`` and ``finish`` with the
summary at the end. A tracker never ends a run: ``TrackerSet`` turns its errors into one warning
and drops it.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

_PER_RANK_SERIES = 8  # per-rank memory series are logged up to this many ranks
_NOT_METRICS = ("split", "step", "peak_mem_bytes_per_rank")


@dataclass
class RunInfo:
    """What every tracker is told of the run it records."""

    run_dir: Path
    params: dict[str, Any]
    """The flattened config (`sharding.strategy`...), the chosen options (`options.sharding`),
    an Optuna trial's (`study.name`, `study.trial`) and the system's facts (`system.torch`...)."""
    job: dict = field(default_factory=dict)
    """The launcher's: overrides, group choices, sweep dir and job number (empty: a single run)."""

    @property
    def sweep_dir(self) -> Path | None:
        return Path(self.job["sweep_dir"]) if self.job.get("sweep_dir") else None

    def identity(self, *, group: str | None, name: str | None, tags: list[str]) -> dict:
        """A run's name, group, job type and tags, the same in every tracker: the name is the
        job's overrides (`sharding=hybrid,precision=bf16`) or the run dir's; a sweep's jobs share
        a group named after their multirun dir; the tags are the chosen options."""
        job = self.job
        overrides = [o for o in job.get("overrides", []) if not o.startswith("hydra.")]
        if group is None and self.sweep_dir is not None:
            group = "/".join(self.sweep_dir.parts[-2:])
        choices = job.get("choices", {})
        all_tags = [f"{g}={o}" for g, o in sorted(choices.items())] + list(tags)
        auto_name = ",".join(overrides) or self.run_dir.name
        if job.get("study"):  # an Optuna study's trial: its number first, as the study reports
            all_tags.append(f"trial={job['num']}")
            auto_name = f"trial {job['num']}: {auto_name}"
        return {
            "name": name or auto_name,
            "group": group,
            "job_type": "sweep" if self.sweep_dir is not None else "train",
            "tags": [t[:64] for t in all_tags],
        }


class Tracker(abc.ABC):
    """One experiment tracker. A subclass is one module and one YAML file in conf/logger/
    (docs/experiments-and-wandb.md, "Adding a tracker"): it names its settings' dataclass in
    ``Settings`` and implements the methods below. Errors may propagate: the caller warns once
    and stops using the tracker."""

    Settings: ClassVar[type]
    """A dataclass of the tracker's YAML keys (besides `tracker`), with a docstring for each."""
    requires: ClassVar[tuple[tuple[str, str], ...]] = ()
    """(module, pip package) pairs it imports: a missing one is refused before launch."""
    continues: bool = False
    """Set by ``start`` when it continued the earlier attempt's run: that run has the steps the
    attempt logged, which it is then not sent again; a new run is sent metrics.jsonl's."""

    @classmethod
    @abc.abstractmethod
    def start(cls, settings: Any, run: RunInfo, *, resume: dict | None) -> Tracker | None:
        """Start the tracker's run, or with ``resume`` (what ``info`` said when the run started
        before a preemption) continue that same run, and say so in ``continues``. None: the
        tracker is off for this run (after saying why in the log)."""

    @property
    @abc.abstractmethod
    def info(self) -> dict:
        """Kept in run.json under trackers.<name>: what a resumed run needs to continue the
        same tracker run (an id, a directory), and what a user needs to find it."""

    @abc.abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Numbers at one optimizer step (`train/loss`, `val/loss`...; see ``metrics_of``). A
        logging window's steps come one call each, then ``flush``."""

    def flush(self) -> None:  # noqa: B027 - optional: for trackers that send in batches
        """The end of a logging window: send what ``log_metrics`` buffered."""

    def log_samples(self, samples: list[dict], step: int) -> None:  # noqa: B027 - optional
        """One evaluation's generations (eval.prompts): samples.jsonl's lines at ``step``, each
        with its prompt, output and token count. fsdp_lab's trackers keep them as a table (W&B),
        text artifacts (MLflow) or text (TensorBoard); samples.jsonl has them either way."""

    def log_files(self, paths: list[Path]) -> None:  # noqa: B027 - optional: some keep no files
        """Files of the finished run (run.json, config.yaml) as the tracker's artifacts."""

    @abc.abstractmethod
    def finish(self, *, status: str, summary: dict) -> None:
        """The run's final and best values; status is completed, preempted or failed."""

    @classmethod  # noqa: B027 - optional: most trackers have no sweep-level run
    def log_sweep_files(cls, settings: Any, sweep_dir: Path, paths: list[Path]) -> None:
        """A finished sweep's report (report.md, plots), where the tracker has a sweep-level
        run; most have none."""


def settings_of(tracker_cls: type[Tracker], raw: dict) -> Any:
    """The tracker's typed settings from its YAML keys (OmegaConf converts enums and numbers and
    runs ``__post_init__``): an unknown key or a wrong type raises ``ValueError`` with OmegaConf's
    first line (the caller names `logger.<name>`)."""

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(tracker_cls.Settings), raw))
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ValueError(f"{key}: " * bool(key) + str(e).splitlines()[0]) from e


def metrics_of(record: dict) -> dict[str, float]:
    """A metrics.jsonl record as trackers' numbers: `train/<key>` for a step (peak memory in
    GiB, per rank up to 8 ranks), `val/loss`, `val/ppl`, `val/tokens` for an evaluation,
    `harness/<task>/<metric>` for lm-eval's scores, `samples/new_tokens` and `samples/time_s`
    for an evaluation's generations,
    `profile/<time or share>` for a profiled window (profile=trace)."""
    if record["split"] == "profile":  # a profiled window's means (profile=trace)
        return {
            f"profile/{k}": v
            for k, v in record.items()
            if k not in _NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
    if record["split"] == "harness":  # lm-eval's scores, task/metric
        return {f"harness/{name}": v for name, v in (record.get("scores") or {}).items()}
    if record["split"] == "samples":  # eval.prompts: the generations' cost (text: log_samples)
        return {
            "samples/new_tokens": record["new_tokens"],
            "samples/time_s": record["samples_time_s"],
        }
    if record["split"] != "train":
        return {
            "val/loss": record["val_loss"],
            "val/ppl": record["val_ppl"],
            "val/tokens": record["val_tokens"],
        }
    data = {f"train/{k}": v for k, v in record.items() if k not in _NOT_METRICS and v is not None}
    peaks = record["peak_mem_bytes_per_rank"]
    data["train/peak_mem_gib"] = max(peaks) / 2**30
    if len(peaks) <= _PER_RANK_SERIES:
        data.update({f"memory/peak_gib_rank{r}": b / 2**30 for r, b in enumerate(peaks)})
    return data


_USERINFO = re.compile(r"^([a-z][a-z0-9+.-]*://[^/:@]*):[^/@]*@", re.IGNORECASE)


def redact(value: Any) -> Any:
    """A URL's password as *** (a tracking URI may carry one): never in params or run.json."""
    return _USERINFO.sub(r"\1:***@", value) if isinstance(value, str) else value


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"sharding": {"strategy": "full"}} -> {"sharding.strategy": "full"}: filterable params."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat
