"""Reading torch's flight recorder: real gloo dumps recorded on a CPU, and NCCL-shaped ones.

data/*.json were recorded by data/record_flight_dumps.py (torch 2.13, gloo, 2 ranks, 3 s
timeout). The NCCL dumps are built by hand after torch's reader
(torch/distributed/flight_recorder/components): no multi-GPU machine recorded them.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from pathlib import Path

import pytest

from fsdp_lab.engine.hardware import process_group
from fsdp_lab.observe import flight, rundir
from fsdp_lab.train import worker

DATA = Path(__file__).parent / "data"
FRAME = r"from observe/data/record_flight_dumps\.py:\d+ in "


def recorded(case: str) -> dict[int, flight.RankRecord]:
    return {r: flight.load(DATA / f"{case}_rank{r}.flight.json", r) for r in (0, 1)}


def test_a_rank_that_skipped_a_collective_is_behind():
    """Rank 1 never entered #5, which rank 0 timed out in."""
    said = flight.describe(recorded("behind"), range(2), waiting=[0])
    assert re.fullmatch(
        "flight recorder: rank 0 waits in collective #5 "
        rf"\(all_reduce, 10 elements, default_pg, {FRAME}step\); "
        rf"rank 1 last entered #4 \(all_gather, 10 elements, default_pg, {FRAME}main\): "
        "rank 1 is behind",
        said,
    ), said


def test_torchs_own_json_dump_reads_the_same_without_stacks():
    """``_dump_fr_trace_json``: no frames, and the group status in strings."""
    own = flight.load(DATA / "behind_rank0.torch.json", 0)
    assert own.current("0") == flight.Collective(
        seq=5,
        op="all_reduce",
        group="default_pg",
        elements=10,
        state="scheduled",
        created_ns=own.current("0").created_ns,
        frame=None,
    )
    assert not own.tracks_state  # gloo marks nothing started or completed


def test_a_rank_without_a_dump_is_named():
    said = flight.describe({0: recorded("behind")[0]}, range(2), waiting=[0])
    assert said.endswith("; no dump from rank 1 (a stopped or killed rank cannot write one)")
    # A rank reporting on its own (torchrun) expects no other dump.
    assert "no dump" not in flight.describe({0: recorded("behind")[0]}, [0], waiting=[0])


def test_ranks_that_entered_different_collectives_under_one_number_are_a_mismatch():
    said = flight.describe(recorded("mismatch"), range(2), waiting=[0, 1])
    assert re.fullmatch(
        "flight recorder: mismatch: ranks entered different collectives as #5 of default_pg: "
        rf"rank 0 all_reduce \(10 elements, {FRAME}step\), "
        rf"rank 1 all_gather \(10 elements, {FRAME}main\)",
        said,
    ), said


def nccl_entry(seq: int, op: str, state: str, size: int = 1024) -> dict:
    """One entry as ProcessGroupNCCL records it (torch's types.Op reads these keys)."""
    return {
        "record_id": seq - 1,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"nccl:{op}",
        "time_created_ns": 1_000 * seq,
        "input_sizes": [[size]],
        "input_dtypes": ["BFloat16"],
        "output_sizes": [[size]],
        "output_dtypes": ["BFloat16"],
        "state": state,
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None,
        "retired": state == "completed",
        "timeout_ms": 600_000,
        "is_p2p": False,
        "thread_name": "pt_main_thread",
        "thread_id": "1",
        "frames": [
            {"name": "_all_gather", "filename": "/venv/torch/distributed/fsdp/x.py", "line": 1},
            {"name": "train_step", "filename": "/src/fsdp_lab/train/loop.py", "line": 99},
        ],
    }


def nccl_dump(entries: list[dict]) -> bytes:
    done = [e["collective_seq_id"] for e in entries if e["state"] == "completed"]
    return pickle.dumps(
        {
            "version": "2.10",
            "comm_lib_version": "2.27.3",
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
            "pg_status": {
                "0": {
                    "last_enqueued_collective": max(e["collective_seq_id"] for e in entries),
                    "last_started_collective": -1,
                    "last_completed_collective": max(done, default=-1),
                }
            },
            "entries": entries,
        }
    )


def test_an_nccl_watchdog_dump_tells_the_collective_a_rank_is_stuck_in(tmp_path):
    """The watchdog's pickle: rank 0 is stuck in #5 (started; #6 queued behind it), rank 1
    completed #4 and entered no more."""
    old = [nccl_entry(s, "_allgather_base", "completed") for s in range(1, 5)]
    queued = [nccl_entry(5, "allreduce", "started"), nccl_entry(6, "allreduce", "scheduled")]
    (tmp_path / "flight_watchdog_rank0").write_bytes(nccl_dump(old + queued))
    (tmp_path / "flight_watchdog_rank1").write_bytes(nccl_dump(old))
    records = flight.read_dir(tmp_path, range(2))
    assert records[0].tracks_state
    assert flight.describe(records, range(2)) == (
        "flight recorder: rank 0 is at collective #5 (allreduce, 1024 elements, default_pg, "
        "from fsdp_lab/train/loop.py:99 in train_step), started; "
        "rank 1 last entered #4 (_allgather_base, 1024 elements, default_pg, "
        "from fsdp_lab/train/loop.py:99 in train_step), completed: rank 1 is behind"
    )
    # A rank's own JSON dump comes before its watchdog's.
    (tmp_path / "rank1.flight.json").write_bytes((DATA / "behind_rank1.flight.json").read_bytes())
    assert flight.read_dir(tmp_path, [1])[1].current("0").op == "all_gather"


def test_ranks_that_agree_and_wait_nowhere_say_nothing(tmp_path):
    done = [nccl_entry(s, "allreduce", "completed") for s in range(1, 4)]
    records = {r: flight.record(pickle.loads(nccl_dump(done)), r) for r in range(2)}
    assert flight.describe(records, range(4)) is None
    assert flight._ranks([5, 0, 1, 2]) == "ranks 0-2, 5"


def test_a_pickle_that_names_code_is_refused_unread(tmp_path):
    for evil, name in ((os.system, "system"), ({"entries": [os.getcwd]}, "getcwd")):
        with pytest.raises(pickle.UnpicklingError, match=rf"refused \w+\.{name}: .*plain data"):
            flight.parse(pickle.dumps(evil))
    (tmp_path / "flight_watchdog_rank0").write_bytes(pickle.dumps(os.system))
    assert flight.read_dir(tmp_path, [0]) == {}  # an unreadable dump is no dump


def test_the_recorder_settings_keep_the_users_variables(tmp_path, monkeypatch):
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # torch's older name, the user's
    process_group.set_flight_recorder(2000, tmp_path / "flight_watchdog_rank")
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "flight_watchdog_rank")
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE")
    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE")
    process_group.set_flight_recorder(0, tmp_path / "flight_watchdog_rank")  # off: no dump file
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "0"
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ


def test_a_dump_that_fails_never_hides_the_rank_s_error(tmp_path, monkeypatch):
    def broken():
        raise RuntimeError("no recorder here")

    monkeypatch.setattr(process_group, "flight_records", broken)
    assert worker._save_flight_record(tmp_path, 0) is None
    raw = (DATA / "behind_rank0.flight.json").read_bytes()
    monkeypatch.setattr(process_group, "flight_records", lambda: [b'{"entries": []}', raw])
    said = worker._save_flight_record(tmp_path, 0)
    assert said.startswith("flight recorder: rank 0 waits in collective #5 (all_reduce")
    assert flight.load(flight.dump_file(tmp_path / "logs", 0), 0).current("0").seq == 5


def test_under_torchrun_a_rank_that_timed_out_reports_its_own_record(tmp_path, monkeypatch, capsys):
    """No launcher of ours reads the dumps: the rank's error line carries its own record."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    raw = (DATA / "behind_rank0.flight.json").read_bytes()
    monkeypatch.setattr(process_group, "flight_records", lambda: [raw])
    error = RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    worker._record_failure(tmp_path, error, launcher_reports=False)
    line = json.loads(rundir.error_file(tmp_path, 0).read_text())["error"]
    assert line.startswith(
        "RuntimeError: Timed out waiting 3000ms for recv operation to complete; "
        "flight recorder: rank 0 waits in collective #5 (all_reduce"
    )
    assert f"fsdp_lab: error: {line}" in capsys.readouterr().err
    # Not a timeout: no dump, the error as it was.
    worker._record_failure(tmp_path / "other", ValueError("bad"), launcher_reports=False)
    assert not flight.dump_file(tmp_path / "other" / "logs", 0).exists()
