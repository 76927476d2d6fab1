"""The window profiler in one process: nothing at all for profile=none, a trace of exactly the
window's steps for profile=trace, and profile=memory's snapshots (the allocator's calls stood
in for: no GPU here)."""

from __future__ import annotations

import contextlib
import gzip
import json

import torch

from fsdp_lab.config import ProfileConfig, ProfileMode
from fsdp_lab.engine.hardware import memory
from fsdp_lab.observe.profile.recorder import WindowProfiler, memory_paths, trace_path

CPU = torch.device("cpu")


def steps(prof: WindowProfiler, first: int, last: int) -> list[int]:
    """Run optimizer steps first..last through the profiler; the steps where a window ended."""
    ended = []
    x = torch.randn(64, 64)
    for done in range(first, last + 1):
        with prof.step_region(done):
            for _ in range(3):
                x = torch.tanh(x @ x)
            with prof.data_region():
                torch.randn(8)
        if prof.step(done):
            ended.append(done)
    return ended


def test_profile_none_records_nothing_and_annotates_nothing(tmp_path):
    prof = WindowProfiler.disabled()
    assert isinstance(prof.step_region(1), contextlib.nullcontext)
    assert steps(prof, 1, 10) == [] and prof.analyse() is None


def test_the_trace_holds_the_window_steps_and_ends_on_every_rank_at_once(tmp_path):
    cfg = ProfileConfig(mode=ProfileMode.trace, wait=2, warmup=1, active=2, ranks=[1])
    prof = WindowProfiler(cfg, rank=0, device=CPU, run_dir=tmp_path, start_step=10)
    assert not prof.tracing and steps(prof, 11, 16) == [15]  # rank 0 does not record...
    assert not (tmp_path / "profile").exists()
    prof = WindowProfiler(cfg, rank=1, device=CPU, run_dir=tmp_path, start_step=10)
    assert steps(prof, 11, 16) == [15]  # ...but its window ends where rank 1's does
    with gzip.open(trace_path(tmp_path, 1), "rt") as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert {"fsdp_lab::step 14", "fsdp_lab::step 15", "fsdp_lab::data"} <= names
    assert "fsdp_lab::step 13" not in names  # the warm-up step is thrown away
    result = prof.analyse()
    assert [s.step for s in result.steps] == [
        14,
        15,
    ] and result.trace == "profile/rank1.trace.json.gz"
    assert all(s.compute_s > 0 and s.comm_s == 0 and s.idle_data_s >= 0 for s in result.steps)


def test_a_resumed_run_whose_window_is_past_the_end_profiles_nothing(tmp_path, caplog):
    cfg = ProfileConfig(mode=ProfileMode.trace)
    prof = WindowProfiler.start(
        cfg, rank=0, device=CPU, run_dir=tmp_path, start_step=95, max_steps=100
    )
    assert not prof.enabled and "nothing is profiled" in caplog.text


def test_profile_memory_dumps_at_the_window_end_and_at_an_out_of_memory(tmp_path, monkeypatch):
    calls, observers = [], []
    monkeypatch.setattr(memory, "start_memory_history", lambda n: calls.append(("start", n)))
    monkeypatch.setattr(memory, "stop_memory_history", lambda: calls.append(("stop",)))
    monkeypatch.setattr(memory, "on_out_of_memory", observers.append)

    def dump(pickle_path, html_path):
        calls.append(("dump", pickle_path.name, html_path and html_path.name))
        pickle_path.write_bytes(b"snapshot")

    monkeypatch.setattr(memory, "dump_memory_history", dump)
    cfg = ProfileConfig(mode=ProfileMode.memory, wait=1, warmup=0, active=2, memory_entries=7)
    prof = WindowProfiler(cfg, rank=3, device=CPU, run_dir=tmp_path, start_step=0)
    assert calls == [("start", 7)] and len(observers) == 1
    observers[0]()  # an allocation failed
    assert calls[-1] == ("dump", "rank3.oom.pickle", None)
    assert steps(prof, 1, 4) == [3]
    assert calls[-2:] == [("dump", "rank3.memory.pickle", "rank3.memory.html"), ("stop",)]
    assert memory_paths(tmp_path, 3)[0].read_bytes() == b"snapshot" and prof.analyse() is None
