"""Supervised fine-tuning end to end: SmolLM2-135M-Instruct (offline, scripts/prepare_smollm2.py)
with LoRA on conversations made of Shakespeare's dialogue (scripts/shakespeare_chats.py), two CPU
ranks, packed conversations. The validation loss on the replies falls, the run records what it
learned, and a run resumed from its middle checkpoint continues exactly. In fp32: a bf16 step on
a CPU without native bf16 matmuls takes minutes."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, check_ok, run_python, train

from fsdp_lab.observe.run_logs import read_metrics

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def chats(tmp_path_factory):
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    check_ok(run_python([str(ROOT / "scripts" / "shakespeare_chats.py"), str(path), "--max", "6"]))
    return path


def args(smollm2, chats, tmp_path) -> tuple[str, ...]:
    return (
        "model=local",
        f"model.name_or_path={smollm2}",
        "data=chat",
        f"data.files={chats}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.validation_fraction=0.1",
        "finetune=lora",
        "sharding=full",
        "trainer.seq_len=192",
        "trainer.micro_batch_size=2",
        "trainer.max_steps=6",
        "trainer.eval_every=6",
        "trainer.eval_batches=2",
        "checkpoint.every_n_steps=3",
        "optim.lr=2e-3",
        "optim.warmup_steps=0",
    )


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, smollm2, chats):
    tmp = tmp_path_factory.mktemp("chat_run")
    overrides = args(smollm2, chats, tmp)
    check_ok(train(tmp / "run", *overrides, timeout=900))
    return tmp / "run", overrides


def test_the_validation_loss_on_replies_falls_and_the_run_says_what_it_learned(chat_run):
    run_dir, _ = chat_run
    val = read_metrics(run_dir / "metrics.jsonl", "val")
    assert [r["step"] for r in val] == [0, 6]
    assert val[1]["val_loss"] < val[0]["val_loss"] - 0.05, val
    steps = read_metrics(run_dir / "metrics.jsonl")
    # 2 ranks x 2 rows of 192 positions a step, of which only the replies are learned
    assert len(steps) == 6 and all(0 < r["trained_tokens"] < 0.9 * 2 * 2 * 192 for r in steps)
    for r in steps:  # the rate of learned tokens, beside every position's
        assert r["trained_tokens_per_s"] == pytest.approx(r["trained_tokens"] / r["step_time_s"])
        assert r["trained_tokens_per_s"] < r["tokens_per_s"]
    data = json.loads((run_dir / "run.json").read_text())["data"]
    chat = data["chat"]
    assert chat["conversations"]["train"] > 100 and 0.1 < chat["learned_share"] < 0.9
    assert data["kind"] == "chat"


def test_a_resumed_chat_run_continues_exactly(chat_run, tmp_path):
    run_dir, overrides = chat_run
    step3 = run_dir / "checkpoints" / "step_00000003"
    check_ok(train(tmp_path / "resumed", *overrides, f"resume={step3}", timeout=900))
    want = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
    got = {r["step"]: r for r in read_metrics(tmp_path / "resumed" / "metrics.jsonl")}
    assert sorted(got) == [4, 5, 6]
    for step, record in got.items():
        assert record["loss"] == want[step]["loss"], step
        assert record["trained_tokens"] == want[step]["trained_tokens"], step
