"""`fsdp-lab report` on jobs run with profile=trace: the profile's columns, and the step
breakdown plot, only where a job has a profile section in its run.json."""

from __future__ import annotations

from pathlib import Path

from report_files import assert_png, read_table
from test_report import write_job

from fsdp_lab.observe.profile.result import ProfileResult, RankProfile, StepBreakdown
from fsdp_lab.tools.report import write_report

PROFILE_COLUMNS = ["compute", "comm", "exposed comm", "idle"]


def breakdown(step: int, compute: float, comm: float, exposed: float) -> StepBreakdown:
    """A 200 ms step: idle is what compute and exposed comm leave of it."""
    idle = 0.2 - compute - exposed
    return StepBreakdown(step, 0.2, compute, comm, exposed, idle, idle, 0.0, 0.0)


def profile_section() -> dict:
    """Two ranks, two steps each. Their mean: compute 110 ms (55%), comm 70 ms (35%), exposed
    30 ms (15%), idle 60 ms (30%) of a 200 ms step."""
    ranks = [
        RankProfile(0, "cpu", "profile/rank0.json", [breakdown(3, 0.1, 0.08, 0.04)] * 2),
        RankProfile(1, "cpu", "profile/rank1.json", [breakdown(3, 0.12, 0.06, 0.02)] * 2),
    ]
    return {**ProfileResult(ranks, analysis_s=0.5).as_dict(), "window": [3, 4]}


def test_profiled_jobs_get_their_shares_and_a_step_breakdown(tmp_path: Path):
    write_job(tmp_path, 0, overrides=("profile=trace",), steps=4, profile=profile_section())
    write_job(tmp_path, 1, overrides=("profile=none",), steps=4)
    write_job(tmp_path, 2, overrides=("profile=broken",), steps=4, profile={"per_rank": [{}]})
    paths = write_report(tmp_path)
    assert [p.name for p in paths] == [
        "report.md",
        "throughput_vs_memory.png",
        "loss_curves.png",
        "step_breakdown.png",
    ]
    header, rows = read_table(paths[0])
    assert header[-4:] == PROFILE_COLUMNS
    assert [rows[0][c] for c in PROFILE_COLUMNS] == ["55%", "35%", "15%", "30%"]
    # not profiled, or a profile section the report cannot read: the row, without figures
    for row in rows[1:]:
        assert [row[c] for c in PROFILE_COLUMNS] == ["-"] * 4
        assert row["tokens/s"] == "3,000"
    text = paths[0].read_text()
    assert "![step breakdown](step_breakdown.png)" in text
    assert "mean over the profiled window's steps and ranks" in text
    assert_png(paths[-1])


def test_a_sweep_without_profiles_has_no_profile_columns_or_plot(tmp_path: Path):
    write_job(tmp_path, 0, overrides=("sharding=full",), steps=2)
    write_job(tmp_path, 1, overrides=("sharding=grad_op",), steps=2, profile=None)
    paths = write_report(tmp_path)
    assert [p.name for p in paths] == ["report.md", "throughput_vs_memory.png", "loss_curves.png"]
    header, _ = read_table(paths[0])
    assert not set(PROFILE_COLUMNS) & set(header)
    assert "step_breakdown" not in paths[0].read_text()
    assert not (tmp_path / "step_breakdown.png").exists()
