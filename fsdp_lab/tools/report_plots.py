"""`fsdp-lab report`'s plots: throughput against peak memory per job, loss curves overlaid,
and, where jobs ran with profile=trace, each one's profiled step split into compute, exposed
communication and idle.

Plots are drawn with matplotlib's object API (``Figure``, drawn by the Agg renderer), never
pyplot: no display is needed on a headless node, and importing this module does not switch the
backend of a notebook that imports it. Each file is written to a temporary name and renamed, so a
reader never sees half a PNG and re-running the report replaces it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator, StrMethodFormatter

from fsdp_lab.observe.profile.picture import COMPUTE_COLOR, EXPOSED_COLOR
from fsdp_lab.observe.rundir import write_png
from fsdp_lab.tools.report_render import (
    LOSS_PNG,
    STEP_BREAKDOWN_PNG,
    THROUGHPUT_PNG,
    Figures,
    Job,
)

# Lines of several jobs often coincide (same seed, same data): a dash pattern per job keeps
# each visible under the others.
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")


def write_plots(
    jobs: list[Job], figures: list[Figures], varying: list[str], out_dir: Path
) -> list[Path]:
    """The plots into out_dir; their paths. The legends name the options in varying. The step
    breakdown only where a job was profiled: a sweep without profile=trace gets no empty plot."""
    labels = [job_label(job, varying) for job in jobs]
    paths = [
        plot_throughput(jobs, figures, labels, out_dir / THROUGHPUT_PNG),
        plot_losses(jobs, labels, out_dir / LOSS_PNG),
    ]
    if any(f.profile is not None for f in figures):
        paths.append(plot_step_breakdown(figures, labels, out_dir / STEP_BREAKDOWN_PNG))
    return paths


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
        train = _points((r.step, r.loss) for r in job.train)
        val = _points((r.step, r.val_loss) for r in job.val)
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


def plot_step_breakdown(figures: list[Figures], labels: list[str], path: Path) -> Path:
    """One horizontal bar per profiled job (job order, top down) of its mean profiled step:
    compute, then exposed comm, then idle, which add up to the step; its total at the end."""
    bars = [(label, f.profile) for f, label in zip(figures, labels, strict=True) if f.profile]
    fig = Figure(figsize=(8, max(2.5, 0.35 * len(bars) + 1.5)))
    ax = fig.subplots()
    y = range(len(bars))
    left = [0.0] * len(bars)
    handles = []
    segments = (
        ("compute", "compute_s", {"color": COMPUTE_COLOR}),
        ("exposed comm", "exposed_comm_s", {"color": EXPOSED_COLOR}),
        ("idle", "idle_s", {"color": "#f2f2f2", "edgecolor": COMPUTE_COLOR, "linewidth": 0.6}),
    )
    for name, time, style in segments:
        widths = [getattr(b, time) * 1000 for _, b in bars]
        handles.append(ax.barh(y, widths, left=left, height=0.6, label=name, **style))
        left = [x + w for x, w in zip(left, widths, strict=True)]
    for i, (_, b) in enumerate(bars):
        ax.text(left[i], i, f" {b.step_s * 1000:.1f} ms", va="center", fontsize=8)
    ax.set_yticks(list(y), [label for label, _ in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(left) * 1.18 or 1.0)
    ax.set_xlabel("ms per step (mean over the profiled steps and ranks)")
    ax.set_title("Where a profiled step's time goes")
    ax.grid(True, axis="x", alpha=0.3)
    return _finish(fig, ax, path, handles)


def _points(pairs: Iterable[tuple]) -> list[tuple[float, float]]:
    """The (step, value) pairs with both finite numbers: a diverged step (inf, nan) or a
    missing value is not drawn."""
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
    return write_png(path, fig)
