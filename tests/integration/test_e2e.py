"""train.py as a user runs it: run dirs, sweeps, torchrun, and bad input that fails at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, check_ok, rank_pid, start_train, train

from fsdp_lab.observe.run_logs import read_metrics

pytestmark = pytest.mark.slow

STEP_KEYS = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "step_time_s",
    "tokens_per_s",
    "trained_tokens",
    "peak_mem_bytes",
    "peak_mem_bytes_per_rank",
}


def test_run_dir_holds_config_logs_and_metrics(run_dir):
    proc = train(run_dir, "trainer.max_steps=5", "hardware=cpu")
    check_ok(proc)
    assert sorted(p.name for p in run_dir.iterdir()) == [
        "checkpoints",
        "config.yaml",
        "logs",
        "metrics.jsonl",
        "run.json",
    ]
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:
        assert r.keys() >= STEP_KEYS
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0
        assert r["trained_tokens"] == 2 * 4 * 63  # 2 ranks x 4 rows x 63 next tokens
        assert len(r["peak_mem_bytes_per_rank"]) == 2
        assert r["peak_mem_bytes"] == max(r["peak_mem_bytes_per_rank"]) > 100 * 2**20
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["status"] == "completed" and facts["backend"] == "gloo"
    assert "max_steps: 5" in (run_dir / "config.yaml").read_text()
    assert "done: step 5/5" in proc.stderr
    assert "rank 1" not in proc.stderr  # only rank 0 talks to the console
    # the run against the time model (steps 2-5 measured, on this machine's measured profile:
    # measured after the run where the cache had none, tests/unit/planning/test_calibrate.py)
    predicted = facts["predicted"]
    assert predicted["device"].startswith("measured (cpu:") and predicted["step_s"] > 0
    assert predicted["device"].endswith(", 2 ranks)")  # the machine's cores: any number
    steady = sorted(r["step_time_s"] for r in records[1:])
    assert predicted["measured_step_s"] == pytest.approx((steady[1] + steady[2]) / 2)
    ratio = predicted["measured_over_predicted"]
    assert f"predicted on {predicted['device']} ({ratio:.2f}x)" in proc.stderr


@pytest.mark.parametrize(
    "first,second",
    [
        (("checkpoint=none",), ()),  # nothing to resume from
        ((), ("resume=never",)),  # a checkpoint, but the user asked for a fresh run
    ],
)
def test_an_existing_run_dir_is_never_overwritten(run_dir, first, second):
    check_ok(train(run_dir, "trainer.max_steps=2", "hardware=cpu", *first))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    proc = train(run_dir, "trainer.max_steps=3", "hardware=cpu", *second)
    assert proc.returncode == 2
    assert "already holds files" in proc.stderr and "hydra.run.dir" in proc.stderr
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_multirun_gives_each_job_its_own_run_dir(shared_sweep):
    sweep, _ = shared_sweep
    jobs = [("full", "fp32"), ("full", "bf16"), ("grad_op", "fp32"), ("grad_op", "bf16")]
    for job, (strategy, precision) in enumerate(jobs):
        assert len(read_metrics(sweep / str(job) / "metrics.jsonl")) == 6
        config = (sweep / str(job) / "config.yaml").read_text()
        assert f"strategy: {strategy}" in config
        assert ("param_dtype: bf16" in config) == (precision == "bf16")
    assert (sweep / "multirun.yaml").is_file()


def test_torchrun_joins_its_group_with_one_run_dir(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "train.py"),
            "trainer.max_steps=3",
            "hardware=cpu",
            "trainer.progress_bar=false",
            "sharding=grad_op",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    check_ok(proc)
    run_dirs = [p.parent for p in (tmp_path / "outputs").rglob("config.yaml")]
    assert len(run_dirs) == 1
    assert len(read_metrics(run_dirs[0] / "metrics.jsonl")) == 3
    # Every rank's Hydra made a dir; only rank 0's remains.
    assert (
        len(
            [
                d
                for d in (tmp_path / "outputs").rglob("*")
                if d.is_dir() and d.name != "logs" and not any(d.iterdir())
            ]
        )
        == 0
    )
    assert json.loads((run_dirs[0] / "run.json").read_text())["world_size"] == 2


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["sharding=hybrid", "hardware.nproc_per_node=2"], "sharding=hybrid on 2 ranks"),
        (["hardware.nproc_per_node=0"], "hardware.nproc_per_node=0"),
        (["trainer.micro_batch_size=0"], "trainer.micro_batch_size=0"),
        (["trainer.seq_len=1024"], "exceeds the model's 256 positions"),
        (["model=local", "model.name_or_path=/nonexistent"], "no config.json"),
        pytest.param(
            ["hardware=gpu"],
            "CUDA is not available",
            marks=pytest.mark.skipif(
                __import__("torch").cuda.is_available(), reason="this machine has CUDA"
            ),
        ),
        (["wrap.classes=[Block]"], "its module classes are"),
        (["data=text", "data.files=[/nonexistent/*.jsonl]"], "matches no file"),
        (["data=shakespeare", "data.text_column=body"], "data.text_column='body' is not a column"),
        (["data=shakespeare", "trainer.seq_len=512"], "exceeds the model's 256 positions"),
        (["data=shakespeare", "model.vocab_size=256"], "the tokenizer has 259 tokens"),
        (["data=hub", "data.name=roneneldan/TinyStories"], "the hub is unreachable offline"),
        (["model=local", "model.name_or_path=HuggingFaceTB/SmolLM2-135M"], "not a local directory"),
        (["model=llama_tiny", "model.pretrained=true"], "needs model.name_or_path"),
        (["model=bert_tiny", "model.task=causal_lm"], "model.task=causal_lm does not fit"),
        (["model.num_experts=8"], "model.num_experts=8 but model.arch=llama is dense"),
        (["model=mixtral_tiny", "model.experts_per_token=9"], "model.experts_per_token=9"),
    ],
)
def test_bad_input_fails_in_the_parent_with_one_line(run_dir, overrides, fragment):
    proc = train(run_dir, *overrides, timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fsdp_lab: error:")]
    assert len(errors) == 1 and fragment in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (run_dir / "logs").exists()  # no worker started


def test_unknown_group_option_lists_the_valid_ones(run_dir):
    proc = train(run_dir, "sharding=zero3", timeout=120)
    assert proc.returncode != 0
    assert "Available options in 'sharding'" in proc.stderr
    assert "hybrid_zero2" in proc.stderr


def test_a_failing_worker_fails_the_run_and_is_reported_once(run_dir):
    proc = train(
        run_dir,
        "hardware=cpu",
        "optim.lr=1e6",
        "optim.grad_clip=null",
        "optim.warmup_steps=0",
        "trainer.max_steps=50",
    )
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fsdp_lab: error:")]
    assert len(errors) == 1 and "FloatingPointError: loss is nan" in errors[0]
    assert "Traceback" not in proc.stderr  # the traceback is in the rank's log
    assert "Traceback" in (run_dir / "logs" / "rank0.log").read_text()
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["status"] == "failed" and "loss is nan" in facts["error"]


def test_a_killed_rank_fails_the_run_fast_and_is_named(run_dir):
    proc = start_train(run_dir, "hardware=cpu", "trainer.max_steps=100000")
    try:
        pid = rank_pid(run_dir, 1)
        while not (run_dir / "metrics.jsonl").is_file():  # wait for training to start
            time.sleep(0.2)
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < 30  # not the 300 s collective timeout
    errors = [line for line in stderr.splitlines() if line.startswith("fsdp_lab: error:")]
    assert len(errors) == 1 and "rank 1 died (signal 9)" in errors[0], stderr


def test_a_failed_sweep_job_is_recorded_and_the_sweep_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    proc = subprocess.run(
        [
            sys.executable,
            "train.py",
            "-m",
            "sharding=hybrid,full",
            "optim.lr=3e-3,1e30",
            "trainer.max_steps=3",
            "hardware=cpu",
            "trainer.progress_bar=false",
            "checkpoint=none",
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    status = {job: json.loads((sweep / job / "run.json").read_text()) for job in "0123"}
    # hybrid on 2 ranks is refused before launch (both lrs); lr=1e30 diverges at step 2.
    assert status["0"]["status"] == status["1"]["status"] == "failed"
    assert "sharding=hybrid on 2 ranks" in status["0"]["error"]
    assert status["2"]["status"] == "completed"
    assert len(read_metrics(sweep / "2" / "metrics.jsonl")) == 3
    assert status["3"]["status"] == "failed" and "loss is" in status["3"]["error"]
    assert "3 sweep job(s) failed" in proc.stderr
    failed_lines = [line for line in proc.stderr.splitlines() if line.startswith("  ")]
    assert len(failed_lines) == 3
    assert "sharding=full optim.lr=1e+30" in failed_lines[2] and "loss is" in failed_lines[2]
