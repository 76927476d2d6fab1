"""W&B logging, read back from the offline run files: every step, the config, groups, resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import check_ok, train
from wandb_files import offline_runs

from fsdp_lab.observe.run_logs import read_metrics

pytestmark = pytest.mark.slow  # runs of train.py: make test, not make test-fast

OFFLINE = ("hardware=cpu", "logger.wandb.mode=offline", "trainer.eval_every=3", "checkpoint=none")


@pytest.mark.slow
def test_an_offline_run_logs_every_step_its_config_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    check_ok(train(run_dir, *OFFLINE, "trainer.max_steps=6", "sharding=grad_op"))
    facts = json.loads((run_dir / "run.json").read_text())
    [run] = offline_runs(run_dir)  # the W&B files live in the run dir
    assert (
        run.run_id == facts["trackers"]["wandb"]["id"]
        and facts["trackers"]["wandb"]["mode"] == "offline"
    )
    assert (run.project, run.job_type, run.group) == ("fsdp_lab", "train", "")
    assert (
        run.name == "trainer.progress_bar=false,hardware=cpu,logger.wandb.mode=offline,"
        "trainer.eval_every=3,checkpoint=none,trainer.max_steps=6,sharding=grad_op"
    )
    assert "sharding=grad_op" in run.tags and "model=llama_tiny" in run.tags
    # The fully resolved config, flat, with the chosen options and the system's facts.
    assert run.config["sharding.strategy"] == "grad_op"
    assert run.config["options.sharding"] == "grad_op"
    assert run.config["trainer.max_steps"] == 6 and run.config["optim.lr"] == 0.003
    assert run.config["system.world_size"] == 2 and run.config["system.mesh_shape"] == [2]
    assert run.config["system.torch"] == facts["torch"]
    assert run.config["system.transformers"] == facts["transformers"]
    # Every step, as metrics.jsonl has it; validation at 0, 3 and 6.
    train_rows = {h["_step"]: h for h in run.history if "train/loss" in h}
    want = read_metrics(run_dir / "metrics.jsonl")
    assert sorted(train_rows) == [r["step"] for r in want] == [1, 2, 3, 4, 5, 6]
    for record in want:
        row = train_rows[record["step"]]
        for key in (
            "loss",
            "grad_norm",
            "lr",
            "tokens_per_s",
            "tokens_per_s_per_rank",
            "step_time_s",
            "tflops_per_s_per_rank",
        ):
            assert row[f"train/{key}"] == record[key], key
        assert row["train/peak_mem_gib"] == max(record["peak_mem_bytes_per_rank"]) / 2**30
        assert "train/mfu" not in row  # no known peak FLOP/s for a CPU
    val = {h["_step"]: h["val/loss"] for h in run.history if "val/loss" in h}
    assert val == {r["step"]: r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl", "val")}
    assert sorted(val) == [0, 3, 6]
    s = run.summary
    assert s["status"] == "completed" and s["final_loss"] == want[-1]["loss"]
    assert s["best_val_loss"] == min(val.values()) and s["total_time_s"] > 0
    assert s["train/loss"] == {"min": min(r["loss"] for r in want), "last": want[-1]["loss"]}
    assert run.exit_code == 0


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run_without_repeating_steps(tmp_path):
    run_dir = tmp_path / "run"
    common = (
        "hardware=cpu",
        "logger.wandb.mode=offline",
        "trainer.eval_every=0",
        "checkpoint.every_n_steps=2",
    )
    check_ok(train(run_dir, *common, "trainer.max_steps=6"))
    first_id = json.loads((run_dir / "run.json").read_text())["trackers"]["wandb"]["id"]
    # A crash after step 6 whose last complete checkpoint is step 4: steps 5 and 6 run again,
    # but W&B already has them.
    shutil.rmtree(run_dir / "checkpoints" / "step_00000006")
    check_ok(train(run_dir, *common, "trainer.max_steps=8"))
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["trackers"]["wandb"]["id"] == first_id and facts["start_step"] == 4
    runs = offline_runs(run_dir)
    assert [r.run_id for r in runs] == [first_id, first_id]
    steps = [h["_step"] for r in runs for h in r.history if "train/loss" in h]
    assert steps == list(range(1, 9))  # every step once
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, 9))


@pytest.mark.slow
def test_a_sweep_is_one_wandb_group_with_a_run_per_job(shared_sweep):
    sweep, proc = shared_sweep
    runs = [offline_runs(sweep / str(n))[0] for n in range(4)]
    assert {r.group for r in runs} == {"/".join(sweep.parts[-2:])}
    assert {r.job_type for r in runs} == {"sweep"}
    assert [(r.config["options.sharding"], r.config["options.precision"]) for r in runs] == [
        ("full", "fp32"),
        ("full", "bf16"),
        ("grad_op", "fp32"),
        ("grad_op", "bf16"),
    ]
    assert len({r.run_id for r in runs}) == 4
    job = json.loads((sweep / "2" / "run.json").read_text())["job"]
    assert job["num"] == 2 and job["choices"]["sharding"] == "grad_op"
    assert job["sweep_dir"] == str(sweep)
    # The sweep's report is written when the last job ends.
    assert f"sweep report: {sweep / 'report.md'}" in proc.stderr
    assert "| 3 | grad_op | bf16 | completed |" in (sweep / "report.md").read_text()


@pytest.mark.slow
def test_an_unreachable_wandb_server_turns_into_offline_logging(tmp_path):
    run_dir = tmp_path / "run"
    env = {"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9"}
    proc = train(
        run_dir,
        "hardware=cpu",
        "trainer.max_steps=3",
        "checkpoint=none",
        "logger.wandb.mode=online",
        "logger.wandb.init_timeout_s=5",
        env=env,
    )
    check_ok(proc)
    assert "W&B online start failed" in proc.stderr and "logging offline instead" in proc.stderr
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["status"] == "completed" and facts["trackers"]["wandb"]["mode"] == "offline"
    [run] = offline_runs(run_dir)
    assert run.run_id == facts["trackers"]["wandb"]["id"]
    assert [h["_step"] for h in run.history if "train/loss" in h] == [1, 2, 3]
    assert "k" * 40 not in "".join(
        p.read_text(errors="ignore") for p in Path(run_dir).rglob("*") if p.is_file()
    )
