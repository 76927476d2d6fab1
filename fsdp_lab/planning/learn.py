"""`fsdp-lab calibrate --from-runs RUN_DIR...`: refine a hardware profile from runs the user
already made, so that predictions on the user's own machines improve with use.

    fsdp-lab calibrate --from-runs outputs/2026-11-29/*            # this machine's profile
    fsdp-lab calibrate --from-runs sweep/*/ --device h100 --out my_h100.json

Each run is predicted again on the profile (its config.yaml and run.json's facts: ranks,
nodes), and set beside what it measured: with ``profile=trace``, the split of its step into
compute, exposed communication and idle host time; without, the step alone. Three figures are
fitted (``DeviceProfile.learned``, see ``fit``): how much slower (or faster) than predicted
the exposed communication is (``comm_scale``), and the rest of the step: its compute and
optimizer (``compute_scale``) plus the host time a step spends outside the model that
nothing else prices (``host_s``). A run without a trace informs the step as a whole. The
profile is written with its learned figures and the runs they came from (its sources say
so); a profile that learned before is refined from its measured base, not from its last fit.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from fsdp_lab.config import ConfigError
from fsdp_lab.config.device_rows import device_profile
from fsdp_lab.config.hardware_profiles import DeviceProfile, write_profile
from fsdp_lab.observe import rundir
from fsdp_lab.planning import machine, run_check
from fsdp_lab.planning.calibrate_fit import fit_rate


@dataclass(frozen=True)
class Observed:
    """One run: its prediction on the profile being refined, and what it measured."""

    run_dir: Path
    predicted: dict  # StepTime.to_json()
    step_s: float  # its median steady step
    split: dict | None  # profile=trace: compute_s, exposed_comm_s, idle_s (None without)


def observe(run_dir: Path, device: DeviceProfile) -> Observed:
    """A run predicted on ``device`` beside its measured step (and split)."""
    record = rundir.read_run_file(run_dir)
    steps = run_check.measured_steps(run_dir, record)
    if record.facts is None or len(steps) < run_check.MIN_STEPS:
        raise ConfigError(
            f"--from-runs {run_dir}: not a finished run of {run_check.MIN_STEPS}+ steps "
            "(its run.json has no facts or too few steps)"
        )
    step = run_check.predict_run(run_dir, record, device=device)
    if step is None:
        raise ConfigError(f"--from-runs {run_dir}: a {record.facts.hardware} run; the time "
                          "model prices cpu and gpu runs")  # fmt: skip
    profile = record.results.profile if record.results else None
    summary = profile.get("summary") if isinstance(profile, dict) else None
    return Observed(run_dir, step.to_json(), statistics.median(steps), summary)


def _geomean(ratios: list[float]) -> float:
    ratios = [r for r in ratios if r > 0 and math.isfinite(r)]
    return math.exp(statistics.fmean(math.log(r) for r in ratios)) if ratios else 1.0


def fit(observed: list[Observed]) -> dict:
    """The learned figures. A trace's split is scaled to the run's unprofiled median step
    (the profiler slows the steps it records). Exposed communication: the geometric mean of
    measured over predicted. The rest of the step, less what the prediction already puts in
    ``other`` (the profile's host cost, offload's copies): measured = scale x (predicted
    compute and optimizer) + host time, fitted as calibrate fits a rate and a latency
    (least squares on relative errors, host time >= 0)."""
    comm, busy = [], []
    for o in observed:
        p = o.predicted
        predicted_busy = p["compute_s"] + p["optimizer_s"]
        if o.split and o.split.get("step_s"):
            measured_comm = o.step_s / o.split["step_s"] * o.split["exposed_comm_s"]
            if p["exposed_comm_s"] > 0 and measured_comm > 0:
                comm.append(measured_comm / p["exposed_comm_s"])
        else:  # the step alone: the predicted communication taken as it is
            measured_comm = p["exposed_comm_s"]
        busy.append((predicted_busy, o.step_s - measured_comm - p["other_s"]))
    scale, host = 1.0, 0.0
    points = [(x, y) for x, y in busy if x > 0 and y > 0]
    if points:
        rate = fit_rate(points)
        scale, host = 1 / rate.per_s, rate.latency_s
    return {"compute_scale": scale, "comm_scale": _geomean(comm) if comm else 1.0,
            "host_s": host}  # fmt: skip


def refined(device: DeviceProfile, learned: dict, runs: list[Path]) -> DeviceProfile:
    """``device`` with ``learned`` (and where it came from)."""
    source = (
        f"fit: fsdp-lab calibrate --from-runs over {len(runs)} runs "
        f"({', '.join(str(r) for r in runs[:3])}{', ...' if len(runs) > 3 else ''}), "
        f"{time.strftime('%Y-%m-%d')}"
    )
    record = {**learned, "runs": [str(r) for r in runs], "date": time.strftime("%Y-%m-%d")}
    return dataclasses.replace(
        device, learned=record, sources={**device.sources, "learned": source}
    )


def error(observed: Observed, device: DeviceProfile) -> float:
    """The run's measured step over ``device``'s prediction of it, less one."""
    return observed.step_s / predicted_step(observed, device) - 1


def predicted_step(o: Observed, device: DeviceProfile) -> float:
    """``o``'s step as ``device`` (with what it learned) predicts it, from its unrefined split."""
    learned, p = device.learned or {}, o.predicted
    return (
        (p["compute_s"] + p["optimizer_s"]) * learned.get("compute_scale", 1.0)
        + p["exposed_comm_s"] * learned.get("comm_scale", 1.0)
        + p["other_s"]
        + learned.get("host_s", 0.0)
    )


def learn_command(runs: list[Path], out: Path | None, *, device: str | None) -> int:

    missing = [r for r in runs if not (r / rundir.RUN_FILE).is_file()]
    if missing:
        raise ConfigError(f"--from-runs {missing[0]}: no run.json there; give run directories")
    first = rundir.load_run_config(runs[0])
    base, path = _profile_to_refine(first, runs[0], device, machine, device_profile)
    if out is not None and out.exists():
        raise ConfigError(f"--out {out} exists: give a new path (a profile is never overwritten)")
    if out is None and path is None:
        raise ConfigError(f"--device {device} is a named row: give --out for the refined profile")
    base = dataclasses.replace(base, learned={})  # refined from its measured figures
    observed = [observe(r, base) for r in runs]
    profile = refined(base, fit(observed), runs)
    target = out or path
    write_profile(profile, target)
    for o in observed:
        print(
            f"{o.run_dir}: measured {o.step_s * 1e3:.1f} ms, predicted "
            f"{predicted_step(o, base) * 1e3:.1f} -> {predicted_step(o, profile) * 1e3:.1f} ms"
            f"{'' if o.split else ' (no trace: its step alone)'}"
        )
    learned = profile.learned
    print(
        f"learned from {len(runs)} runs: kernels {learned['compute_scale']:.2f}x, exposed "
        f"communication {learned['comm_scale']:.2f}x, {learned['host_s'] * 1e3:.1f} ms of host "
        f"time a step; wrote {target}"
    )
    return 0


def _profile_to_refine(cfg, run_dir: Path, device: str | None, machine, device_profile):
    """(the profile --from-runs refines, the file it is rewritten to: None for a named row)."""
    if device is not None:
        profile = device_profile(device)
        return profile, (Path(device) if profile.measured is not None else None)
    record = rundir.read_run_file(run_dir)
    facts = record.facts
    if facts is None:
        raise ConfigError(f"--from-runs {run_dir}: its run.json has no facts")
    topo = run_check.run_topology(facts)
    profile = machine.cached(cfg, topo) if topo is not None else None
    if profile is None:
        raise ConfigError(
            "--from-runs: this machine has no measured profile for these runs' ranks to "
            "refine; run fsdp-lab calibrate first, or name one with --device"
        )
    return profile, machine.cache_path(cfg, machine.key_of(cfg, topo))
