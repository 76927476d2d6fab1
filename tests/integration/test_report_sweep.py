"""`fsdp-lab report` over one real sweep, run as a user runs it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from conftest import check_ok
from report_files import assert_png, cli_report, fixed_line, read_table

from fsdp_lab.observe.run_logs import read_metrics
from fsdp_lab.tools.report import write_report

pytestmark = pytest.mark.slow

MIB = 2**20


@pytest.fixture
def real_sweep(shared_sweep) -> Path:
    return shared_sweep[0]


def test_real_sweep_table_matches_the_metrics(real_sweep):
    report = write_report(real_sweep)[0]
    header, rows = read_table(report)
    assert header[:4] == ["job", "sharding", "precision", "status"]
    assert [(r["job"], r["sharding"], r["precision"], r["status"]) for r in rows] == [
        ("0", "full", "fp32", "completed"),
        ("1", "full", "bf16", "completed"),
        ("2", "grad_op", "fp32", "completed"),
        ("3", "grad_op", "bf16", "completed"),
    ]
    fixed = fixed_line(report)
    assert "trainer.max_steps=6" in fixed and "checkpoint=none" in fixed
    assert "model=llama_tiny" in fixed and "sharding" not in fixed and "precision" not in fixed
    for row in rows:
        job_dir = real_sweep / row["job"]
        train = read_metrics(job_dir / "metrics.jsonl")
        val = read_metrics(job_dir / "metrics.jsonl", "val")
        steady = train[1:]  # step 1 is warm-up
        assert row["steps"] == "6"
        assert row["tokens/s"] == f"{statistics.median(r['tokens_per_s'] for r in steady):,.0f}"
        step_ms = statistics.median(r["step_time_s"] for r in steady) * 1000
        assert row["step time (ms)"] == f"{step_ms:.1f}"
        peaks = [max(r["peak_mem_bytes_per_rank"][rank] for r in train) / MIB for rank in range(2)]
        assert row["peak MiB per rank"] == " / ".join(f"{p:.0f}" for p in peaks)
        assert row["peak MiB (max rank)"] == f"{max(peaks):.0f}"
        final_loss = json.loads((job_dir / "run.json").read_text())["final_loss"]
        assert row["final loss"] == f"{train[-1]['loss']:.4f}" == f"{final_loss:.4f}"
        assert row["val loss"] == f"{val[-1]['val_loss']:.4f}" and val[-1]["step"] == 6


def test_real_sweep_plots_and_rerun(real_sweep):
    paths = write_report(real_sweep)
    for path in paths[1:]:
        assert_png(path)
        path.write_bytes(b"stale")
    text = paths[0].read_text()
    proc = cli_report(real_sweep)  # as a user runs it, over the earlier report
    check_ok(proc)
    assert proc.stdout.split() == [str(p) for p in paths]
    assert paths[0].read_text() == text
    for path in paths[1:]:
        assert_png(path)
