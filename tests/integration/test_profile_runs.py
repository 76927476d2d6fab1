"""profile=trace on real 2-rank gloo runs: `train.py -m sharding=full,no_shard profile=trace`,
as the issue's user runs it, then its traces, run.json, metrics.jsonl, W&B's artifact,
`fsdp-lab profile` and the sweep report."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from conftest import check_ok, run_python
from report_files import assert_png, read_table
from wandb_files import records

from fsdp_lab.observe.run_logs import read_metrics

pytestmark = pytest.mark.slow

PROFILED = [5, 6, 7]  # profile=trace's defaults: 3 steps waited, 1 warmed up, 3 recorded


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("profile") / "sweep"
    proc = run_python(
        [
            "train.py",
            "-m",
            f"hydra.sweep.dir={out}",
            "sharding=full,no_shard",
            "profile=trace",
            "debug=smoke",
            "trainer.max_steps=8",
            "logger=wandb",
            "logger.wandb.mode=offline",
        ],
        timeout=600,
    )
    check_ok(proc)
    return out


def profile_of(job: Path) -> dict:
    return json.loads((job / "run.json").read_text())["profile"]


def test_each_rank_leaves_a_trace_a_viewer_opens(sweep):
    for job in ("0", "1"):
        for rank in (0, 1):
            with gzip.open(sweep / job / "profile" / f"rank{rank}.trace.json.gz", "rt") as f:
                events = json.load(f)["traceEvents"]
            names = {e.get("name") for e in events}
            assert {"fsdp_lab::step 5", "fsdp_lab::step 7"} <= names


def test_full_sharding_all_gathers_per_unit_and_no_shard_only_all_reduces(sweep):
    full, replicated = profile_of(sweep / "0"), profile_of(sweep / "1")
    units = {"root", "model.layers.0", "model.layers.1"}
    gathered = {u["unit"] for u in full["units"] if u["kind"] == "all_gather"}
    assert gathered == units
    assert {u["unit"] for u in full["units"] if u["kind"] == "reduce_scatter"} == units
    assert not [u for u in replicated["units"] if u["kind"] in ("all_gather", "reduce_scatter")]
    assert {u["unit"] for u in replicated["units"] if u["kind"] == "all_reduce"} >= units


def test_the_step_splits_into_compute_exposed_comm_and_idle(sweep):
    for job in ("0", "1"):
        section = profile_of(sweep / job)
        assert section["steps"] == PROFILED and section["ranks"] == [0, 1]
        assert section["device"] == "cpu" and 0 < section["analysis_s"] < 30
        for rank in section["per_rank"]:
            for s in rank["steps"]:
                assert s["comm_s"] > 0 and 0 <= s["exposed_comm_s"] <= s["comm_s"] + 1e-12
                split = s["compute_s"] + s["exposed_comm_s"] + s["idle_s"]
                assert split == pytest.approx(s["step_s"], rel=1e-9)
                idle = s["idle_host_s"] + s["idle_data_s"] + s["idle_optimizer_s"]
                assert idle == pytest.approx(s["idle_s"], rel=1e-9, abs=1e-12)
        # Rank 0's profiled steps are the steps metrics.jsonl timed (the profiler's own cost
        # is in both).
        timed = {r["step"]: r["step_time_s"] for r in read_metrics(sweep / job / "metrics.jsonl")}
        for s in section["per_rank"][0]["steps"]:
            assert s["step_s"] == pytest.approx(timed[s["step"]], rel=0.15, abs=0.003)


def test_the_window_is_a_metrics_record_and_a_wandb_artifact(sweep):
    job = sweep / "0"
    (record,) = read_metrics(job / "metrics.jsonl", "profile")
    summary = profile_of(job)["summary"]
    assert record["step"] == 7 and record["steps"] == PROFILED
    assert record["exposed_comm_share"] == summary["exposed_comm_share"]
    (wandb_file,) = job.glob("wandb/offline-run-*/run-*.wandb")
    kinds = [r.WhichOneof("record_type") for r in records(wandb_file)]
    artifacts = [
        r.artifact for r in records(wandb_file) if r.WhichOneof("record_type") == "artifact"
    ]
    assert "history" in kinds and len(artifacts) == 1
    files = {entry.path for entry in artifacts[0].manifest.contents}
    assert {"run.json", "profile/rank0.trace.json.gz", "profile/rank1.trace.json.gz"} <= files


def test_fsdp_lab_profile_reads_the_same_numbers_from_the_traces(sweep):
    job = sweep / "0"
    proc = run_python(["-m", "fsdp_lab.tools.cli", "profile", str(job), "--json"])
    check_ok(proc)
    again, stored = json.loads(proc.stdout), profile_of(job)
    for key in ("steps", "ranks", "summary", "units", "per_rank"):
        assert again[key] == stored[key], key
    table = run_python(["-m", "fsdp_lab.tools.cli", "profile", str(job)])
    check_ok(table)
    mean = next(line for line in table.stdout.splitlines() if line.startswith("mean"))
    assert f"{stored['summary']['exposed_comm_s'] * 1000:.2f}" in mean.split()
    assert "model.layers.1" in table.stdout


def test_the_sweep_report_explains_itself(sweep):
    header, rows = read_table(sweep / "report.md")  # written by the sweep's callback
    assert {"compute", "comm", "exposed comm", "idle"} <= set(header)
    assert {"predicted (ms)", "measured / predicted", "departs"} <= set(header)
    for row in rows:
        summary = profile_of(sweep / row["job"])["summary"]
        assert row["exposed comm"] == f"{summary['exposed_comm_share']:.0%}"
        # each job's run.json holds the time model's step beside the measured one and split
        predicted = json.loads((sweep / row["job"] / "run.json").read_text())["predicted"]
        assert row["predicted (ms)"] == f"{predicted['step_s'] * 1000:.1f}"
        assert predicted["measured_split"]["exposed_comm_s"] == summary["exposed_comm_s"]
        assert row["departs"] == predicted["departs"] != ""
    assert_png(sweep / "step_breakdown.png")
    assert "step_breakdown.png" in (sweep / "report.md").read_text()


def test_calibrate_from_runs_learns_from_the_traced_runs(sweep, tmp_path):
    out = tmp_path / "learned.json"
    jobs = [str(sweep / "0"), str(sweep / "1")]
    proc = run_python(["-m", "fsdp_lab.tools.cli", "calibrate", "--from-runs", *jobs,
                       "--device", "cpu", "--out", str(out)])  # fmt: skip
    check_ok(proc)
    learned = json.loads(out.read_text())["learned"]
    assert learned["runs"] == jobs and learned["compute_scale"] > 0 and learned["host_s"] >= 0
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith(f"{jobs[0]}: measured ") and " -> " in lines[0]
    assert lines[-1].startswith("learned from 2 runs: kernels ")
    again = run_python(["-m", "fsdp_lab.tools.cli", "calibrate", "--from-runs", *jobs,
                        "--device", "cpu", "--out", str(out)])  # fmt: skip
    assert again.returncode == 2 and "exists: give a new path" in again.stderr
