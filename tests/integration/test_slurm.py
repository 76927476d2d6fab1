"""SLURM: srun tasks as ranks (unit), and sbatch jobs on a real single-node SLURM (slow)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, SHARED_RUNS, check_ok
from wandb_files import offline_runs

from fsdp_lab.observe.run_logs import read_metrics

pytestmark = pytest.mark.slow  # runs of train.py: make test, not make test-fast


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["hardware=auto"], "set hardware=gpu or hardware=cpu"),
        (["hardware=gpu"], "set hardware.nproc_per_node to the GPUs per node"),
        (["hardware=cpu", "hardware.partition=nope"], "hardware.partition=nope is not a partition"),
    ],
)
def test_a_slurm_sweep_that_cannot_be_sized_is_one_line_before_submitting(
    slurm_cluster, tmp_path, overrides, fragment
):
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "-m",
            "hydra/launcher=slurm",
            f"hydra.sweep.dir={tmp_path / 'sweep'}",
            *overrides,
        ],
        cwd=ROOT,
        env=slurm_cluster,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and fragment in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "sweep" / ".submitit").exists()  # nothing was submitted


# --- a real single-node SLURM (scripts/ci/slurm_up.sh) ------------------------------------------


@pytest.fixture(scope="module")
def slurm_cluster(tmp_path_factory):
    """Start a localhost SLURM for this module (installing it with apt if needed), stop it
    after. Where it cannot be had, the tests skip and say so loudly."""
    prefix = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(
        ["bash", str(ROOT / "scripts/ci/slurm_up.sh"), str(prefix)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if up.returncode != 0:
        message = (
            f"SLURM TESTS SKIPPED: scripts/ci/slurm_up.sh could not start a local SLURM: "
            f"{(up.stderr.strip().splitlines() or ['no output'])[-1]}"
        )
        print(f"\n{'!' * 20} {message}", file=sys.stderr)
        pytest.skip(message)
    conf = up.stdout.strip().splitlines()[-1].removeprefix("export SLURM_CONF=")
    env = {
        **os.environ,
        "SLURM_CONF": conf,
        "FSDP_LAB_ROOT": str(ROOT),
        "FSDP_LAB_PYTHON": sys.executable,
        "HF_HUB_OFFLINE": "1",
    }
    yield env
    subprocess.run(
        ["bash", str(ROOT / "scripts/ci/slurm_down.sh"), str(prefix)],
        capture_output=True,
        text=True,
        timeout=120,
    )


def sbatch(env: dict, cwd: Path, *args: str) -> str:
    proc = subprocess.run(
        ["sbatch", "--parsable", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


# squeue reasons that mean the job cannot run on this cluster as configured.
NEVER_STARTS = {"PartitionConfig", "PartitionNodeLimit", "BadConstraints", "ReqNodeNotAvail"}


def wait_gone(env: dict, job: str, timeout: float = 600) -> None:
    """Poll squeue until the job (and any requeue of it) has left the queue. A job pending for
    a reason that no wait ends (a node too small for it: PartitionConfig...) fails at once,
    with SLURM's reason, instead of after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(
            ["squeue", "-h", "-j", job, "-o", "%T %r"], env=env, capture_output=True, text=True
        ).stdout
        if not out.strip():
            return
        state, _, reason = out.strip().splitlines()[0].partition(" ")
        if state == "PENDING" and reason in NEVER_STARTS:
            subprocess.run(["scancel", job], env=env, capture_output=True)
            raise AssertionError(
                f"job {job} can never start: SLURM says {reason} "
                "(sinfo -N -o '%N %c' shows the node's CPUs)"
            )
        time.sleep(1)
    raise AssertionError(f"job {job} still queued after {timeout} s")


SCRIPT = str(ROOT / "scripts/slurm/train.sbatch")
COMMON = ("hardware=cpu", "trainer.progress_bar=false", "checkpoint.every_n_steps=0")


@pytest.mark.slow
def test_an_sbatch_job_trains_on_two_srun_ranks_in_its_job_run_dir(slurm_cluster, tmp_path):
    job = sbatch(
        slurm_cluster,
        tmp_path,
        "--ntasks=2",
        SCRIPT,
        *COMMON,
        "trainer.max_steps=4",
        "sharding=grad_op",
        "parallel.tensor=2",  # the srun ranks form a TP group (SLURM + TP, issue 16)
    )
    wait_gone(slurm_cluster, job)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    run_dir = tmp_path / "outputs" / "slurm" / job
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["status"] == "completed", out
    assert facts["world_size"] == 2
    assert dict(zip(facts["mesh_axes"], facts["mesh_shape"], strict=True)) == {"shard": 1, "tp": 2}
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4]
    assert f"job {job} (restart 0) on localhost: 2 ranks" in out
    # Only the job's run dir: no rank made a timestamped one.
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["slurm"]


@pytest.mark.slow
def test_usr1_checkpoints_requeues_and_resumes_to_an_uninterrupted_runs_loss(
    slurm_cluster, shared_run, tmp_path
):
    steps = 150
    overrides = tuple(dict.fromkeys((*COMMON, *SHARED_RUNS["long"], "logger.wandb.mode=offline")))
    straight = shared_run("long")  # the same numbers, run locally
    job = sbatch(slurm_cluster, tmp_path, "--ntasks=2", SCRIPT, *overrides)
    run_dir = tmp_path / "outputs" / "slurm" / job
    deadline = time.monotonic() + 300
    while not (
        (run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir / "metrics.jsonl")) >= 5
    ):
        assert time.monotonic() < deadline, "training did not start"
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm_cluster, check=True)
    wait_gone(slurm_cluster, job)
    out = (tmp_path / f"slurm-{job}.out").read_text()
    assert "preempted; requeueing job" in out and f"job {job} (restart 1)" in out, out
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["status"] == "completed" and 5 <= facts["start_step"] < steps, out
    got = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, steps + 1))  # no step twice
    want = read_metrics(straight / "metrics.jsonl")
    assert got[-1]["loss"] == want[-1]["loss"]
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    runs = offline_runs(run_dir)  # the requeued job continued the same W&B run
    assert len(runs) == 2 and runs[0].run_id == runs[1].run_id == facts["trackers"]["wandb"]["id"]


def _slurm_sweep(env: dict, sweep: Path, *overrides: str) -> subprocess.CompletedProcess:
    """train.py's jobs (or trials) as SLURM jobs through submitit, CPU ranks, no checkpoints;
    flags (-m) go first, before the overrides, as argparse wants them."""
    flags = [o for o in overrides if o.startswith("-")]
    return subprocess.run(
        [
            sys.executable,
            "train.py",
            *flags,
            "hydra/launcher=slurm",
            f"hydra.sweep.dir={sweep}",
            "hardware=cpu",
            "trainer.progress_bar=false",
            "checkpoint=none",
            *(o for o in overrides if o not in flags),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_a_submitit_sweep_runs_one_slurm_job_per_sweep_job(slurm_cluster, tmp_path):
    sweep = tmp_path / "sweep"
    check_ok(
        _slurm_sweep(slurm_cluster, sweep, "-m", "trainer.max_steps=3", "sharding=full,no_shard")
    )
    for num, strategy in enumerate(["full", "no_shard"]):
        facts = json.loads((sweep / str(num) / "run.json").read_text())
        assert facts["status"] == "completed", facts.get("error")
        assert facts["world_size"] == 2 and facts["job"]["choices"]["sharding"] == strategy
        assert [r["step"] for r in read_metrics(sweep / str(num) / "metrics.jsonl")] == [1, 2, 3]
    jobs = [p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name)]
    assert len(jobs) == 2, jobs  # one SLURM job (a task of one array) per sweep job
    assert "| 1 | no_shard | completed |" in (sweep / "report.md").read_text()


@pytest.mark.slow
def test_an_optuna_study_runs_its_trials_as_slurm_jobs_in_batches(slurm_cluster, tmp_path):
    sweep = tmp_path / "study"
    proc = _slurm_sweep(
        slurm_cluster,
        sweep,
        "hparams_search=lr",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",  # one batch of two SLURM jobs
        "trainer.max_steps=2",
        "trainer.eval_every=2",
    )
    check_ok(proc)
    study = json.loads((sweep / "study.json").read_text())
    assert [t["state"] for t in study["trials"]] == ["COMPLETE", "COMPLETE"]
    for trial in study["trials"]:
        facts = json.loads((sweep / str(trial["number"]) / "run.json").read_text())
        assert facts["world_size"] == 2 and facts["final_val_loss"] == trial["value"]
    jobs = [p.name for p in (sweep / ".submitit").iterdir() if re.fullmatch(r"\d+_\d+", p.name)]
    assert len(jobs) == 2, jobs


@pytest.mark.slow
def test_submitits_time_limit_signal_checkpoints_requeues_and_resumes(
    slurm_cluster, shared_run, tmp_path
):
    steps, sweep = 150, tmp_path / "sweep"
    overrides = ("trainer.progress_bar=false", *SHARED_RUNS["long"])
    straight = shared_run("long")  # the same numbers, run locally
    proc = subprocess.Popen(
        [
            sys.executable,
            "train.py",
            "-m",
            "hydra/launcher=slurm",
            f"hydra.sweep.dir={sweep}",
            *overrides,
        ],
        cwd=ROOT,
        env=slurm_cluster,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    run_dir, deadline = sweep / "0", time.monotonic() + 300
    while not (
        (run_dir / "metrics.jsonl").is_file() and len(read_metrics(run_dir / "metrics.jsonl")) >= 5
    ):
        assert time.monotonic() < deadline and proc.poll() is None, "training did not start"
        time.sleep(0.2)
    job = json.loads((run_dir / "run.json").read_text())
    squeue = subprocess.run(
        ["squeue", "-h", "-o", "%i"], env=slurm_cluster, capture_output=True, text=True
    ).stdout.split()
    assert len(squeue) == 1, squeue
    # What submitit's sbatch asks for before the time limit (--signal=USR2@...): to every task.
    subprocess.run(["scancel", "--signal=USR2", squeue[0]], env=slurm_cluster, check=True)
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["status"] == "completed" and 5 <= facts["start_step"] < steps
    assert facts["job"] == job["job"]
    got = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in read_metrics(straight / "metrics.jsonl")]
