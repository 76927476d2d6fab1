"""Checkpoints a cautious user can trust: damage is found and skipped, a tampered checkpoint runs
no code, a full disk is one line and loses nothing, a hung rank is named.

Real runs of train.py on CPU ranks; the checkpoints they start from are the shared "full-2" run's
(2 ranks, 8 steps, a sharded checkpoint at steps 4 and 8)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import SHARED_RUNS, check_ok, rank_pid, run_python, start_train, train

from fsdp_lab.observe.run_logs import read_metrics
from fsdp_lab.state import checkpoint as ckpt
from fsdp_lab.state import safe_load

pytestmark = pytest.mark.slow

BASE = SHARED_RUNS["full-2"]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def _errors(proc) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr
    return [x for x in proc.stderr.splitlines() if x.startswith(("fsdp_lab: error:", "fsdp-lab:"))]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return run_python(["-m", "fsdp_lab.tools.cli", *args], timeout=120)


def _corrupt(path: Path) -> None:
    """4 KB of random bytes in the middle: same size, so only a checksum can tell."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(os.urandom(4096))


def test_a_corrupted_shard_is_found_and_resume_falls_back_past_it(shared_run, tmp_path):
    straight = shared_run("full-2")
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    bad = run / "checkpoints" / ckpt.step_dir_name(8)
    _corrupt(bad / "__0_0.distcp")

    verified = _cli("verify", str(bad))
    assert verified.returncode == 1
    assert "DAMAGED" in verified.stdout and "__0_0.distcp  does not match" in verified.stdout

    refused = train(tmp_path / "other", *BASE, f"resume={bad}")
    assert refused.returncode == 2
    (error,) = _errors(refused)
    assert "__0_0.distcp does not match its checksum" in error

    resumed = train(run, *BASE)  # resume=auto in the run's own dir
    check_ok(resumed)
    output = resumed.stdout + resumed.stderr  # the launcher logs where Hydra's logging says
    (notice,) = [x for x in output.splitlines() if "is damaged" in x]
    assert "__0_0.distcp" in notice and "resuming from step_00000004 instead" in notice
    assert (run / "checkpoints" / "step_00000008.damaged" / "__0_0.distcp").is_file()
    facts = json.loads((run / "run.json").read_text())
    assert facts["start_step"] == 4 and facts["step"] == 8
    want, got = _losses(straight), _losses(run)
    assert [got[s] - want[s] for s in range(5, 9)] == [0.0] * 4


class _Touch:
    """What a malicious checkpoint holds: unpickled unsafely, it creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _evil_metadata(path: Path, ran: Path) -> None:
    meta = safe_load.read_metadata(path)
    meta.planner_data = _Touch(ran)
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def _evil_byte_item(path: Path, ran: Path) -> None:
    """Point an optimizer BYTE_IO item (a param group's lr, keyed by a parameter's name) at a
    payload appended to a shard."""
    meta = safe_load.read_metadata(path)
    index = next(
        i for i in meta.storage_data if ".param_groups." in i.fqn and i.fqn.endswith(".lr")
    )
    info = meta.storage_data[index]
    blob = io.BytesIO()
    torch.save(_Touch(ran), blob)
    shard = path / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(blob.getvalue())
    with open(shard, "ab") as f:
        f.write(blob.getvalue())
    (path / ".metadata").write_bytes(pickle.dumps(meta))


def _evil_trainer_file(path: Path, ran: Path) -> None:
    """The trainer's torch file (rank 0's RNG states; the trainer state itself is JSON)."""
    torch.save({"torch": torch.get_rng_state(), "numpy": _Touch(ran)}, path / "rng" / "rank0.pt")


@pytest.mark.parametrize("tamper", [_evil_metadata, _evil_byte_item, _evil_trainer_file])
def test_a_tampered_checkpoint_runs_no_code(shared_run, tmp_path, tamper):
    evil, ran = tmp_path / "evil", tmp_path / "code_ran"
    shutil.copytree(shared_run("full-2") / "checkpoints" / ckpt.step_dir_name(4), evil)
    tamper(evil, ran)
    assert pickle.loads(pickle.dumps(_Touch(tmp_path / "live"))) is not None  # a live payload
    assert (tmp_path / "live").exists()
    # Checksums off: only the safe readers stand in the way.
    resumed = train(tmp_path / "run", *BASE, f"resume={evil}", "checkpoint.verify=none")
    assert resumed.returncode == 2
    (error,) = _errors(resumed)
    assert "is not plain data" in error and "posix.system" in error
    assert not (tmp_path / "run" / "logs").exists()  # refused before any rank started
    exported = _cli("export", str(evil), str(tmp_path / "hf"), "--verify", "none")
    assert exported.returncode == 2
    (error,) = _errors(exported)
    assert "is not plain data" in error
    if tamper is _evil_metadata:  # the shape check reads only the metadata
        with pytest.raises(ckpt.CheckpointError, match="not plain data"):
            ckpt.saved_shapes(evil)
    else:
        assert ckpt.saved_shapes(evil)  # reads nothing the payload is in
    assert not ran.exists()


def _mount_tmpfs(path: Path, size: int) -> None:
    path.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("LOUD SKIP: mounting a small tmpfs needs root; the full-disk test did not run")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)])
    if done.returncode != 0:
        pytest.skip("LOUD SKIP: mount -t tmpfs failed here; the full-disk test did not run")


def test_a_full_disk_is_one_line_and_loses_nothing(shared_run, tmp_path):
    ref = shared_run("full-2")
    size = ckpt.integrity.checkpoint_bytes(ref / "checkpoints" / ckpt.step_dir_name(4))
    per_rank = json.loads((ref / "run.json").read_text())["state_bytes_per_rank"]
    estimate = sum(r["params"] + r["optimizer"] for r in per_rank)
    assert estimate < size  # the first save's estimate: state bytes, without DCP's framing
    disk = tmp_path / "disk"
    page = 4096
    # Room for the estimate, not for the checkpoint: the first save passes the free-space check
    # and fails writing (a real ENOSPC).
    _mount_tmpfs(disk, (estimate + size) // 2 // page * page)
    try:
        run = tmp_path / "run"
        args = ("hardware=cpu", "trainer.max_steps=6", "checkpoint.every_n_steps=3")
        args += (f"checkpoint.dir={disk / 'ckpt'}",)
        failed = train(run, *args)
        assert failed.returncode == 1
        (error,) = _errors(failed)
        assert "disk is full" in error and "no checkpoint yet" in error
        assert list((disk / "ckpt").iterdir()) == []  # no .tmp left, no latest
        # Room for one checkpoint and a half: step 3 is saved, step 6 is refused beforehand.
        shutil.rmtree(run)
        remount = f"remount,size={size * 3 // 2 // page * page}"
        subprocess.run(["mount", "-o", remount, str(disk)], check=True)
        failed = train(run, *args)
        assert failed.returncode == 1
        (error,) = _errors(failed)
        assert "checkpoint at step 6 needs about" in error
        assert "step_00000003 is still the latest" in error
        assert sorted(p.name for p in (disk / "ckpt").iterdir()) == ["latest", "step_00000003"]
        # on_save_error=continue: a run whose checkpoints cannot fit trains to the end.
        other = ("hardware=cpu", "trainer.max_steps=6", "checkpoint.every_n_steps=3")
        went_on = train(
            tmp_path / "other",
            *other,
            f"checkpoint.dir={disk / 'other'}",
            "checkpoint.on_save_error=continue",
        )
        check_ok(went_on)
        skipped = [x for x in (went_on.stdout + went_on.stderr).splitlines() if "skipped" in x]
        assert len(skipped) == 2 and "checkpoint at step 3 skipped" in skipped[0]
        assert not list((disk / "other").glob("step_*"))
        # Space freed, the same command again: it resumes from step 3 and finishes.
        subprocess.run(["mount", "-o", f"remount,size={4 * size}", str(disk)], check=True)
        check_ok(train(run, *args))
        facts = json.loads((run / "run.json").read_text())
        assert facts["start_step"] == 3 and facts["step"] == 6
    finally:
        subprocess.run(["umount", str(disk)])


def test_a_hung_rank_is_named_with_its_last_step(tmp_path):
    run, timeout_s = tmp_path / "run", 10
    proc = start_train(
        run,
        "hardware=cpu",
        "trainer.max_steps=100000",
        "trainer.eval_every=0",
        "checkpoint=none",
        f"hardware.timeout_s={timeout_s}",
    )
    stopped = None
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() or len(read_metrics(run / "metrics.jsonl")) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        stopped = rank_pid(run, 1)
        os.kill(stopped, signal.SIGSTOP)
        logged = len(read_metrics(run / "metrics.jsonl"))  # steps both ranks had passed
        t0 = time.monotonic()
        _, stderr = proc.communicate(timeout=timeout_s + 60)
        elapsed = time.monotonic() - t0
    finally:
        proc.kill()
        if stopped is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stopped, signal.SIGKILL)
    assert proc.returncode == 1
    assert elapsed < timeout_s + 15, elapsed
    (error,) = [x for x in stderr.splitlines() if x.startswith("fsdp_lab: error:")]
    assert "rank 1 stopped responding after step" in error, error
    # Rank 0's own dump (gloo writes none by itself), naming the collective and the code that
    # issued it (the step's, a logging boundary's, a layer's forward: wherever rank 0 was when
    # rank 1 stopped); the stopped rank could write none.
    waits = re.search(
        r"rank 0 timed out waiting for it; flight recorder: rank 0 waits in collective #\d+ "
        r"\(\w+, \d+ elements, default_pg(, from [\w/.]+\.py:\d+ in [\w<>]+)?\); "
        r"no dump from rank 1 \(a stopped or killed rank",
        error,
    )
    assert waits, error
    assert (run / "logs" / "rank0.flight.json").is_file()
    step = int(error.split("after step ")[1].split()[0])
    assert step >= logged - 1  # rank 0 cannot log a step rank 1 has not taken part in
