"""``profile/timeline.png``: one step of every profiled rank, as a trace viewer shows it but
reduced to what a reader of FSDP needs: is compute busy, which collectives run, which of them the
step waited for.

Each rank gets a row of lanes: compute; comm, its upper half the all-gathers (the forward's and
backward's prefetches) and its lower half the reduce-scatters and all-reduces, so that a gather
running beside a reduce hides neither; and a thin lane of the exposed parts (communication no
compute covered), also outlined in red on the comm lane. FSDP units are named on their
collectives where a span is wide enough to hold the name.

Spans are drawn per lane and colour with ``broken_barh`` (one collection each, not one patch per
span): a CPU trace has thousands of compute intervals per step. matplotlib's object API only, as
in ``tools.report_render``: no display, no backend switch for a notebook that imports this.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from fsdp_lab.observe.profile.result import OTHER_UNIT, ROOT_UNIT, Span, StepPicture
from fsdp_lab.observe.rundir import write_png

COMPUTE_COLOR, EXPOSED_COLOR = "#8c8c8c", "#d62728"
KIND_COLORS = {
    "all_gather": "#1f77b4",
    "reduce_scatter": "#2ca02c",
    "all_reduce": "#9467bd",
    "all_to_all": "#8c564b",
    "pipeline_p2p": "#bcbd22",  # a pipeline's sends and receives between stages
    "context_all_gather": "#17becf",  # context parallelism's keys and values
    "context_reduce_scatter": "#bcbd22",
    "other": "#ff7f0e",
}
GATHER_KINDS = ("all_gather", "context_all_gather")  # drawn in the top comm lane
# gpu: the compute lane coloured by kernel kind (timeline.kernel_kind); cpu: COMPUTE_COLOR.
KERNEL_COLORS = {
    "matmul": "#4c4c4c",
    "attention": "#17becf",
    "fused": "#bcbd22",
    "optimizer": "#e377c2",
    "loss": "#7f7f7f",
    "copy": "#ffbb78",
    "other": "#c7c7c7",
}
# Lanes as (bottom, height) in a rank's axes; the comm lane is split, gathers on top.
COMPUTE_LANE, GATHER_LANE, REDUCE_LANE, EXPOSED_LANE = (
    (2.0, 0.8),
    (1.4, 0.4),
    (1.0, 0.4),
    (0.55, 0.3),
)
LANE_TICKS = {2.4: "compute", 1.6: "comm: gather", 1.2: "comm: reduce", 0.7: "exposed"}
WIDTH_IN, AXES_LEFT, AXES_RIGHT = 13.0, 0.09, 0.99
ROW_IN, HEADER_IN = 1.15, 0.9  # a rank's row, the title and legend above them
LABEL_PT = 6.0
MAX_RANKS = 16  # rows drawn at most
CHAR_IN = 0.62 * LABEL_PT / 72  # a label character's width, near enough to decide if it fits


def draw_timeline(pictures: list[StepPicture], path: Path) -> Path:
    """The PNG at path (written atomically; its folder made), one row per picture; a picture
    saying so when there is none. Its path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_png(path, build_timeline(pictures))


def build_timeline(pictures: list[StepPicture]) -> Figure:
    """The figure draw_timeline writes: one axes per rank (rank order), sharing the x axis; of
    many ranks the MAX_RANKS slowest (a tall picture of 64 alike rows says less than the
    slowest ranks do; the title says how many were profiled)."""
    profiled = len(pictures)
    if profiled > MAX_RANKS:
        pictures = sorted(pictures, key=lambda p: -p.step_s)[:MAX_RANKS]
    pictures = sorted(pictures, key=lambda p: p.rank)
    if not pictures:
        fig = Figure(figsize=(8, 1.5))
        ax = fig.subplots()
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no profiled step", ha="center", va="center", transform=ax.transAxes)
        return fig
    height = HEADER_IN + ROW_IN * len(pictures) + 0.4
    fig = Figure(figsize=(WIDTH_IN, height))
    axes = fig.subplots(len(pictures), 1, sharex=True, squeeze=False)[:, 0]
    fig.subplots_adjust(
        left=AXES_LEFT,
        right=AXES_RIGHT,
        top=1 - HEADER_IN / height,
        bottom=0.45 / height,
        hspace=0.5,
    )
    step_ms = max(p.step_s for p in pictures) * 1000 or 1.0
    ms_per_in = step_ms / (WIDTH_IN * (AXES_RIGHT - AXES_LEFT))
    names = short_unit_names({s.unit for p in pictures for s in p.comm})
    for ax, picture in zip(axes, pictures, strict=True):
        _draw_rank(ax, picture, names, ms_per_in)
    axes[-1].set_xlim(0, step_ms)
    axes[-1].set_xlabel("ms from the step's start")
    shown = f" (the {len(pictures)} slowest of {profiled} ranks)" * (profiled > len(pictures))
    fig.suptitle(_title(pictures) + shown, y=1 - 0.12 / height)
    kinds = [k for k in KIND_COLORS if any(_kind(s) == k for p in pictures for s in p.comm)]
    drawn = {s.kind for p in pictures for s in p.compute}
    handles = [Patch(color=KERNEL_COLORS[k], label=k) for k in KERNEL_COLORS if k in drawn]
    if not handles or "compute" in drawn:
        handles.insert(0, Patch(color=COMPUTE_COLOR, label="compute"))
    handles += [Patch(color=KIND_COLORS[k], label=k.replace("_", "-")) for k in kinds]
    handles.append(Patch(color=EXPOSED_COLOR, label="exposed (comm not covered by compute)"))
    fig.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 1 - 0.4 / height),
        ncol=len(handles),
        fontsize=8,
        frameon=False,
    )
    return fig


def _draw_rank(ax, picture: StepPicture, names: dict[str, str], ms_per_in: float) -> None:
    """One rank's lanes, its unit labels, and a title with its step time and exposed share."""
    # No edges: an edge widens each span by its line and hides the gaps between spans.
    bars = {"linewidth": 0}
    for kind in ("compute", *KERNEL_COLORS):
        spans = [s for s in picture.compute if s.kind == kind]
        if spans or kind == "compute":
            color = KERNEL_COLORS.get(kind, COMPUTE_COLOR)
            gid = "compute" if kind == "compute" else f"compute:{kind}"
            ax.broken_barh(_ranges(spans), COMPUTE_LANE, color=color, gid=gid, **bars)
    gathers = [s for s in picture.comm if _kind(s) in GATHER_KINDS]
    reduces = [s for s in picture.comm if _kind(s) not in GATHER_KINDS]
    for spans, lane in ((gathers, GATHER_LANE), (reduces, REDUCE_LANE)):
        for kind in KIND_COLORS:
            of_kind = [s for s in spans if _kind(s) == kind]
            if of_kind:
                color = KIND_COLORS[kind]
                ax.broken_barh(_ranges(of_kind), lane, color=color, gid=f"comm:{kind}", **bars)
        _label_units(ax, spans, lane, names, ms_per_in)
    exposed = _ranges(picture.exposed)
    ax.broken_barh(exposed, EXPOSED_LANE, color=EXPOSED_COLOR, gid="exposed", **bars)
    outline = (REDUCE_LANE[0], GATHER_LANE[0] + GATHER_LANE[1] - REDUCE_LANE[0])
    ax.broken_barh(
        exposed,
        outline,
        facecolor="none",
        edgecolor=EXPOSED_COLOR,
        hatch="////",
        linewidth=0.8,
        gid="exposed-outline",
    )
    ax.set_ylim(0.4, 2.9)
    ax.set_yticks(list(LANE_TICKS), list(LANE_TICKS.values()), fontsize=7)
    ax.tick_params(axis="y", length=0)
    ax.grid(True, axis="x", alpha=0.3)
    exposed_s = union_s(picture.exposed)
    share = exposed_s / picture.step_s if picture.step_s > 0 else 0.0
    ax.set_title(
        f"rank {picture.rank}, step {picture.step}: {picture.step_s * 1000:.1f} ms, "
        f"exposed comm {exposed_s * 1000:.1f} ms ({share:.0%})",
        loc="left",
        fontsize=9,
    )


def _label_units(
    ax, spans: list[Span], lane: tuple[float, float], names: dict[str, str], ms_per_in: float
) -> None:
    """Each span's unit, centred on it, where the name fits inside it and clears the label
    before it (spans of one lane can overlap). A narrow span gets the name's last part
    (layers.7 -> 7): with 30 units, numbers still fit where names do not."""
    last_end = float("-inf")
    for span in sorted(spans, key=lambda s: s.start_s):
        start, end = span.start_s * 1000, span.end_s * 1000
        full = names.get(span.unit, "")
        for name in (full, full.rsplit(".", 1)[-1]):
            need_ms = (len(name) * CHAR_IN + 0.03) * ms_per_in
            if name and end - start >= need_ms:
                break
        else:
            continue
        middle = (start + end) / 2
        if middle - need_ms / 2 < last_end:
            continue
        last_end = middle + need_ms / 2
        ax.text(
            middle,
            lane[0] + lane[1] / 2,
            name,
            ha="center",
            va="center",
            fontsize=LABEL_PT,
            color="white",
            clip_on=True,
            gid="unit-label",
        )


def short_unit_names(units: set[str]) -> dict[str, str]:
    """Unit name -> its label: the leading module names all units share dropped
    (model.layers.7 -> layers.7, model.embed_tokens -> embed_tokens), never down to a bare
    layer number; root and other as they are; no label for a collective without a unit."""
    named = sorted(u for u in units if u and u not in (ROOT_UNIT, OTHER_UNIT))
    parts = [u.split(".") for u in named]
    drop = 0
    while parts and all(
        len(p) - drop > (2 if p[-1].isdigit() else 1) and p[drop] == parts[0][drop] for p in parts
    ):
        drop += 1
    names = {u: ".".join(p[drop:]) for u, p in zip(named, parts, strict=True)}
    return {**names, **{u: u for u in (ROOT_UNIT, OTHER_UNIT) if u in units}}


def union_s(spans: list[Span]) -> float:
    """The time covered by spans (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for span in sorted(spans, key=lambda s: s.start_s):
        if span.end_s > end:
            total += span.end_s - max(span.start_s, end)
            end = span.end_s
    return total


def _ranges(spans: list[Span]) -> list[tuple[float, float]]:
    """broken_barh's (start, width) in ms."""
    return [(s.start_s * 1000, (s.end_s - s.start_s) * 1000) for s in spans]


def _kind(span: Span) -> str:
    return span.kind if span.kind in KIND_COLORS else "other"


def _title(pictures: list[StepPicture]) -> str:
    """Which step: one for all ranks, or each rank's (each rank's median step can differ)."""
    by_step: dict[int, list[int]] = {}
    for p in pictures:
        by_step.setdefault(p.step, []).append(p.rank)
    ranks = f"{len(pictures)} rank{'s' * (len(pictures) > 1)}"
    if len(by_step) == 1:
        return f"Step {pictures[0].step} on {ranks}"
    return f"One step per rank ({ranks}): " + "; ".join(
        f"step {step} on rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}"
        for step, r in sorted(by_step.items())
    )
