"""`fsdp-lab tune`: the plan prunes, probes measure, the winner fits and its command reproduces."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from conftest import ROOT, check_ok

from fsdp_lab.planning import tune, tune_probes

pytestmark = pytest.mark.slow

# Activations grow 32x over the micro-batches: some fit the budget below and some do not.
OVERRIDES = [
    "hardware=cpu",
    "sharding=full",  # held: the other axes vary (4 checkpointing x 6 micro-batches)
    "parallel.tensor=1",  # held too (TP 2 over gloo: tested in the unit grid, slow to probe)
    "model.hidden_size=128",
    "model.intermediate_size=512",
    "model.num_layers=4",
    "trainer.seq_len=256",
    "trainer.max_steps=6",
]


def fsdp_lab(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_lab.tools.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def test_tune_picks_the_fastest_probe_that_fits_and_its_command_reproduces(tmp_path):
    # A budget between the micro-batches: the plan (process baseline + margin) admits
    # micro-batch 8 without checkpointing and drops 16 and 32.
    candidates, device, _ = tune.enumerate_candidates(OVERRIDES, 32)
    baseline = tune.process_baseline_bytes(device)
    by_name = {(c.ac.name, c.micro_batch): c for c in candidates}
    fit = tune_probes.predicted_bytes(by_name["none", 8].plan_peak_bytes, baseline)
    budget_gib = (fit + 24 * tune.MIB) / tune.GIB
    out = tmp_path / "tune"
    proc = fsdp_lab(
        "tune",
        *OVERRIDES,
        "--memory-gib",
        f"{budget_gib:.4f}",
        "--out",
        str(out),
        "--probes",
        "2",
        "--steps",
        "3",
    )
    check_ok(proc)
    record = json.loads((out / "tune.json").read_text())
    rows = {c["name"]: c for c in record["candidates"]}
    assert len(rows) == 24  # 4 checkpointing modes x 6 micro-batches
    assert any(c["verdict"] == "dropped (plan)" for c in rows.values())
    probed = [c for c in rows.values() if c["measured_bytes"] is not None]
    # the two fastest predicted, both measured (one dropped only where the first probe
    # measured more than the baseline guessed); the winner is the measured fastest
    assert 1 <= len(probed) <= 2
    assert all(c["predicted_tokens_per_s"] > 0 for c in probed)
    admitted = [c["prior"] for c in rows.values() if not c["verdict"].startswith("dropped")]
    assert min(c["prior"] for c in probed) == min(admitted)  # the fastest predicted went first
    if len(probed) == 1:
        assert any(c["verdict"] == "dropped (plan + measured baseline)" for c in rows.values())
    assert isinstance(record["order_errors"], list)
    winner = rows[record["winner"]]
    budget = record["budget_bytes"]
    assert winner["verdict"] == "fits" and winner["measured_bytes"] <= budget
    fitting = [c for c in probed if c["verdict"] == "fits"]
    assert all(winner["tokens_per_s"] >= c["tokens_per_s"] for c in fitting)
    for c in probed:  # the plan's margin held: nothing admitted measured over the budget
        assert c["measured_bytes"] <= budget, c

    # The printed command, as is (its output dir pinned outside the repo).
    line = proc.stdout.strip().splitlines()[-1]
    assert line == record["command"] and line.startswith("fsdp-lab train ")
    assert line.endswith(" hardware.malloc_mmap_threshold=131072")
    words = shlex.split(line)
    run_dir = tmp_path / "again"
    again = subprocess.run(  # `fsdp-lab train` is `python -m fsdp_lab`
        [
            sys.executable,
            "-m",
            "fsdp_lab",
            *words[2:],
            f"hydra.run.dir={run_dir}",
            "logger=none",
            "trainer.progress_bar=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    check_ok(again)
    peak = json.loads((run_dir / "run.json").read_text())["peak_mem_bytes"]
    assert abs(peak - winner["measured_bytes"]) <= 0.10 * winner["measured_bytes"]


def test_a_budget_below_anything_is_one_line_and_exit_2(tmp_path):
    proc = fsdp_lab("tune", *OVERRIDES, "--memory-gib", "0.1", "--out", str(tmp_path / "t"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("fsdp-lab: error: nothing fits in 0.1 GiB per rank on 2 rank(s)")
    assert "smallest planned peak is" in line and "more ranks" in line
    assert not (tmp_path / "t").exists()
