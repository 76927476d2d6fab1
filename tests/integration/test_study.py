"""hydra/sweeper=study: an Optuna search over train.py's runs that records failures, continues
after being killed, and logs every trial to one W&B group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, check_ok, run_python
from wandb_files import offline_runs

pytestmark = pytest.mark.slow

DIVERGES = 1e30  # loss is nan by step 3
LRS = [1e-3, 2e-3, 3e-3, 5e-3, 8e-3, DIVERGES]


def _study_args(sweep: Path) -> list[str]:
    return [
        str(ROOT / "train.py"),
        "-m",  # a range on the command line (hparams_search alone needs no -m)
        "hparams_search=lr",
        f"hydra.sweep.dir={sweep}",
        "hydra.sweeper.sampler=grid",  # the six points below, each once, in a seeded order
        "hydra.sweeper.params=null",  # lr.yaml's space, replaced by one parameter's six points
        f"optim.lr=choice({','.join(map(str, LRS))})",
        "optim.warmup_steps=0",
        "trainer.max_steps=3",
        "trainer.eval_every=3",
        "trainer.progress_bar=false",
        "checkpoint=none",
    ]


def test_a_study_records_a_diverged_trial_and_continues_after_a_kill(tmp_path):
    sweep = tmp_path / "study"
    env = {"WANDB_MODE": "offline"}
    first = subprocess.Popen(
        [sys.executable, *_study_args(sweep)],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while not (sweep / "3" / "run.json").exists():  # trials 0-2 done, trial 3 started
        assert first.poll() is None, first.stderr.read().decode()[-3000:]
        assert time.monotonic() < deadline, "trial 3 did not start in 240 s"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)  # the study process and its ranks, mid-trial
    first.wait()
    done = json.loads((sweep / "study.json").read_text())
    assert [t["number"] for t in done["trials"] if t["state"] != "RUNNING"] == [0, 1, 2]

    proc = run_python(_study_args(sweep), env=env, timeout=300)  # the same sweep dir: continue
    check_ok(proc)
    study = json.loads((sweep / "study.json").read_text())
    trials = {t["number"]: t for t in study["trials"]}
    assert sorted(trials) == list(range(7)), trials.keys()  # 0-2, 3 interrupted, 4-6
    assert trials[3]["state"] == "FAIL" and trials[3]["error"].startswith("interrupted")
    assert trials[4]["params"] == trials[3]["params"]  # the interrupted point ran first
    ran = [t for n, t in trials.items() if n != 3]
    assert sorted(t["params"]["optim.lr"] for t in ran) == sorted(LRS)  # each point once
    (diverged,) = [t for t in ran if t["params"]["optim.lr"] == DIVERGES]
    assert diverged["state"] == "FAIL" and diverged["value"] is None
    assert "loss is nan" in diverged["error"]
    assert all(t["state"] == "COMPLETE" for t in ran if t is not diverged)

    # The best value is the lowest of the trials' recorded validation losses, job dir = trial.
    val = {}
    for n in trials:
        facts = json.loads((sweep / str(n) / "run.json").read_text())
        if facts.get("status") == "completed":
            val[n] = facts["final_val_loss"]
            assert facts["job"]["num"] == n and facts["job"]["study"] == "fsdp_lab"
    assert len(val) == 5
    assert study["best"]["value"] == min(val.values())
    assert study["best"]["trial"] == min(val, key=val.get)
    assert "study fsdp_lab: 7 trials, 2 failed; best val_loss" in proc.stderr  # and exit 0

    runs = [r for n in val for r in offline_runs(sweep / str(n))]
    assert len(runs) == 5 and len({r.group for r in runs}) == 1 and runs[0].group
    assert {r.config["study.trial"] for r in runs} == set(val)
    report = (sweep / "report.md").read_text()
    assert f"best: trial {study['best']['trial']}" in report and "objective (val_loss)" in report


def test_an_objective_against_the_direction_is_one_line_before_any_trial(tmp_path):
    sweep = tmp_path / "study"
    proc = run_python([*_study_args(sweep), "objective=tokens_per_s"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        "error: hydra.sweeper.direction=minimize but objective=tokens_per_s is to maximize"
        in proc.stderr
    )
    assert not (sweep / "0").exists()


def test_two_study_processes_on_one_journal_share_the_study(tmp_path):
    """hydra.sweeper.storage=journal, two train.py started at once on one sweep dir: one study
    of n_trials, each process running a trial of its own (numbered apart, neither taken over
    as interrupted), every job's dir its trial's."""
    import optuna

    from fsdp_lab.launch import study_storage

    sweep = tmp_path / "study"
    args = [
        sys.executable,
        str(ROOT / "train.py"),
        "hparams_search=lr",
        f"hydra.sweep.dir={sweep}",
        "hydra.sweeper.storage=journal",
        "hydra.sweeper.n_trials=2",
        "trainer.max_steps=2",
        "trainer.eval_every=2",
        "trainer.progress_bar=false",
        "hardware.nproc_per_node=1",
        "checkpoint=none",
        "logger=none",
    ]
    procs = [subprocess.Popen(args, cwd=ROOT, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    for proc in procs:
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
    record = json.loads((sweep / "study.json").read_text())
    assert [(t["number"], t["state"]) for t in record["trials"]] == [
        (0, "COMPLETE"),
        (1, "COMPLETE"),
    ]
    for n in (0, 1):
        assert json.loads((sweep / str(n) / "run.json").read_text())["job"]["num"] == n
    storage, _ = study_storage.storage_of("journal", sweep)
    shared = optuna.load_study(study_name="fsdp_lab", storage=storage)
    owners = {int(t.user_attrs["worker"].split(":")[1]) for t in shared.trials}
    assert owners == {p.pid for p in procs}


def agent_command(sweep_yaml: Path, values: dict) -> list[str]:
    """The command a `wandb agent` runs for one trial of sweep_yaml: W&B's own functions and
    the substitution loop of wandb_agent.Agent._command_run (W&B 0.18-0.31)."""
    import yaml
    from wandb.sdk.launch.sweeps import utils as sweep_utils

    spec = yaml.safe_load(sweep_yaml.read_text())
    template = sweep_utils.create_sweep_command(list(spec["command"]))
    sweep_vars = sweep_utils.create_sweep_command_args(
        {"args": {k: {"value": v} for k, v in values.items()}}
    )
    sweep_vars |= {"interpreter": ["python"], "program": [spec["program"]], "env": []}
    command = []
    for chunk in map(str, template):
        if chunk.startswith("${") and chunk.endswith("}"):
            command += sweep_vars.get(chunk[2:-1]) or []
        else:
            command.append(chunk)
    return command


def test_the_wandb_sweep_agents_command_line_runs_train_py(tmp_path):
    """What the agent would run for a trial of scripts/sweeps/wandb.yaml (a W&B server picks the
    values; here, values of each parameter's kind), plus a short max_steps: it trains, and its
    W&B run is the one the agent created (WANDB_RUN_ID)."""
    values = {"optim.lr": 0.00123456789, "optim.warmup_steps": 10, "sharding": "grad_op"}
    command = agent_command(ROOT / "scripts" / "sweeps" / "wandb.yaml", values)
    assert command[:2] == ["python", "train.py"]
    assert command[2:] == [
        "optim.lr=0.00123456789",
        "optim.warmup_steps=10",
        "sharding=grad_op",
        "trainer.max_steps=200",
    ]
    run_dir = tmp_path / "run"
    proc = run_python(
        [
            str(ROOT / command[1]),
            *command[2:],
            f"hydra.run.dir={run_dir}",
            "trainer.max_steps=2",  # after the command's: the last of a key wins
            "trainer.progress_bar=false",
            "checkpoint=none",
        ],
        env={"WANDB_MODE": "offline", "WANDB_RUN_ID": "agent123", "WANDB_SWEEP_ID": "sw1"},
    )
    check_ok(proc)
    (run,) = offline_runs(run_dir)
    assert run.run_id == "agent123"
    assert run.config["optim.lr"] == 0.00123456789 and run.config["sharding.strategy"] == "grad_op"
