"""A profiled window in words and records: run.json's section, the metrics.jsonl record, the
run log's line and ``fsdp-lab profile``'s table. One place formats them, so the run and the
command that reads its traces again print the same numbers."""

from __future__ import annotations

from fsdp_lab.observe.profile.result import (
    TIMES,
    ProfileResult,
    StepBreakdown,
    UnitComm,
    summary_dict,
)
from fsdp_lab.observe.profile.timeline import KERNEL_KIND_NAMES

TIMELINE_PNG = "timeline.png"
_UNITS_SHOWN = 40  # beyond this the unit table keeps the most exposed
_KINDS_IN_LINE = 4  # the log line's largest kernel kinds


def metrics_record(result: ProfileResult, step: int) -> dict:
    """metrics.jsonl's record of the window (split "profile"), at its last step: the means over
    its steps and ranks; the per-step, per-rank and per-unit numbers are in run.json."""
    return {
        "split": "profile",
        "step": step,
        "steps": result.steps,
        "ranks": len(result.ranks),
        **summary_dict(result.mean()),
        "analysis_s": result.analysis_s,
    }


def summary_line(result: ProfileResult) -> str:
    """One line for the run's log: the mean step split, and the most exposed collective."""
    m = result.mean()
    steps = result.steps
    window = f"{steps[0]}-{steps[-1]}" if steps else "-"
    line = (
        f"profile, steps {window} ({len(result.ranks)} ranks): step {_ms(m.step_s)} = "
        f"compute {_ms(m.compute_s)} ({m.share('compute_s'):.0%}) + exposed comm "
        f"{_ms(m.exposed_comm_s)} ({m.share('exposed_comm_s'):.0%}) + idle {_ms(m.idle_s)} "
        f"({m.share('idle_s'):.0%}); comm {_ms(m.comm_s)}, "
        f"{m.exposed_comm_s / m.comm_s if m.comm_s else 0:.0%} of it exposed"
    )
    worst = max(m.units, key=lambda u: u.exposed_s, default=None)
    if worst is not None and worst.exposed_s > 0:
        line += f"; most exposed: {worst.unit} {worst.kind} {_ms(worst.exposed_s)}"
    if m.kernels and m.compute_s > 0:
        top = sorted(m.kernels.items(), key=lambda kv: -kv[1])[:_KINDS_IN_LINE]
        line += "; compute: " + ", ".join(f"{k} {v / m.compute_s:.0%}" for k, v in top)
    return line


def table(result: ProfileResult) -> str:
    """``fsdp-lab profile``'s text: per rank the window's mean step split, then per FSDP unit
    and collective kind the mean over ranks, most exposed first where there are many."""
    header = ["rank", "device", *(_label(name) for name in TIMES)]
    rows = [[str(r.rank), r.device, *_times(r.mean())] for r in result.ranks]
    rows.append(["mean", "", *_times(result.mean())])
    lines = [
        f"steps {', '.join(map(str, result.steps))}; times in ms per step "
        f"(compute + exposed comm + idle = step; analysed in {result.analysis_s:.2f} s)",
        *_grid([header, *rows]),
        "",
    ]
    units = result.mean().units
    if len(units) > _UNITS_SHOWN:
        units = sorted(units, key=lambda u: -u.exposed_s)[:_UNITS_SHOWN]
    if units:
        lines += [
            "per FSDP unit (mean over ranks and steps):",
            *_grid(
                [["unit", "collective", "count", "time ms", "exposed ms", "exposed"]]
                + [_unit_row(u) for u in units]
            ),
        ]
    else:
        lines.append("no collective in the window (a single rank, or nothing sharded)")
    means = {r.rank: r.mean() for r in result.ranks}
    kinds = [kind for kind in KERNEL_KIND_NAMES if any(kind in m.kernels for m in means.values())]
    if kinds:
        lines += [
            "",
            "compute by kernel kind, ms per step (share of the rank's compute):",
            *_grid(
                [["rank", *kinds]] + [[str(rank), *_kinds(m, kinds)] for rank, m in means.items()],
                left=1,
            ),
        ]
    return "\n".join(lines)


def _kinds(b: StepBreakdown, kinds: list[str]) -> list[str]:
    cells = []
    for kind in kinds:
        seconds = b.kernels.get(kind, 0.0)
        share = seconds / b.compute_s if b.compute_s > 0 else 0.0
        cells.append(f"{seconds * 1000:.1f} ({share:.0%})")
    return cells


def _label(name: str) -> str:
    return name[:-2].replace("_", " ")


def _times(b: StepBreakdown) -> list[str]:
    return [f"{getattr(b, name) * 1000:.2f}" for name in TIMES]


def _unit_row(u: UnitComm) -> list[str]:
    share = u.exposed_s / u.time_s if u.time_s else 0.0
    return [
        u.unit,
        u.kind,
        f"{u.count:g}",
        f"{u.time_s * 1000:.2f}",
        f"{u.exposed_s * 1000:.2f}",
        f"{share:.0%}",
    ]


def _grid(rows: list[list[str]], *, left: int = 2) -> list[str]:
    """Aligned columns: the first ``left`` (names) to the left, numbers to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in rows
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"
