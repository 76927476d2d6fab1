"""Checkpoints: exact resume, resharding, complete-or-invisible, damage, preemption, export.

Measured on torch 2.13 / CPU, tiny Llama: resuming on the same topology reproduces every later
loss bitwise (|diff| = 0.0); resuming a 2-rank checkpoint on another strategy or world size
differs only by reduction order (<= 3.6e-7).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    SHARED_RUNS,
    check_ok,
    rank_pid,
    run_python,
    start_train,
    train,
    wait_for_steps,
)

from fsdp_lab.observe.run_logs import read_metrics
from fsdp_lab.state import checkpoint as ckpt

pytestmark = pytest.mark.slow  # runs of train.py: make test, not make test-fast

STEPS, HALF = 8, 4


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def ckpt_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / ckpt.step_dir_name(step)


# ---- fast: the on-disk rules, no processes ------------------------------------------------


# ---- slow: real runs --------------------------------------------------------------------


@pytest.fixture
def base_run(shared_run) -> Path:
    """2 ranks, full sharding, 8 steps, a sharded checkpoint every 4."""
    return shared_run("full-2")


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,world",
    [("full", 2), ("grad_op", 2), ("no_shard", 2), ("hybrid", 4), ("hybrid_zero2", 4)],
)
def test_resume_continues_exactly(shared_run, tmp_path, strategy, world):
    """2k steps straight == k steps, then resume from that checkpoint for k more: bitwise."""
    straight, resumed = shared_run(f"{strategy}-{world}"), tmp_path / "resumed"
    check_ok(
        train(resumed, *SHARED_RUNS[f"{strategy}-{world}"], f"resume={ckpt_dir(straight, HALF)}")
    )
    want, got = losses(straight), losses(resumed)
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    assert [got[s] - want[s] for s in got] == [0.0] * HALF
    facts = json.loads((resumed / "run.json").read_text())
    assert facts["start_step"] == HALF and facts["status"] == "completed"


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ("sharding=hybrid", "hardware.nproc_per_node=4", "trainer.micro_batch_size=2"),
        ("sharding=grad_op",),
        ("sharding=no_shard",),
    ],
    ids=["full2-to-hybrid4", "full-to-grad_op", "full-to-no_shard"],
)
def test_resume_reshards_to_another_strategy_or_world_size(base_run, tmp_path, overrides):
    # Same global batch (8 sequences) at either world size, so the losses must agree.
    resumed = tmp_path / "resumed"
    check_ok(
        train(
            resumed,
            "hardware=cpu",
            f"trainer.max_steps={STEPS}",
            f"resume={ckpt_dir(base_run, HALF)}",
            *overrides,
        )
    )
    want, got = losses(base_run), losses(resumed)
    assert sorted(got) == list(range(HALF + 1, STEPS + 1))
    assert max(abs(got[s] - want[s]) for s in got) <= 2e-6


@pytest.mark.slow
def test_full_format_resumes_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = (
        "hardware=cpu",
        "checkpoint=full",
        f"trainer.max_steps={STEPS}",
        f"checkpoint.every_n_steps={HALF}",
    )
    check_ok(train(straight, *common))
    assert {p.name for p in ckpt_dir(straight, HALF).iterdir()} >= {"model.pt", "optim.pt"}
    check_ok(train(resumed, *common, f"resume={ckpt_dir(straight, HALF)}"))
    want, got = losses(straight), losses(resumed)
    assert [got[s] - want[s] for s in got] == [0.0] * HALF


EVERY_2 = (
    "hardware=cpu",
    "trainer.max_steps=8",
    "checkpoint.every_n_steps=2",
    "checkpoint.keep_last=2",
)


@pytest.fixture(scope="module")
def every_2(tmp_path_factory) -> Path:
    """A checkpoint every 2 of 8 steps, the newest 2 kept, saved synchronously."""
    run_dir = tmp_path_factory.mktemp("every_2") / "run"
    check_ok(train(run_dir, *EVERY_2))
    return run_dir


@pytest.mark.slow
def test_retention_keeps_the_newest_complete_checkpoints(every_2):
    root = every_2 / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000006", "step_00000008"]
    assert (root / "latest").read_text() == "step_00000008"


@pytest.mark.slow
def test_async_save_writes_what_sync_writes(every_2, tmp_path):
    background = tmp_path / "async"
    check_ok(train(background, *EVERY_2, "checkpoint.async_enabled=true"))
    assert losses(every_2) == losses(background)
    for step in (6, 8):
        a, b = ckpt_dir(every_2, step), ckpt_dir(background, step)
        files = lambda d: sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())
        assert files(a) == files(b)
    from fsdp_lab.state.export_source import load_checkpoint_weights

    sd_a, _, _ = load_checkpoint_weights(ckpt_dir(every_2, 8))
    sd_b, _, _ = load_checkpoint_weights(ckpt_dir(background, 8))
    assert sd_a.keys() == sd_b.keys()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)


def _bad_resume(run_dir: Path, *overrides: str) -> str:
    proc = train(run_dir, "hardware=cpu", f"trainer.max_steps={STEPS}", *overrides, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("fsdp_lab: error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr
    assert not (run_dir / "logs").exists()  # refused before any rank started
    return errors[0]


@pytest.mark.slow
def test_damaged_or_foreign_checkpoints_fail_before_training(base_run, tmp_path):
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(ckpt_dir(base_run, HALF), damaged)
    shard = damaged / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    error = _bad_resume(tmp_path / "r1", f"resume={damaged}")
    assert "__1_0.distcp has 100 bytes" in error
    shard.unlink()
    assert "__1_0.distcp is missing" in _bad_resume(tmp_path / "r2", f"resume={damaged}")
    error = _bad_resume(
        tmp_path / "r3", f"resume={ckpt_dir(base_run, HALF)}", "model.hidden_size=128"
    )
    assert "of another model" in error and "shape" in error


@pytest.mark.slow
def test_preemption_checkpoints_and_resume_matches_an_uninterrupted_run(shared_run, tmp_path):
    steps = 150  # SHARED_RUNS["long"]
    straight, preempted = shared_run("long"), tmp_path / "preempted"
    proc = start_train(preempted, *SHARED_RUNS["long"])
    wait_for_steps(preempted, 5, proc)
    proc.send_signal(signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr
    assert "preempted (signal 10)" in stderr
    stopped_at = json.loads((preempted / "run.json").read_text())["step"]
    assert 5 <= stopped_at < steps
    assert ckpt.latest_checkpoint(preempted / "checkpoints").name == ckpt.step_dir_name(stopped_at)
    # The same command again continues the same run dir from that checkpoint.
    proc2 = train(preempted, *SHARED_RUNS["long"])
    check_ok(proc2)
    got = read_metrics(preempted / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, steps + 1))  # no step logged twice
    want = losses(straight)
    assert [r["loss"] - want[r["step"]] for r in got] == [0.0] * steps


@pytest.mark.slow
def test_kill_9_of_one_rank_during_save_leaves_the_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    # A larger model makes each save long enough to be caught in the middle.
    medium = (
        "checkpoint.every_n_steps=3",
        "model.hidden_size=256",
        "model.num_layers=4",
        "model.intermediate_size=1024",
        "model.vocab_size=8192",
        "trainer.seq_len=32",
        "trainer.micro_batch_size=1",
    )
    proc = start_train(run_dir, "hardware=cpu", "trainer.max_steps=400", *medium)
    root = run_dir / "checkpoints"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:  # wait for a save in progress after a complete one
            if ckpt.latest_checkpoint(root) is not None and any(root.glob("*.tmp")):
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.002)
        else:
            raise AssertionError("never saw a save in progress")
        os.kill(rank_pid(run_dir, 1), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "rank 1 died (signal 9)" in stderr
    last_good = ckpt.latest_checkpoint(root)
    ckpt.verify(last_good)
    step = json.loads((last_good / ckpt.MARKER).read_text())["step"]
    # resume=auto in the same run dir continues from it (the .tmp leftovers are ignored).
    proc2 = train(run_dir, f"trainer.max_steps={step + 2}", "hardware=cpu", *medium)
    check_ok(proc2)
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["start_step"] == step and facts["step"] == step + 2


@pytest.mark.slow
def test_export_loads_into_transformers_with_the_trained_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    from fsdp_lab.engine.model import build_full_model
    from fsdp_lab.state.export_source import load_checkpoint_weights

    run_dir = tmp_path / "run"
    check_ok(
        train(
            run_dir,
            "hardware=cpu",
            "model=qwen2_tiny",
            "trainer.max_steps=5",
            "checkpoint.export_hf=true",
        )
    )
    hf_dir = run_dir / "hf"
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {
        p.name for p in hf_dir.iterdir()
    }
    cli = run_python(
        ["-m", "fsdp_lab.tools.cli", "export", str(run_dir), str(tmp_path / "cli_export")],
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    # The trained weights as the ranks left them: the final sharded checkpoint, read back.
    sd, hf_config, _ = load_checkpoint_weights(run_dir)
    trained = build_full_model(hf_config, seed=1)
    trained.load_state_dict(sd)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    want = trained.eval()(ids).logits
    for d in (hf_dir, tmp_path / "cli_export"):
        model = AutoModelForCausalLM.from_pretrained(d).eval()
        assert torch.equal(model(ids).logits, want)
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied stays tied
    # The initial weights are not what was exported: training changed them.
    assert not torch.equal(build_full_model(hf_config, seed=0).eval()(ids).logits, want)
    proc = run_python(
        ["-m", "fsdp_lab.tools.cli", "export", str(run_dir), str(hf_dir)], timeout=120
    )
    assert proc.returncode == 2 and "not empty" in proc.stderr  # never overwrites
