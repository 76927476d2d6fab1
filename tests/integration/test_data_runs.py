"""Corpora through train.py as a user runs it: token files in nanoGPT's layout, and a
preparing process killed by the kernel, named by the launcher in one line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import check_ok, start_train, train

from fsdp_lab.observe.run_logs import read_metrics

pytestmark = pytest.mark.slow


def test_token_files_train_end_to_end(tmp_path, run_dir):
    rng = np.random.default_rng(0)
    eos, vocab = 255, 256  # GPT-2's layout at a tiny scale: EOS after every document
    docs = [np.append(rng.integers(0, eos, rng.integers(20, 200)), eos) for _ in range(400)]
    np.concatenate(docs).astype(np.uint16).tofile(tmp_path / "train.bin")
    check_ok(
        train(
            run_dir,
            "data=tokens",
            f"data.files={tmp_path / 'train.bin'}",
            f"data.eos_id={eos}",
            f"model.vocab_size={vocab}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "trainer.seq_len=32",
            "trainer.max_steps=4",
        )
    )
    facts = json.loads((run_dir / "run.json").read_text())["data"]
    assert facts["kind"] == "tokens" and facts["documents"] == 400 and facts["tokenizer"] is None
    assert facts["tokens"] == sum(len(d) - 1 for d in docs)
    assert read_metrics(run_dir / "metrics.jsonl", "val")  # evaluated on held-out documents


def test_a_preparing_process_killed_by_the_kernel_is_one_line(tmp_path, run_dir, bpe_tokenizer):
    with (tmp_path / "c.jsonl").open("w") as f:
        for i in range(20000):
            f.write(json.dumps({"text": f"line {i}: " + "to be or not to be " * 30}) + "\n")
    proc = start_train(
        run_dir,
        "data=text",
        f"data.files={tmp_path / 'c.jsonl'}",
        f"data.tokenizer={bpe_tokenizer}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.num_proc=1",
        "model.vocab_size=1000",
    )
    deadline, worker = time.monotonic() + 120, None
    while worker is None and time.monotonic() < deadline and proc.poll() is None:
        for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            if "fsdp_lab.data.worker" in Path(f"/proc/{pid}/cmdline").read_text():
                worker = int(pid)
        time.sleep(0.05)
    assert worker is not None, proc.communicate()
    # The corpus open in the worker: it has its task, so the launcher has seen its memory
    # (pool.Worker.send samples before sending).
    corpus = str((tmp_path / "c.jsonl").resolve())
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):  # an fd closed while listed
            if any(os.readlink(fd) == corpus for fd in Path(f"/proc/{worker}/fd").iterdir()):
                break
        time.sleep(0.05)
    os.kill(worker, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, (out, err)
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"fsdp_lab: error: data: a preparing process (pid {worker}, "), err
    assert "was killed by SIGKILL, last seen at" in line and "out-of-memory killer" in line
