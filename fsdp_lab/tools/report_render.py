"""What `fsdp-lab report` writes from the figures it read: report.md's text, and two PNG plots
(throughput against peak memory per job, and loss curves overlaid).

Plots are drawn with matplotlib's object API (``Figure``, drawn by the Agg renderer), never
pyplot: no display is needed on a headless node, and importing this module does not switch the
backend of a notebook that imports it. Each file is written to a temporary name and renamed, so a
reader never sees half a PNG and re-running the report replaces it.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator, StrMethodFormatter

THROUGHPUT_PNG, LOSS_PNG = "throughput_vs_memory.png", "loss_curves.png"
# Lines of several jobs often coincide (same seed, same data): a dash pattern per job keeps
# each visible under the others.
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
ERROR_CHARS = 90  # enough of an error to recognise it in the table; run.json holds all of it
MAX_RANKS_LISTED = 8  # beyond this the per-rank cell gives the range


@dataclass
class Job:
    """One job dir as the report sees it."""

    name: str  # the dir's name: Hydra's job number
    facts: dict  # its run.json
    options: dict[str, str]  # its group choices and overrides, key -> value; {} if unknown
    train: list[dict]  # metrics.jsonl records, one per optimizer step
    val: list[dict]  # one per evaluation

    @property
    def status(self) -> str:
        return str(self.facts.get("status", "unknown"))


@dataclass
class Figures:
    """The table's numbers for one job; None where its run dir has no record of them."""

    steps: int | None
    tokens_per_s: float | None  # all ranks; median over the steps after the first
    step_time_s: float | None  # median over the steps after the first
    peak_mib_per_rank: list[float]  # each rank's highest peak over the run
    final_loss: float | None  # the last step's train loss
    val_loss: float | None  # the last evaluation's
    mfu: float | None  # median after the first step; None where the device has no peak FLOPs


# Long: report.md's sections in the order a reader meets them.
def render_markdown(
    sweep_dir: Path,
    jobs: list[Job],
    figures: list[Figures],
    varying: list[str],
    fixed: dict[str, str],
    study: dict | None = None,
) -> str:
    """report.md: a header of what all jobs share (and an Optuna study's best trial), one table
    row per job, how to read it."""
    counts = Counter(job.status for job in jobs)
    hardware = dict.fromkeys(
        f"{j.facts['hardware']}, {j.facts.get('world_size', '?')} ranks"
        for j in jobs
        if "hardware" in j.facts
    )
    lines = [
        "# Sweep report",
        "",
        f"`{sweep_dir.resolve()}`: {len(jobs)} jobs "
        f"({', '.join(f'{n} {status}' for status, n in counts.items())}).",
        "",
    ]
    if hardware:
        lines += [f"hardware: {'; '.join(hardware)}", ""]
    if fixed:
        lines += ["fixed: " + ", ".join(f"{k}={v}" for k, v in fixed.items()), ""]
    values: dict[str, float | None] = {}
    interrupted: set[str] = set()
    if study:
        lines += _study_lines(study)
        values = {str(t["number"]): t.get("value") for t in study.get("trials", [])}
        interrupted = {
            str(t["number"])
            for t in study.get("trials", [])
            if str(t.get("error") or "").startswith("interrupted")
        }
    has_val = any(f.val_loss is not None for f in figures)
    has_mfu = any(f.mfu is not None for f in figures)
    header = [
        "job",
        *varying,
        "status",
        "steps",
        "tokens/s",
        "step time (ms)",
        "peak MiB (max rank)",
        "peak MiB per rank",
        "final loss",
    ]
    header += ["val loss"] * has_val + ["MFU"] * has_mfu
    if study:
        header.append(f"objective ({study.get('objective')})")
    lines += [_row(header), _row(["---"] * len(header))]
    for job, f in zip(jobs, figures, strict=True):
        cells = [
            job.name,
            *(job.options.get(k, "?") for k in varying),
            # a study's trial cut off by a stop: its run.json still says how far it got
            "interrupted" if job.name in interrupted else _status_cell(job),
            _fmt(f.steps, "{}"),
            _fmt(f.tokens_per_s, "{:,.0f}"),
            _fmt(f.step_time_s and f.step_time_s * 1000, "{:.1f}"),
            _fmt(max(f.peak_mib_per_rank, default=None), "{:.0f}"),
            _per_rank_cell(f.peak_mib_per_rank),
            _fmt(f.final_loss, "{:.4f}"),
        ]
        cells += [_fmt(f.val_loss, "{:.4f}")] * has_val + [_fmt(f.mfu, "{:.1%}")] * has_mfu
        if study:
            cells.append(_fmt(values.get(job.name), "{:.6g}"))
        lines.append(_row(cells))
    lines += [
        "",
        *NOTES,
        "",
        "![throughput vs peak memory](throughput_vs_memory.png)",
        "",
        "![loss curves](loss_curves.png)",
        "",
    ]
    return "\n".join(lines)


def _study_lines(study: dict) -> list[str]:
    """The study's objective, its trials' outcome and its best trial (job dir = trial number)."""
    trials = study.get("trials", [])
    states = Counter(str(t.get("state", "?")).lower() for t in trials)
    lines = [
        f"Optuna study `{study.get('study_name')}`: objective {study.get('objective')} "
        f"({study.get('direction')}), {len(trials)} trials "
        f"({', '.join(f'{n} {state}' for state, n in states.items())}).",
        "",
    ]
    best = study.get("best")
    if best:
        params = " ".join(f"{k}={v}" for k, v in best["params"].items())
        lines += [f"best: trial {best['trial']}, {best['value']:.6g}: `{params}`", ""]
    return lines


NOTES = [
    "- **tokens/s** (all ranks together) and **step time**: the median over the optimizer steps "
    "after the first (and after the first of a resumed run): those include warm-up "
    "(allocation, first collectives, compilation).",
    "- **peak MiB**: each rank's highest peak memory over the run (1 MiB = 2^20 bytes); on GPU "
    "the allocator's peak, on CPU the process's resident-set high-water mark (which includes "
    "the interpreter and libraries).",
    "- **final loss**: the train loss of the last step recorded; **val loss**: the last "
    "evaluation's. A failed job's full error is in its run.json.",
]


def _status_cell(job: Job) -> str:
    """The status, with a failure's one-line error (shortened: the table stays readable)."""
    if job.status == "preempted" and "step" in job.facts:
        return f"preempted at step {job.facts['step']}"
    error = " ".join(str(job.facts.get("error") or "").split())
    if len(error) > ERROR_CHARS:
        error = error[: ERROR_CHARS - 1] + "…"
    return f"{job.status}: {error}" if error else job.status


def _per_rank_cell(peaks: list[float]) -> str:
    """Each rank's peak, or their range where a list would swamp the table."""
    if not peaks:
        return "-"
    if len(peaks) > MAX_RANKS_LISTED:
        return f"{min(peaks):.0f} to {max(peaks):.0f} ({len(peaks)} ranks)"
    return " / ".join(f"{p:.0f}" for p in peaks)


def _fmt(value, spec: str) -> str:
    """A number in spec, "-" for none (a diverged step's nan or inf shows as such)."""
    return "-" if value is None else spec.format(value)


def _row(cells: list[str]) -> str:
    """A Markdown table row; a | inside a cell (an error message) would split it."""
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def write_plots(
    jobs: list[Job], figures: list[Figures], varying: list[str], out_dir: Path
) -> list[Path]:
    """Both plots into out_dir; their paths. The legends name the options in varying."""
    labels = [job_label(job, varying) for job in jobs]
    return [
        plot_throughput(jobs, figures, labels, out_dir / THROUGHPUT_PNG),
        plot_losses(jobs, labels, out_dir / LOSS_PNG),
    ]


def job_label(job: Job, varying: list[str]) -> str:
    """A job in a legend: its number and the options that vary."""
    options = ", ".join(f"{k}={job.options.get(k, '?')}" for k in varying)
    return f"job {job.name}: {options}" if options else f"job {job.name}"


def _figure(num_jobs: int):
    """Tall enough for a one-column legend of every job beside the axes."""
    fig = Figure(figsize=(8, max(4.5, 0.17 * num_jobs + 1.0)))
    return fig, fig.subplots()


def _color(index: int, total: int):
    cmap = colormaps["tab10" if total <= 10 else "tab20"]
    return cmap(index % cmap.N)


def plot_throughput(jobs: list[Job], figures: list[Figures], labels: list[str], path: Path) -> Path:
    """One point per job that has figures (x: peak memory per rank, y: tokens/s), numbered on
    the plot and named in the legend: labels next to points collide when jobs land close."""
    fig, ax = _figure(len(jobs))
    handles = []
    for i, (job, f, label) in enumerate(zip(jobs, figures, labels, strict=True)):
        if f.tokens_per_s is None or not f.peak_mib_per_rank:
            continue
        point = (max(f.peak_mib_per_rank), f.tokens_per_s)
        failed = job.status == "failed"
        handles.append(
            ax.scatter(
                *point,
                s=60,
                color=_color(i, len(jobs)),
                zorder=3,
                marker="x" if failed else MARKERS[i % len(MARKERS)],
                label=f"{label} (failed)" if failed else label,
            )
        )
        ax.annotate(job.name, point, textcoords="offset points", xytext=(6, 6), fontsize=9)
    ax.set_xlabel("peak memory per rank, max over ranks (MiB)")
    ax.set_ylabel("tokens/s (all ranks, median after step 1)")
    ax.set_title("Throughput vs peak memory")
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    ax.grid(True, alpha=0.3)
    _pad_limits(ax)
    return _finish(fig, ax, path, handles)


def plot_losses(jobs: list[Job], labels: list[str], path: Path) -> Path:
    """Train loss per step, one line per job; validation loss as markers in the job's colour.
    One legend entry per job shows both its line and its marker."""
    fig, ax = _figure(len(jobs))
    handles, values = [], []
    for i, (job, label) in enumerate(zip(jobs, labels, strict=True)):
        train, val = _points(job.train, "loss"), _points(job.val, "val_loss")
        if not train and not val:
            continue
        style = {
            "color": _color(i, len(jobs)),
            "markerfacecolor": "none",
            "markersize": 6,
            "linewidth": 1.5,
        }
        linestyle, marker = LINESTYLES[i % len(LINESTYLES)], MARKERS[i % len(MARKERS)]
        if train:
            ax.plot(*zip(*train, strict=True), linestyle=linestyle, **style)
        if val:
            ax.plot(*zip(*val, strict=True), linestyle="none", marker=marker, **style)
        failed = " (failed)" if job.status == "failed" else ""
        handles.append(
            Line2D(
                [],
                [],
                linestyle=linestyle if train else "none",
                marker=marker if val else None,
                label=f"{label}{failed}",
                **style,
            )
        )
        values += [y for _, y in train + val]
    if values and min(values) > 0 and max(values) / min(values) > 50:
        ax.set_yscale("log")  # one diverging job would otherwise flatten every other curve
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loss (lines: train, markers: validation)")
    ax.set_title("Loss curves")
    ax.grid(True, alpha=0.3)
    return _finish(fig, ax, path, handles)


def _points(records: list[dict], key: str) -> list[tuple[float, float]]:
    """(step, value) of the records with both as finite numbers: a diverged step (inf, nan) or
    a missing value is not drawn."""
    pairs = [(r.get("step"), r.get(key)) for r in records]
    return [(x, y) for x, y in pairs if _finite(x) and _finite(y)]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pad_limits(ax) -> None:
    """Room around the points: a single point (or a column of them) gets a visible axis span."""
    for get, set_ in ((ax.get_xlim, ax.set_xlim), (ax.get_ylim, ax.set_ylim)):
        low, high = get()
        pad = (high - low) * 0.1 or abs(high) * 0.05 or 1.0
        set_(low - pad, high + pad)


def _finish(fig, ax, path: Path, handles: list) -> Path:
    """Legend outside the axes (never over the data), or a note when no job has figures."""
    if handles:
        ax.legend(
            handles=handles,
            loc="upper left",
            bbox_to_anchor=(1.02, 1.0),
            borderaxespad=0.0,
            fontsize=8,
            frameon=False,
        )
    else:
        ax.text(
            0.5, 0.5, "no job has metrics yet", ha="center", va="center", transform=ax.transAxes
        )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    os.replace(tmp, path)
    return path
