"""profile/timeline.png from hand-made step pictures: lanes, unit labels, the exposed parts."""

from __future__ import annotations

from pathlib import Path

from matplotlib.image import imread

from fsdp_lab.observe.profile.picture import (
    MAX_RANKS,
    build_timeline,
    draw_timeline,
    short_unit_names,
    union_s,
)
from fsdp_lab.observe.profile.result import Span, StepPicture


def picture(rank: int, step: int) -> StepPicture:
    """A 100 ms step: compute 0-40 and 60-95 ms; layers.7's all-gather 30-55 ms, of which 40-55
    is exposed, overlapping a narrow (0.5 ms) reduce-scatter of layers.6; the root's all-reduce
    90-99 ms, exposed 95-99 ms; an exposed part counted once where two overlap."""
    ms = 1e-3
    compute = [Span(0, 40 * ms, "compute"), Span(60 * ms, 95 * ms, "compute")]
    comm = [
        Span(30 * ms, 55 * ms, "all_gather", "model.layers.7"),
        Span(50 * ms, 50.5 * ms, "reduce_scatter", "model.layers.6"),
        Span(90 * ms, 99 * ms, "all_reduce", "root"),
    ]
    exposed = [
        Span(40 * ms, 55 * ms, "all_gather", "model.layers.7"),
        Span(50 * ms, 50.5 * ms, "reduce_scatter", "model.layers.6"),
        Span(95 * ms, 99 * ms, "all_reduce", "root"),
    ]
    return StepPicture(rank, step, 100 * ms, compute, comm, exposed)


def by_gid(artists, gid: str) -> list:
    return [a for a in artists if a.get_gid() == gid]


def test_each_rank_has_its_lanes_labels_and_exposed_parts():
    fig = build_timeline([picture(1, 6), picture(0, 5)])
    axes = fig.axes
    assert len(axes) == 2
    # rank order, each row's step time and exposed share (40-55 and 95-99 ms: 19 of 100 ms)
    assert axes[0].get_title(loc="left") == "rank 0, step 5: 100.0 ms, exposed comm 19.0 ms (19%)"
    assert axes[1].get_title(loc="left").startswith("rank 1, step 6:")
    assert fig.get_suptitle() == "One step per rank (2 ranks): step 5 on rank 0; step 6 on rank 1"
    for ax in axes:
        labels = [t.get_text() for t in by_gid(ax.texts, "unit-label")]
        assert labels == ["layers.7", "root"]  # layers.6's 0.5 ms span is too narrow for "6"
        (exposed,) = by_gid(ax.collections, "exposed")
        assert len(exposed.get_paths()) == 3
        (outline,) = by_gid(ax.collections, "exposed-outline")
        assert outline.get_hatch() == "////"
        kinds = {c.get_gid() for c in ax.collections if c.get_gid().startswith("comm:")}
        assert kinds == {"comm:all_gather", "comm:reduce_scatter", "comm:all_reduce"}
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[0] == "compute" and legend[-1].startswith("exposed")
    assert "all-gather" in legend and "other" not in legend


def test_the_png_is_written_and_readable(tmp_path: Path):
    path = draw_timeline([picture(0, 5), picture(1, 5)], tmp_path / "profile" / "timeline.png")
    height, width, _ = imread(path).shape
    assert width > 1000 and height > 200
    assert not list(path.parent.glob(".*.tmp"))


def test_no_picture_is_said_so(tmp_path: Path):
    fig = build_timeline([])
    assert [t.get_text() for t in fig.axes[0].texts] == ["no profiled step"]
    height, width, _ = imread(draw_timeline([], tmp_path / "timeline.png")).shape
    assert height > 50 and width > 100


def test_unit_names_lose_their_shared_prefix_but_not_their_layer():
    names = short_unit_names({"model.layers.7", "model.layers.12", "model.embed_tokens", "root"})
    assert names == {
        "model.layers.7": "layers.7",
        "model.layers.12": "layers.12",
        "model.embed_tokens": "embed_tokens",
        "root": "root",
    }
    assert short_unit_names({"model.model.layers.0", ""}) == {"model.model.layers.0": "layers.0"}
    assert short_unit_names({"transformer.h.3", "lm_head", "other"}) == {
        "transformer.h.3": "transformer.h.3",
        "lm_head": "lm_head",
        "other": "other",
    }


def test_union_counts_overlaps_once():
    spans = [Span(0.0, 2.0, "x"), Span(1.0, 3.0, "x"), Span(5.0, 6.0, "x"), Span(5.5, 5.7, "x")]
    assert union_s(spans) == 4.0
    assert union_s([]) == 0.0


def test_of_many_ranks_the_slowest_are_drawn_and_the_title_says_so():
    pictures = [picture(rank, 5) for rank in range(40)]
    for p in pictures:
        p.step_s *= 1 + (p.rank % 7 == 3)  # ranks 3, 10, 17, 24, 31, 38 are the slow ones
    fig = build_timeline(pictures)
    assert len(fig.axes) == MAX_RANKS
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert all(any(t.startswith(f"rank {r},") for t in titles) for r in (3, 10, 17, 24, 31, 38))
    assert f"(the {MAX_RANKS} slowest of 40 ranks)" in fig._suptitle.get_text()


def test_a_gpu_steps_compute_lane_is_coloured_by_kernel_kind():
    from test_profile_analysis import H100_TRACE

    from fsdp_lab.observe.profile.analysis import analyse_trace

    step = analyse_trace(H100_TRACE).picture
    kinds = {s.kind for s in step.compute}
    assert {"matmul", "attention", "fused", "optimizer", "copy"} <= kinds
    assert "compute" not in kinds
    # The optimizer step is the step's serial tail, after backward: its last 7% (17 ms).
    optimizer = [s for s in step.compute if s.kind == "optimizer"]
    assert min(s.start_s for s in optimizer) > 0.9 * step.step_s
    assert max(s.end_s for s in optimizer) > 0.99 * step.step_s
    fig = build_timeline([step])
    (ax,) = fig.axes
    assert by_gid(ax.collections, "compute:matmul") and by_gid(ax.collections, "compute:optimizer")
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:3] == ["matmul", "attention", "fused"] and "compute" not in labels
