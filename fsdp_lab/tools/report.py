"""`fsdp-lab report MULTIRUN_DIR`: a sweep's jobs side by side, read back from their run dirs.

    fsdp-lab report multirun/2026-11-22/06-00-00   # writes report.md and two PNGs there

It reads only files: each job dir's run.json (status, error) and metrics.jsonl, the sweep's
multirun.yaml, and an Optuna study's study.json (its objective and best parameters). So it works
offline, on a sweep still running, on a partly failed one, and on old sweeps. A report is derived
data: running it again replaces the earlier one. This module reads the run dirs and reduces them
to figures; ``report_render`` writes report.md and ``report_plots`` the plots.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Iterable
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from fsdp_lab.config import ConfigError
from fsdp_lab.observe import rundir, trackers
from fsdp_lab.observe.profile.result import ProfileResult, StepBreakdown
from fsdp_lab.observe.record import JobRecord, RunRecord, RunResults, StepRecord
from fsdp_lab.observe.run_logs import MetricRows, read_rows, read_samples
from fsdp_lab.observe.rundir import (
    METRICS_FILE,
    RUN_FILE,
    SAMPLES_FILE,
    STUDY_FILE,
    write_atomic,
)
from fsdp_lab.tools.report_plots import write_plots
from fsdp_lab.tools.report_render import Figures, Job, render_markdown

REPORT_FILE = "report.md"
MULTIRUN_FILE = "multirun.yaml"
MIB = 2**20
EXAMPLE_DIR = "multirun/2026-11-22/06-00-00"


def write_report(sweep_dir: Path) -> list[Path]:
    """Write report.md and the plots into sweep_dir, replacing earlier ones; their paths,
    report.md first. ConfigError when sweep_dir holds no job dir (or cannot be written)."""
    sweep_dir = Path(sweep_dir)
    jobs = load_jobs(sweep_dir)
    study = _read_study(sweep_dir)
    varying, fixed = split_options(jobs, searched=_searched(study))
    figures = [summarize(job) for job in jobs]
    report = sweep_dir / REPORT_FILE
    try:
        plots = write_plots(jobs, figures, varying, sweep_dir)
        write_atomic(report, render_markdown(sweep_dir, jobs, figures, varying, fixed, study))
    except OSError as e:  # e.g. an old sweep on read-only storage: one line, not a traceback
        raise ConfigError(f"cannot write the report into {sweep_dir}: {e}") from e
    return [report, *plots]


def load_jobs(sweep_dir: Path) -> list[Job]:
    """Every job (a subdir with a run.json, or named by a job number, or a job of
    multirun.yaml's sweep not started) in job order."""
    if not sweep_dir.is_dir():
        raise ConfigError(
            f"{sweep_dir} is not a directory; pass a multirun dir such as {EXAMPLE_DIR}"
        )
    dirs = [
        d
        for d in sweep_dir.iterdir()
        if d.is_dir() and ((d / RUN_FILE).is_file() or d.name.isdigit())
    ]
    if not any((d / RUN_FILE).is_file() for d in dirs):
        what = "is a single run's dir and " if (sweep_dir / RUN_FILE).is_file() else ""
        raise ConfigError(
            f"{sweep_dir} {what}holds no job dir with a {RUN_FILE}; pass a "
            f"multirun dir such as {EXAMPLE_DIR}"
        )
    sweep_overrides, base_choices = sweep_record(sweep_dir)
    if all(d.name.isdigit() for d in dirs):  # and the jobs not started yet (or never: Ctrl-C)
        dirs += [
            sweep_dir / str(n)
            for n in range(len(sweep_overrides))
            if sweep_dir / str(n) not in dirs
        ]
    jobs = []
    for d in sorted(dirs, key=lambda d: (_job_number(d) < 0, _job_number(d), d.name)):
        run, num = _read_run_file(d), _job_number(d)
        fallback = sweep_overrides[num] if 0 <= num < len(sweep_overrides) else None
        options = job_options(run.job_record, fallback, base_choices)
        rows = _rows(d / METRICS_FILE)
        samples = read_samples(d / SAMPLES_FILE)
        jobs.append(Job(d.name, run, options, rows.train, rows.val, samples))
    return jobs


def _job_number(job_dir: Path) -> int:
    """Hydra names a job's dir by its number (hydra.sweep.subdir); -1 for another name."""
    return int(job_dir.name) if job_dir.name.isdigit() else -1


def sweep_record(sweep_dir: Path) -> tuple[list[list[str]], dict[str, str]]:
    """(each job's overrides by job number, the group choices before them) from multirun.yaml.

    For run dirs without run.json's "job" record (older sweeps, a job refused before launch):
    the overrides are expanded as Hydra's basic sweeper expands them, in its job order. Other
    sweepers choose jobs at run time, so their overrides cannot be rebuilt: ([], choices).
    """
    path = sweep_dir / MULTIRUN_FILE
    if not path.is_file():
        return [], {}
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser

        conf = OmegaConf.load(path)
        choices = OmegaConf.to_container(OmegaConf.select(conf, "hydra.runtime.choices") or {})
        sweeper = OmegaConf.select(conf, "hydra.sweeper._target_") or ""
        if not sweeper.endswith(BasicSweeper.__name__):
            return [], choices
        params = OmegaConf.select(conf, "hydra.sweeper.params") or {}
        args = [f"{k}={v}" for k, v in params.items()]
        args += list(OmegaConf.select(conf, "hydra.overrides.task") or [])
        batches = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(args), None)
    except Exception:  # noqa: BLE001 - an unreadable multirun.yaml costs columns, not the report
        return [], {}
    return [job for batch in batches for job in batch], choices


def job_options(
    record: JobRecord | None, fallback_overrides: list[str] | None, base_choices: dict
) -> dict[str, str]:
    """A job's options, key -> value: its overrides in the order given, then the group choices
    they did not touch. From run.json's "job" record, else the sweep's expansion; {} if
    neither (the job's settings are unknown, not the defaults)."""
    if record:
        overrides, choices = record.overrides or [], record.choices or {}
    elif fallback_overrides is not None:
        overrides, choices = fallback_overrides, base_choices
    else:
        return {}
    options: dict[str, str] = {}
    for override in overrides:
        key, sep, value = str(override).partition("=")
        key = key.lstrip("+~")
        if sep and not _is_hydra(key):
            options[key] = value
    for group, choice in choices.items():
        if not _is_hydra(group) and choice is not None:
            options.setdefault(group, str(choice))
    return options


def _is_hydra(key: str) -> bool:
    """Hydra's own settings (hydra.sweep.dir, hydra/launcher): not the experiment's."""
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _read_run_file(job_dir: Path) -> RunRecord:
    """run.json, or a stand-in saying why there is none: a report never stops at one job."""
    if not (job_dir / RUN_FILE).is_file():
        if not job_dir.is_dir():
            return RunRecord(status="not started")
        return RunRecord(status="unknown", error=f"no {RUN_FILE}")
    try:
        return rundir.read_run_file(job_dir)
    except (OSError, ValueError) as e:
        return RunRecord(status="unknown", error=f"unreadable {RUN_FILE}: {e}")


def _read_study(sweep_dir: Path) -> dict | None:
    """An Optuna study's record (hydra/sweeper=study writes it after every batch); None for a
    grid sweep, or one the report cannot read (the table still is)."""
    try:
        return json.loads((sweep_dir / STUDY_FILE).read_text())
    except (OSError, ValueError):
        return None


def _rows(path: Path) -> MetricRows:
    """metrics.jsonl's train and val rows. A run killed mid-write can leave a cut last line;
    the whole lines before it still count."""
    return read_rows(path, whole_lines_only=True)


def _searched(study: dict | None) -> set[str]:
    """The keys a study's sampler chose: columns even where every trial so far took one value."""
    trials = study.get("trials", []) if isinstance(study, dict) else []
    params = (key for t in trials if isinstance(t, dict) for key in t.get("params") or {})
    return {key.lstrip("+~") for key in params}  # named as the jobs' options are


def split_options(
    jobs: list[Job], searched: set[str] = frozenset()
) -> tuple[list[str], dict[str, str]]:
    """(keys whose value differs between jobs, or that a study searched: the table's columns,
    {key: value} of the rest). Jobs whose options are unknown take no part."""
    known = [job.options for job in jobs if job.options]
    keys = list(dict.fromkeys(key for options in known for key in options))
    varying = [
        key for key in keys if key in searched or len({options.get(key) for options in known}) > 1
    ]
    return varying, {key: known[0][key] for key in keys if key not in varying}


def summarize(job: Job) -> Figures:
    """Steady-state throughput and step time (the first step, and the first after a resume,
    include warm-up: allocation, the first collectives, compilation), peak memory, last losses."""
    run, train = job.run, job.train
    resumed_at = max(_numbers([run.start_step]), default=0)
    warm = {train[0].step if train else None, resumed_at + 1}
    steady = [r for r in train if r.step not in warm] or train
    losses, val_losses = _numbers(r.loss for r in train), _numbers(r.val_loss for r in job.val)
    steps = _numbers(r.step for r in train)
    last = max((s.step for s in job.samples), default=None)
    return Figures(
        steps=int(steps[-1]) if steps else run.step,
        tokens_per_s=_median(r.tokens_per_s for r in steady),
        step_time_s=_median(r.step_time_s for r in steady),
        peak_mib_per_rank=_peak_mib_per_rank(train),
        final_loss=losses[-1] if losses else (run.results or RunResults()).final_loss,
        val_loss=val_losses[-1] if val_losses else None,
        mfu=_median(r.mfu for r in steady),
        profile=_profile(run.results.profile if run.results else None),
        harness=_harness(run.results),
        sample=next((s.output for s in job.samples if s.step == last), None),
        predicted=run.results.predicted if run.results is not None else None,
    )


def _harness(results: RunResults | None) -> dict[str, float]:
    """run.json's last harness scores (`task/metric` -> value); {} without any."""
    scores = results.harness if results is not None else None
    if not isinstance(scores, dict):
        return {}
    return {str(k): float(v) for k, v in scores.items() if _numbers([v])}


def _profile(section) -> StepBreakdown | None:
    """run.json's profile section (profile=trace) as its mean step over the window's steps and
    ranks; None without one, or with one the report cannot read (the rest of the row still is)."""
    if not isinstance(section, dict):
        return None
    try:
        mean = ProfileResult.from_dict(section).mean()
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    return mean if mean.step_s > 0 else None


def _numbers(values: Iterable) -> list[float]:
    """The values that are numbers (absent or null ones skipped)."""
    return [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]


def _median(values: Iterable) -> float | None:
    """The median of the values that are numbers; None where there is none (mfu on CPU)."""
    numbers = _numbers(values)
    return statistics.median(numbers) if numbers else None


def _peak_mib_per_rank(records: list[StepRecord]) -> list[float]:
    """Each rank's highest peak over all steps (a peak can be reset between steps)."""
    peaks: list[float] = []
    for r in records:
        per_rank = r.peak_mem_bytes_per_rank or _numbers([r.peak_mem_bytes])
        for rank, value in enumerate(per_rank):
            if rank == len(peaks):
                peaks.append(0.0)
            peaks[rank] = max(peaks[rank], value / MIB)
    return peaks


class SweepReport(Callback):
    """Hydra's hook after the last job of a ``-m`` sweep: report.md and the plots in its multirun
    dir, as ``fsdp-lab report`` writes them, also given to the trackers that keep a sweep-level
    run (MLflow's parent run). A failing report never fails the sweep: the jobs' results are
    already safe on disk."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            paths = write_report(sweep_dir)
        except Exception as e:  # noqa: BLE001 - the jobs' results are already safe on disk
            print(f"fsdp_lab: warning: no sweep report for {sweep_dir}: {e}", file=sys.stderr)
            return
        print(f"fsdp_lab: sweep report: {paths[0]}", file=sys.stderr)
        logger = config.get("logger")  # logger=none: an empty node, nothing to send
        if logger:
            trackers.log_sweep_files(OmegaConf.to_container(logger, resolve=True), sweep_dir, paths)
