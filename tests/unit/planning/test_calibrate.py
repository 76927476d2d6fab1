"""calibrate's measuring code on two gloo ranks at tiny sizes, its statistics, this machine's
profile cache, and what --from-runs fits (on hand-made runs; the real ones:
tests/integration/test_profile_runs.py). No figure measured here is asserted against a
speed: the machine running the tests may be busy."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import time
from pathlib import Path

import pytest

from fsdp_lab.config import ConfigError, HardwareKind, compose
from fsdp_lab.config.device_rows import device_profile
from fsdp_lab.config.hardware_profiles import read_profile, write_profile
from fsdp_lab.config.topology import Topology
from fsdp_lab.engine.hardware.timing import mean_interval, median_interval
from fsdp_lab.planning import calibrate, calibrate_fit, learn, machine, run_check

TINY = calibrate.Grid(
    matmuls=((16, 16, 16), (64, 32, 64)),
    attention=((1, 2, 32, 16), (1, 2, 64, 16)),
    decoders=((16, 8), (32, 32)),
    collectives=(1024, 16 * 1024),
    grouped=((2, 8, 16, 16),),
)


def test_calibrate_measures_every_figure_on_two_gloo_ranks(tmp_path):
    job = calibrate.Job(kind=HardwareKind.cpu, nproc=2, threads=1, dtype="fp32", grid=TINY,
                        seconds=1.0, store=str(tmp_path / "store"))  # fmt: skip
    everyone = calibrate.measure(job)
    assert len(everyone) == 2  # rank 0 reports both ranks' timings
    for rank in everyone:
        assert set(rank) >= {"matmul", "attention", "decoders", "views", "optimizer", "fsdp",
                             "tp", "collectives", "straggle", "loop", "host", "device"}  # fmt: skip
        median, low, high, samples = rank["matmul"]["64x32x64"][1]
        assert low <= median <= high and samples >= 7  # a 95% interval around each figure
    profile = calibrate_fit.profile_from(everyone, job, device_profile("cpu"))
    assert profile.matmul["fp32 forward"].per_s > 0 and profile.op_overhead_s >= 0
    assert {p[0] for p in profile.attention["fp32 backward"]} == {16}  # one head size
    assert set(profile.collectives) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert profile.measured["ranks"] == 2 and profile.measured["interval"]
    memory = ("memory_bytes_per_s", "memory_by_size")  # tiny decoders: maybe within the noise
    assert all(profile.sources[f].startswith("micro-benchmark: fsdp-lab calibrate")
               or (f in memory and not profile.memory_by_size)
               for f in calibrate_fit.MEASURED_FIELDS)  # fmt: skip
    write_profile(profile, tmp_path / "p.json")
    assert read_profile(tmp_path / "p.json") == profile
    lines = calibrate.describe(profile, 1.0).splitlines()
    assert lines[0].startswith("measured (cpu") and "widest 95% interval" in lines[0]


def test_a_median_and_a_mean_state_their_95_percent_intervals():
    # 100 samples 1..100: the median 50.5, its interval the 41st to 60th values
    t = median_interval([float(x) for x in range(100, 0, -1)])
    assert (t.median, t.low, t.high, t.samples) == (50.5, 41.0, 60.0, 100)
    m = mean_interval([1.0, 3.0] * 50)  # stdev 1.005, 100 samples: +-0.197
    assert m.median == 2.0 and m.high - m.median == pytest.approx(1.96 * 1.00504 / 10, rel=1e-3)
    assert m.spread == pytest.approx(0.0985, rel=1e-2)


def test_this_machines_profile_is_kept_per_ranks_and_torch_and_measured_once(tmp_path):
    cfg = compose(["hardware=cpu", f"hardware.profile_cache={tmp_path}"])
    topo = Topology.nodes(2, 1, HardwareKind.cpu)
    key = machine.key_of(cfg, topo)
    assert "-cpu-" in key and "-2r-" in key and "torch" in key and "-fp32-" in key
    assert machine.key_of(cfg, Topology.nodes(4, 1, HardwareKind.cpu)) != key
    assert machine.cached(cfg, topo) is None
    calls = []

    def measure():
        calls.append(1)
        return dataclasses.replace(device_profile("cpu"), name="measured here")

    said = []
    assert machine.ensure(cfg, topo, measure, log=said.append).name == "measured here"
    assert machine.ensure(cfg, topo, measure, log=said.append).name == "measured here"
    assert len(calls) == 1 and len(said) == 1 and "once" in said[0]
    path = machine.cache_path(cfg, key)
    old = time.time() - (machine.STALE_DAYS + 1) * 86400
    os.utime(path, (old, old))  # stale: measured again
    assert machine.cached(cfg, topo) is None
    with open(path.with_suffix(".lock"), "w") as held:  # another process measuring now
        fcntl.flock(held, fcntl.LOCK_EX)
        assert machine.ensure(cfg, topo, measure, log=said.append) is None
    assert len(calls) == 1 and "another process is measuring" in said[-1]

    def broken():  # a measuring that fails says why once; the day's other runs skip it
        calls.append(1)
        raise RuntimeError("rank 1 exited")

    fresh = compose(["hardware=cpu", f"hardware.profile_cache={tmp_path / 'fresh'}"])
    with pytest.raises(ConfigError, match="rank 1 exited"):
        machine.ensure(fresh, topo, broken)
    assert machine.ensure(fresh, topo, broken, log=said.append) is None
    assert len(calls) == 2 and "failed within the day" in said[-1] and "rank 1" in said[-1]
    # a run on an unmeasured machine that may not measure it has nothing to compare with
    other = compose(["hardware=cpu", f"hardware.profile_cache={tmp_path / 'none'}"])
    assert run_check.profile_for(other, topo, measure=False) is None


def _observed(step, compute, comm, *, split=None):
    predicted = {"step_s": compute + comm, "compute_s": compute, "exposed_comm_s": comm,
                 "optimizer_s": 0.0, "other_s": 0.0}  # fmt: skip
    return learn.Observed(Path("run"), predicted, step, split)


def test_from_runs_fits_the_compute_scale_the_host_time_and_the_communication():
    # Traced runs whose busy time is 1.2 x the predicted compute + 5 ms, whose exposed
    # communication is 1.5 x the predicted (the traces recorded at twice the step's time:
    # the profiler's slowdown, scaled away)
    runs = []
    for compute, comm in ((0.1, 0.02), (0.2, 0.05), (0.4, 0.03)):
        busy, exposed = 1.2 * compute + 0.005, 1.5 * comm
        step = busy + exposed
        split = {"step_s": 2 * step, "compute_s": 2 * busy * 0.8, "idle_s": 2 * busy * 0.2,
                 "exposed_comm_s": 2 * exposed}  # fmt: skip
        runs.append(_observed(step, compute, comm, split=split))
    learned = learn.fit(runs)
    assert learned["compute_scale"] == pytest.approx(1.2)
    assert learned["host_s"] == pytest.approx(0.005)
    assert learned["comm_scale"] == pytest.approx(1.5)
    refined = learn.refined(device_profile("cpu"), learned, [Path("a"), Path("b")])
    assert refined.sources["learned"].startswith("fit: fsdp-lab calibrate --from-runs over 2")
    for run in runs:  # the fit reproduces the runs it learned from
        assert learn.predicted_step(run, refined) == pytest.approx(run.step_s)
    # runs without a trace: their steps less the predicted communication teach the rest
    plain = [_observed(0.3, 0.2, 0.05), _observed(0.6, 0.4, 0.1)]  # 1.25 x compute
    assert learn.fit(plain)["comm_scale"] == 1.0
    assert learn.fit(plain)["compute_scale"] == pytest.approx(1.25)
    # what the prediction already puts in `other` (4 ms) is not learned again as host time
    busy, exposed = 1.2 * 0.1 + 0.005, 1.5 * 0.02
    step = busy + exposed + 0.004
    split = {"step_s": 2 * step, "exposed_comm_s": 2 * exposed}
    with_other = learn.Observed(Path("r"), {**runs[0].predicted, "other_s": 0.004}, step, split)
    assert learn.fit([with_other, *runs[1:]])["host_s"] == pytest.approx(0.005)


def test_from_runs_refuses_what_is_not_a_run(tmp_path, capsys):
    from fsdp_lab.tools import cli

    assert cli.main(["calibrate", "--from-runs", str(tmp_path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "no run.json there; give run directories" in line


@pytest.mark.parametrize(
    "args,said",
    [
        (["--device", "h100"], "--device h100 names the profile --from-runs refines"),
        (["--base", "nosuch", "--seconds", "1"], "--base nosuch: not a known device"),
        (["hardware.profile=nosuch"], "hardware.profile=nosuch: not a known device"),
    ],
)
def test_a_bad_name_fails_in_one_line_before_anything_is_measured(capsys, args, said):
    from fsdp_lab.tools import cli

    assert cli.main(["calibrate", *args]) == 2
    assert said in capsys.readouterr().err
