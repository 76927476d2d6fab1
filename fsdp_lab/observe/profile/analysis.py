"""Where each profiled step's time went, from a timeline: the numbers of run.json's
``profile`` section, the same whether the run computes them right after its window or
``fsdp-lab profile RUN_DIR`` reads the traces again.

For one step's span S, with C the union of compute and M the union of collectives:
compute = |C ∩ S|, comm = |M ∩ S|, exposed comm = |M \\ C| (what the step waited for), idle =
|S \\ (C ∪ M)|; so compute + exposed + idle = step. Idle is split by what the host was doing:
preparing the next batch (data), the optimizer step, or anything else (host).
"""

from __future__ import annotations

import re
import statistics
import time
from pathlib import Path

from fsdp_lab.config import ConfigError
from fsdp_lab.observe.profile.intervals import (
    Interval,
    clip,
    close_gaps,
    intersect,
    length,
    subtract,
    union,
)
from fsdp_lab.observe.profile.result import (
    ProfileResult,
    RankProfile,
    Span,
    StepBreakdown,
    StepPicture,
    UnitComm,
)
from fsdp_lab.observe.profile.timeline import (
    KERNEL_KIND_NAMES,
    Collective,
    Timeline,
    build_timeline,
    load_trace,
)

US = 1e-6  # traces count microseconds
PICTURE_PIXELS = 2000  # compute gaps narrower than a step / this are closed in the picture
TRACE_GLOB = "rank*.trace.json*"
_RANK = re.compile(r"rank(\d+)\.trace\.json")


def analyse(timeline: Timeline, *, rank: int, trace: str) -> RankProfile:
    """One rank's window: every step's breakdown, and the picture of its median-time step."""
    steps, pictures = [], []
    for step, lo, hi in timeline.steps:
        breakdown, picture = _step(timeline, step, lo, hi, rank)
        steps.append(breakdown)
        pictures.append(picture)
    picture = None
    if steps:
        median = statistics.median_low([s.step_s for s in steps])
        picture = pictures[[s.step_s for s in steps].index(median)]
    return RankProfile(rank=rank, device=timeline.device, trace=trace, steps=steps, picture=picture)


def _step(
    tl: Timeline, step: int, lo: float, hi: float, rank: int
) -> tuple[StepBreakdown, StepPicture]:
    compute = clip(tl.compute, lo, hi)
    kernels = _kernel_spans(tl.kernels, lo, hi)
    mine = [c for c in tl.comm if c.end > lo and c.start < hi]
    comm = union((max(c.start, lo), min(c.end, hi)) for c in mine)
    exposed = subtract(comm, compute)
    idle = subtract([(lo, hi)], union(compute + comm))
    data = intersect(idle, clip(tl.regions.get("data", []), lo, hi))
    optimizer = intersect(subtract(idle, data), clip(tl.regions.get("optimizer", []), lo, hi))
    breakdown = StepBreakdown(
        step=step,
        step_s=(hi - lo) * US,
        compute_s=length(compute) * US,
        comm_s=length(comm) * US,
        exposed_comm_s=length(exposed) * US,
        idle_s=length(idle) * US,
        idle_host_s=(length(idle) - length(data) - length(optimizer)) * US,
        idle_data_s=length(data) * US,
        idle_optimizer_s=length(optimizer) * US,
        units=_units(mine, compute, lo, hi),
        kernels={kind: length(spans) * US for kind, spans in kernels.items()},
    )
    return breakdown, _picture(rank, step, lo, hi, compute, mine, kernels)


def _units(mine: list[Collective], compute: list[Interval], lo: float, hi: float) -> list[UnitComm]:
    """Per (unit, kind), in the order first seen: count, busy time and its exposed part.
    Each unit's exposed time is its own: two collectives exposed at once count in both."""
    groups: dict[tuple[str, str], list[Collective]] = {}
    for c in mine:
        groups.setdefault((c.unit, c.kind), []).append(c)
    units = []
    for (unit, kind), members in groups.items():
        busy = union((max(c.start, lo), min(c.end, hi)) for c in members)
        units.append(
            UnitComm(
                unit=unit,
                kind=kind,
                count=len(members),
                time_s=length(busy) * US,
                exposed_s=length(subtract(busy, compute)) * US,
            )
        )
    return units


def _kernel_spans(
    kernels: list[tuple[float, float, str]], lo: float, hi: float
) -> dict[str, list[Interval]]:
    """Each kernel kind's busy intervals in the step (the union of its kernels, clipped), the
    kinds in timeline.KERNEL_KIND_NAMES' order; none on cpu."""
    spans: dict[str, list[Interval]] = {}
    for start, end, kind in kernels:
        if end > lo and start < hi:
            spans.setdefault(kind, []).append((max(start, lo), min(end, hi)))
    return {kind: union(spans[kind]) for kind in KERNEL_KIND_NAMES if kind in spans}


def _picture(
    rank: int,
    step: int,
    lo: float,
    hi: float,
    compute: list[Interval],
    mine: list[Collective],
    kernels: dict[str, list[Interval]],
) -> StepPicture:
    """The step as the timeline picture draws it, seconds from its start; on gpu the compute
    spans carry their kernel kind (matmul, attention...), elsewhere the kind "compute"."""

    def rel(s: float, e: float, kind: str, unit: str = "") -> Span:
        return Span((s - lo) * US, (e - lo) * US, kind, unit)

    pixel = (hi - lo) / PICTURE_PIXELS
    if kernels:
        spans = [
            rel(s, e, kind)
            for kind, intervals in kernels.items()
            for s, e in close_gaps(intervals, pixel)
        ]
    else:
        spans = [rel(s, e, "compute") for s, e in close_gaps(compute, pixel)]
    comm, exposed = [], []
    for c in mine:
        s, e = max(c.start, lo), min(c.end, hi)
        comm.append(rel(s, e, c.kind, c.unit))
        exposed += [rel(a, b, c.kind, c.unit) for a, b in subtract([(s, e)], compute)]
    return StepPicture(
        rank=rank,
        step=step,
        step_s=(hi - lo) * US,
        compute=spans,
        comm=comm,
        exposed=exposed,
    )


def analyse_trace(path: Path, *, rank: int | None = None, relative_to: Path | None = None):
    """One trace file's ``RankProfile``; the rank from the argument, the trace, or its name."""
    timeline = build_timeline(load_trace(path))
    if rank is None:
        rank = timeline.rank if timeline.rank is not None else trace_rank(path)
    name = str(path.relative_to(relative_to)) if relative_to is not None else str(path)
    return analyse(timeline, rank=rank, trace=name)


def trace_rank(path: Path) -> int:
    """The rank in a ``rank{r}.trace.json[.gz]`` name (0 for another name)."""
    m = _RANK.search(path.name)
    return int(m.group(1)) if m else 0


def analyse_dir(profile_dir: Path, *, relative_to: Path | None = None) -> ProfileResult:
    """Every rank's trace in ``profile_dir``, analysed again (``fsdp-lab profile``)."""
    paths = sorted(Path(profile_dir).glob(TRACE_GLOB), key=trace_rank)
    if not paths:
        raise ConfigError(
            f"no {TRACE_GLOB} in {profile_dir}; profile a run with profile=trace, or pass the "
            "run dir (its profile/ dir) or the directory holding the traces"
        )
    started = time.perf_counter()
    ranks = [analyse_trace(p, relative_to=relative_to) for p in paths]
    return ProfileResult(ranks=ranks, analysis_s=time.perf_counter() - started)
