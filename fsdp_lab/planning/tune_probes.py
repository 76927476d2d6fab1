"""What `fsdp-lab tune` measures: a rank's memory before its model (the budget's baseline), each
candidate's predicted peak on the budget's basis, a probe's few steps on the real ranks, and the
winner as one `fsdp-lab train` command.
"""

from __future__ import annotations

import functools
import shlex
import subprocess
import sys
from pathlib import Path

from fsdp_lab.config import ConfigError, HardwareKind
from fsdp_lab.config.hardware_kinds import hardware_row
from fsdp_lab.observe import rundir
from fsdp_lab.observe.record import RunResults
from fsdp_lab.planning.tune_grid import Candidate, override_key

GIB, MIB = 2**30, 2**20
# The plan's known error on real ranks (tests/integration/test_plan_runs.py, every preset
# architecture, full/grad_op/no_shard, 2026-11-24): measured peak less the RSS before training
# is 1.00-1.14x the plan's plus 8-25 MiB of the process's own; and a rank's RSS before its
# model (353-356 MiB) is ~60 MiB above the fresh interpreter the baseline measures (296 MiB).
# 1.15 x plan + 96 MiB covers both; a probe that measures more raises the baseline for the rest.
SAFETY, SLACK = 1.15, 96 * MIB
MALLOC_OVERRIDE = "hardware.malloc_mmap_threshold=131072"  # on CPU: RSS that the plan predicts


@functools.cache  # a fresh interpreter's: measured once per process
def process_baseline_bytes(device: HardwareKind) -> int:
    """What a rank holds before any tensor of the model: on CPU, the RSS of a fresh
    interpreter that imported what a rank imports; on GPU 0 (the allocator's peak is the basis)."""
    if not hardware_row(device).host:
        return 0
    code = (
        "import fsdp_lab.train.worker, torch.distributed\n"
        "for line in open('/proc/self/status'):\n"
        "    if line.startswith('VmHWM:'): print(int(line.split()[1]) * 1024)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0 or not proc.stdout.strip():
        raise ConfigError(f"could not measure a rank's baseline memory: {proc.stderr[-300:]}")
    return int(proc.stdout.split()[-1])


def predicted_bytes(plan_peak: int, baseline: int) -> int:
    """A candidate's peak per rank on the budget's basis: the process's own, then the plan's
    tensors with its measured margin."""
    return baseline + int(SAFETY * plan_peak) + SLACK


def predict(candidates: list[Candidate], baseline: int) -> None:
    """Every candidate's predicted peak on this baseline."""
    for c in candidates:
        c.planned_bytes = predicted_bytes(c.plan_peak_bytes, baseline)


def host_overrides(overrides: list[str], device: HardwareKind) -> list[str]:
    """The host allocator's setting the probes and the command run with: on CPU, RSS that the
    plan predicts (unless the overrides set it themselves)."""
    asked = any(override_key(o) == override_key(MALLOC_OVERRIDE) for o in overrides)
    return [MALLOC_OVERRIDE] if hardware_row(device).host and not asked else []


def probe(
    overrides: list[str], c: Candidate, run_dir: Path, *, steps: int, budget: int, host: list[str]
) -> None:
    """A few steps of the candidate on the real ranks: its measured peak per rank, tokens/s
    and a verdict (fits, over budget, OOM, failed)."""
    args = [
        *overrides,
        *c.overrides(),
        *host,
        f"trainer.max_steps={steps}",
        "trainer.eval_every=0",
        "trainer.log_every=1",
        "trainer.progress_bar=false",
        "checkpoint=none",
        "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    c.run_dir = str(run_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_lab", *args],  # train.py's command, from any directory
        capture_output=True,
        text=True,
        check=False,
    )
    record = rundir.read_run_file(run_dir)
    results = record.results or RunResults()
    c.measured_bytes = results.peak_mem_bytes
    c.tokens_per_s = results.median_tokens_per_s
    if proc.returncode == 0:
        fits = c.measured_bytes is not None and c.measured_bytes <= budget
        c.verdict = "fits" if fits else "over budget"
        return
    last = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
    error = str(record.error or last.removeprefix("fsdp_lab: error: "))
    if "out of memory" in error.lower() or proc.returncode in (-9, 137):
        c.verdict = "OOM"
    else:
        c.verdict = f"failed: {error[:120]}"


def command(overrides: list[str], c: Candidate, host: list[str]) -> str:
    """The winner as one ``fsdp-lab train`` command (``python train.py``'s, from any
    directory): the overrides (less the axes it sets), its own, and the host allocator's
    setting the probes ran with."""
    axes = {override_key(o) for o in c.overrides()}
    kept = [o for o in overrides if override_key(o) not in axes]
    words = [*kept, *c.overrides(), *host]  # fsdp-lab train: the same as python train.py, anywhere
    return " ".join(["fsdp-lab", "train", *map(shlex.quote, words)])
