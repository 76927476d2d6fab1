"""A finished run against the time model: its predicted step (``fsdp-lab plan``'s, on
``hardware.profile``'s device) beside its measured median step, the two splits side by side,
and where the run departs from the prediction.

Hydra calls ``RunCheck`` after each job (conf/config.yaml's callbacks): it writes run.json's
``predicted`` and logs one line. ``fsdp-lab report`` shows the same beside each job. Nothing
here can fail a run: a prediction that cannot be made is a warning.

The run is priced on ``hardware.profile`` where set, else on this machine's own measured
profile (``planning.machine``): a local run on a machine not yet measured measures it now, in a
few seconds, once; a run under torchrun or srun reads the cached one, and without one says
the machine is unmeasured instead of comparing the run with another machine's figures.

A departure is named by the largest gap: with profile=trace the measured compute, exposed
communication and idle time against the predicted ones; without it the step as a whole.
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from fsdp_lab.config import ConfigError, HardwareKind
from fsdp_lab.config.hardware_kinds import HARDWARE, hardware_row
from fsdp_lab.config.topology import Topology
from fsdp_lab.observe import rundir
from fsdp_lab.observe.record import RunRecord
from fsdp_lab.observe.run_logs import read_rows
from fsdp_lab.planning import calibrate, machine, plan, plan_time

log = logging.getLogger("fsdp_lab")
MIN_STEPS = 3  # steady steps (after the first) a median needs to say anything
DEPARTS = 1.25  # a gap of more than this (either way) is named


def profile_for(cfg, topo: Topology, *, measure: bool, log=print):
    """The profile a run is priced on: ``hardware.profile``, else this machine's (measured
    now where ``measure`` and none is cached); None where the machine is unmeasured, or its
    GPU has no row and is unmeasured too."""

    if cfg.hardware.profile:
        return plan.time_device(cfg.hardware.profile, topo, flag="hardware.profile=")[0]
    profile = machine.cached(cfg, topo)
    if profile is None and measure:
        profile = machine.ensure(cfg, topo, lambda: calibrate.quick(cfg, topo), log=log)
    return profile


def run_topology(facts) -> Topology | None:
    """The ranks, nodes and device kind a run's facts describe (its hardware line: ``gpu: 8 x
    ...``, ``cpu: 2 cores``); None for a TPU run, which the time model does not price."""
    name = facts.hardware.split(":", 1)[0].strip()
    kind = HardwareKind.__members__.get(name)
    if kind not in HARDWARE or hardware_row(kind).plan_device is None:
        return None
    nproc = facts.world_size // max(1, facts.num_nodes)
    return Topology.nodes(nproc, facts.num_nodes, kind)


def predict_run(run_dir: Path, record: RunRecord, *, measure: bool = False, log=print, device=None):
    """The time model's step for the run in ``run_dir`` (its config.yaml and run.json's
    facts: ranks, nodes, hardware) on ``device``, else on ``profile_for``'s; None where it
    has no facts, is a TPU run, or the machine is unmeasured."""
    facts = record.facts
    topo = run_topology(facts) if facts is not None else None
    if topo is None:
        return None
    cfg = rundir.load_run_config(run_dir)
    device = device or profile_for(cfg, topo, measure=measure, log=log)
    if device is None:
        return None
    shape = plan.inspect_model(cfg, topo.device)
    strategy = cfg.sharding.strategy
    s = plan.strategy_plan(cfg, topo, shape, strategy)
    return plan_time.predict_step(cfg, topo, shape, s, strategy, device)


def measured_steps(run_dir: Path, record: RunRecord) -> list[float]:
    """The run's steady step times: every train step but the first of each attempt."""
    rows = read_rows(run_dir / rundir.METRICS_FILE, whole_lines_only=True).train
    start = record.start_step or 0
    return [r.step_time_s for r in rows if r.step not in (1, start + 1)]


def departure(ratio: float, predicted: dict, profile: dict | None) -> str:
    """Where the run departs from the prediction, in one phrase."""
    if profile is not None:
        gaps = {
            name: (profile.get(key, 0.0), predicted[key])
            for name, key in (("compute", "compute_s"), ("exposed communication", "exposed_comm_s"))
        }
        idle = profile.get("idle_s", 0.0)
        step = profile.get("step_s", 0.0)
        worst = max(gaps, key=lambda k: abs(gaps[k][0] - gaps[k][1]))
        got, want = gaps[worst]
        if step and idle / step > 0.2 and idle > abs(got - want):
            return f"idle {idle / step:.0%} of the step (the host: data, Python; not modelled)"
        if want > 0 and not 1 / DEPARTS <= got / want <= DEPARTS:
            where = {
                "compute": "the kernels: calibrate this machine (fsdp-lab calibrate)",
                "exposed communication": "the network or the overlap",
            }[worst]
            return f"{worst} {got / want:.2f}x the prediction: {where}"
    if not 1 / DEPARTS <= ratio <= DEPARTS:
        return (
            f"the step is {ratio:.2f}x the prediction; profile=trace splits it to show where"
            if profile is None
            else f"the step is {ratio:.2f}x the prediction"
        )
    return "as predicted"


UNMEASURED = "machine unmeasured"  # check()'s answer where there is nothing to compare with


def check(run_dir: Path, *, measure: bool = False, log=print) -> dict | str | None:
    """run.json's ``predicted`` for a finished run; None where it has too few steps;
    ``UNMEASURED`` where this machine has no profile to price it on."""
    record = rundir.read_run_file(run_dir)
    steps = measured_steps(run_dir, record)
    if len(steps) < MIN_STEPS:
        return None
    step = predict_run(run_dir, record, measure=measure, log=log)
    if step is None:
        priced = record.facts is not None and run_topology(record.facts) is not None
        return UNMEASURED if priced else None
    measured = statistics.median(steps)
    profile = record.results.profile if record.results else None
    summary = profile.get("summary") if isinstance(profile, dict) else None
    predicted = step.to_json()
    ratio = measured / step.step_s if step.step_s > 0 else float("inf")
    return {
        **predicted,
        "measured_step_s": measured,
        "measured_over_predicted": ratio,
        "measured_split": {k: summary.get(k) for k in ("compute_s", "exposed_comm_s", "idle_s")}
        if summary
        else None,
        "departs": departure(ratio, predicted, summary),
    }


def line(p: dict) -> str:
    return (
        f"step {p['measured_step_s'] * 1e3:.1f} ms measured, {p['step_s'] * 1e3:.1f} ms "
        f"predicted on {p['device']} ({p['measured_over_predicted']:.2f}x): {p['departs']}"
    )


class RunCheck(Callback):
    """Hydra's hook after each job: the run against its predicted step, into run.json."""

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        if os.environ.get("RANK", "0") != "0":  # under torchrun every rank runs Hydra
            return
        # Measured here only where this process launched the ranks itself (they are done, the
        # machine is the run's): under torchrun or srun other processes hold the node.
        local = "RANK" not in os.environ and "SLURM_PROCID" not in os.environ
        say = lambda line: print(f"fsdp_lab: {line}", file=sys.stderr)
        try:
            run_dir = Path(str(job_return.hydra_cfg.hydra.runtime.output_dir))
            if not (run_dir / rundir.RUN_FILE).is_file():
                return
            predicted = check(run_dir, measure=local, log=say)
            if predicted == UNMEASURED:
                if not local:  # a local run's measuring has said why it did not
                    say(
                        "no predicted step: this machine is unmeasured (fsdp-lab calibrate "
                        "measures it, in seconds; a local run does so itself)"
                    )
                return
            if predicted is None:
                return
            record = rundir.read_run_file(run_dir)
            if record.results is None:
                return
            record.results.predicted = predicted
            rundir.write_run_file(run_dir, record)
        except (ConfigError, OSError, ValueError, KeyError) as e:
            print(f"fsdp_lab: warning: no predicted step for this run: {e}", file=sys.stderr)
            return
        print(f"fsdp_lab: {line(predicted)}", file=sys.stderr)
