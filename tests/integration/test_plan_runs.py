"""fsdp-lab plan against real CPU runs: each rank's state exactly, the step's peak within 5%."""

from __future__ import annotations

import json

import pytest
from conftest import check_ok, train
from plan_cases import MEDIUM, peak_less_params

from fsdp_lab.tools import plan

pytestmark = pytest.mark.slow

# glibc's dynamic mmap threshold keeps freed activation memory in the heap, so the RSS high-water
# mark overstates live tensors up to 2x (measured: 543 MB of RSS for a 263 MB live peak); pinned,
# large tensors are mmapped and returned when freed.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
# Measured peak RSS - RSS before the first step, over the estimate: 1.08-1.09 (fp32; 21 MB over)
# and 1.19 (bf16; 28 MB over). Live tensor bytes are within 0-6% (the fake-group test in
# tests/unit/tools/test_plan.py): the rest is not tensors (oneDNN's bf16 matmul workspaces,
# malloc arenas), listed as not counted.
# So: tensors within 5%, plus up to 48 MiB of the process's own.
RSS_TOLERANCE, RSS_SLACK = 0.05, 48 * 2**20


@pytest.mark.parametrize(
    "overrides",
    [
        ["sharding=full"],
        ["sharding=grad_op"],
        ["sharding=hybrid", "hardware.nproc_per_node=4"],
        ["sharding=full", "precision=bf16"],
        # dp 2 x tp 2 with sequence parallelism: measured 150 MiB over the state against 132
        # planned (1.14; TP's redistribution buffers are not modelled), within the slack
        ["hardware.nproc_per_node=4", "parallel.tensor=2", "parallel.sequence_parallel=true"],
    ],
    ids=["full", "grad_op", "hybrid", "full-bf16", "dp2xtp2-sp"],
)
def test_measured_runs_match_the_plan(run_dir, overrides):
    args = [*MEDIUM, "trainer.max_steps=2", "trainer.eval_every=0", "checkpoint=none", *overrides]
    check_ok(train(run_dir, *args, env=MALLOC_ENV))
    run = json.loads((run_dir / "run.json").read_text())
    expected = plan.build_plan(args)
    s = expected["strategies"][expected["chosen"]]
    assert len(run["state_bytes_per_rank"]) == expected["world_size"]
    for rank, measured in enumerate(run["state_bytes_per_rank"]):
        assert measured == {k: s["per_rank"][rank][k] for k in ("params", "grads", "optimizer")}
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for rank, before in enumerate(run["memory_before_train_bytes_per_rank"]):
        peak = max(r["peak_mem_bytes_per_rank"][rank] for r in steps if r["split"] == "train")
        estimate = peak_less_params(s, rank)
        assert (
            (1 - RSS_TOLERANCE) * estimate
            <= peak - before
            <= (1 + RSS_TOLERANCE) * estimate + RSS_SLACK
        ), (rank, peak - before, estimate)
