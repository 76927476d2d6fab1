"""`fsdp-lab tune [OVERRIDES] --memory-gib X`: the fastest FSDP setup that fits X GiB per rank.

    fsdp-lab tune model=local model.name_or_path=$HOME/smollm2 trainer.seq_len=512 --memory-gib 6

1. **Enumerate** sharding strategy x activation checkpointing (none, op, selective every 2,
   full) x offload (none, cpu; not on hardware=cpu, where it moves nothing) x micro-batch
   (powers of two up to ``--max-micro-batch``) x tensor-parallel degree (1, 2, 4, 8 dividing
   the ranks per node, where the model's TP plan takes it) x, for a mixture of experts,
   expert-parallel degree (1, 2, 4, 8 dividing its experts and the shard axis). Model, data,
   sequence length, ranks and precision are the overrides'; an axis the overrides set
   (``sharding=full``) is held there. With ``--keep-global-batch`` each candidate's
   grad_accum_steps makes up the overrides' global batch (micro-batches that cannot are left
   out).
2. **Drop** what the plan (``fsdp-lab plan``, no device) says exceeds the budget, with its margin:
   predicted peak = process baseline + ``SAFETY`` x the plan's peak + ``SLACK``.
3. **Probe** the first ``--probes`` (3) of the rest, fastest first as the time model predicts
   them (``fsdp-lab plan``'s step time on ``--device``: a named device or a profile ``fsdp-lab
   calibrate`` wrote of this machine), or all of them if fewer fit, on the real ranks: a few
   steps each, measuring peak memory and tokens/s. The model orders the probes; the
   measurements pick the winner, and tune says where the model's order was wrong. A probe
   over the budget (on CPU, its RSS; on GPU, a CUDA OOM) is a verdict, not a crash.
4. **Print** a table and the winning command; write ``tune.json``.

The budget's basis is what train.py reports as peak memory per rank: on CPU the resident-set
high-water mark (VmHWM) of each rank process, interpreter and imports included (the baseline is
measured here, in a fresh interpreter importing what a rank imports); on GPU the caching
allocator's peak (the CUDA context is outside it: baseline 0). On CPU every probe, and the
printed command, set ``hardware.malloc_mmap_threshold=131072`` (unless the overrides set it) so
that freed activation memory leaves the RSS (glibc's default keeps it: RSS then overstates live
tensors up to 2x, and the plan could not predict it).

This module runs the four stages; ``tune_grid`` enumerates the candidates and orders them,
``tune_probes`` predicts and measures, ``tune_output`` prints the table and writes tune.json.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from fsdp_lab.config import ConfigError, HardwareKind, compose
from fsdp_lab.planning import calibrate, machine, plan
from fsdp_lab.planning.tune_grid import Candidate, Grid, enumerate_candidates, probe_order
from fsdp_lab.planning.tune_output import (
    TuneResult,
    format_table,
    mib,
    nothing_fits,
    tokens_per_s,
    write_json,
)
from fsdp_lab.planning.tune_probes import (
    GIB,
    MIB,
    SAFETY,
    SLACK,
    command,
    host_overrides,
    predict,
    probe,
    process_baseline_bytes,
)


@dataclass
class _Search:
    """What the plan leaves to probe: the result so far and the candidates that fit it."""

    result: TuneResult
    fitting: list[Candidate]  # in probe order
    device: HardwareKind
    world: int


# Many parameters: the command line's, keyword-only.
def tune(
    overrides: list[str],
    memory_gib: float,
    *,
    out_dir: Path,
    probes: int = 3,
    steps: int = 6,
    max_micro_batch: int = 32,
    grid: Grid | None = None,
    log=print,
    device: str | None = None,
    measure: bool = False,
) -> TuneResult:
    """Enumerate, drop, probe, pick. ConfigError (exit 2) when nothing fits. ``measure``:
    measure this machine first where it is unmeasured (once the plan stands), so that the
    probes are ordered on its figures."""
    budget = int(memory_gib * GIB)
    search = _plan(overrides, budget, max_micro_batch, grid, device)  # 1) enumerate, 2) drop
    if measure and device is None and _measure_this_machine(overrides, log):
        search = _plan(overrides, budget, max_micro_batch, grid, device)
    result, fitting = search.result, search.fitting
    host = host_overrides(overrides, search.device)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(
        f"tune: {len(result.candidates)} candidates, {len(fitting)} fit {memory_gib:g} GiB per "
        f"rank by the plan (baseline {result.baseline_bytes / MIB:.0f} MiB + {SAFETY}x plan + "
        f"{SLACK // MIB} MiB); probing {min(probes, len(fitting))}, {steps} steps each"
    )
    probed = _probe_best(
        overrides, result, fitting, out_dir, probes, steps=steps, host=host, log=log
    )
    ok = [c for c in probed if c.verdict == "fits"]  # 4) the fastest that fits
    if probed and not ok and all(c.verdict.startswith("failed") for c in probed):
        # Not a memory answer: the runs themselves are refused (hardware, a setting).
        raise ConfigError(
            f"all {len(probed)} probe(s) failed before measuring anything; the first "
            f"({probed[0].run_dir}): {probed[0].verdict.removeprefix('failed: ')}"
        )
    if not ok:
        world, device = search.world, search.device
        raise ConfigError(nothing_fits(probed or fitting, budget, world, device, measured=True))
    result.winner = max(ok, key=lambda c: c.tokens_per_s or 0.0)  # measured, not predicted
    result.order_errors = order_errors(probed)
    for e in result.order_errors:
        log(f"  the model's order was wrong: {e}")
    if len(ok) > 1 and not result.order_errors:
        log(f"  the model's order held over the {len(ok)} probes that fit")
    result.command = command(overrides, result.winner, host)
    return result


def _plan(
    overrides: list[str], budget: int, max_micro_batch: int, grid: Grid | None, device: str | None
) -> _Search:
    """Every candidate with its predicted peak and step; those over the budget dropped.
    ConfigError when none is possible or none fits."""
    candidates, device, world = enumerate_candidates(overrides, max_micro_batch, grid, device)
    if not candidates:
        raise ConfigError("no FSDP setup of these overrides is possible on this topology")
    predict(candidates, 0)  # without the process's own memory: nothing fits already?
    if all(c.planned_bytes > budget for c in candidates):
        raise ConfigError(nothing_fits(candidates, budget, world, device, measured=False))
    baseline = process_baseline_bytes(device)
    predict(candidates, baseline)
    keep = grid is not None and grid.keep_global_batch
    result = TuneResult(budget, baseline, candidates, keep)
    fitting = probe_order([c for c in candidates if c.planned_bytes <= budget])
    for c in candidates:
        if c.planned_bytes > budget:
            c.verdict = "dropped (plan)"
    if not fitting:
        raise ConfigError(nothing_fits(candidates, budget, world, device, measured=False))
    return _Search(result, fitting, device, world)


def _probe_best(
    overrides: list[str],
    result: TuneResult,
    fitting: list[Candidate],
    out_dir: Path,
    probes: int,
    *,
    steps: int,
    host: list[str],
    log,
) -> list[Candidate]:
    """Probe the first ``probes`` of fitting that still fit (a probe that measures more than
    its prediction raises the baseline, which may drop later ones); the probed, in order.
    Every one is run: one probe measured says nothing of how right the order was."""
    budget, probed = result.budget_bytes, []
    for c in fitting:
        if len(probed) == probes:
            c.verdict = f"not probed (beyond the {probes} fastest predicted)"
            continue
        if c.planned_bytes > budget:  # after a probe measured more than the plan's basis
            c.verdict = "dropped (plan + measured baseline)"
            continue
        probe(overrides, c, out_dir / f"probe-{len(probed)}", steps=steps, budget=budget, host=host)
        probed.append(c)
        predicted = f"predicted {c.predicted_tokens_per_s or 0:,.0f}{ratio(c)}"
        log(
            f"  probe {len(probed) - 1}: {c.name}: {c.verdict}, {mib(c.measured_bytes)} MiB, "
            f"{tokens_per_s(c)}, {predicted}"
        )
        if c.measured_bytes is not None and c.measured_bytes - c.planned_bytes > 0:
            # the process holds more than the baseline guessed: raise it for the rest
            result.baseline_bytes += c.measured_bytes - c.planned_bytes
            predict(result.candidates, result.baseline_bytes)
    return probed


def ratio(c: Candidate) -> str:
    """`` (measured 0.83x)``: a probe's measured tokens/s over its predicted ones."""
    if not c.tokens_per_s or not c.predicted_tokens_per_s:
        return ""
    return f" (measured {c.tokens_per_s / c.predicted_tokens_per_s:.2f}x)"


def order_errors(probed: list[Candidate]) -> list[str]:
    """Each pair of probes that fit whose measured order is the reverse of the predicted one,
    as a phrase (none: the model ranked them right)."""
    ok = [c for c in probed if c.verdict == "fits" and c.tokens_per_s and c.predicted_tokens_per_s]
    out = []
    for i, a in enumerate(ok):
        for b in ok[i + 1 :]:  # a was predicted at least as fast as b (probe order)
            faster, predicted_slower = (
                b.tokens_per_s > a.tokens_per_s,
                (b.predicted_tokens_per_s < a.predicted_tokens_per_s),
            )
            if faster and predicted_slower:
                out.append(
                    f"{b.name} measured {b.tokens_per_s:,.0f} tokens/s against {a.name}'s "
                    f"{a.tokens_per_s:,.0f}, predicted {b.predicted_tokens_per_s:,.0f} against "
                    f"{a.predicted_tokens_per_s:,.0f}"
                )
    return out


def _measure_this_machine(overrides: list[str], log) -> bool:
    """Whether this machine's profile for the overrides' ranks was measured now (none was
    cached: a few seconds), so that the probes are ordered on it, not on a named row's."""

    cfg = compose(overrides)
    topo, _ = plan.topology(cfg)
    if not plan.on_this_machine(topo) or machine.cached(cfg, topo) is not None:
        return False
    return machine.ensure(cfg, topo, lambda: calibrate.quick(cfg, topo), log=log) is not None


def tune_command(
    overrides: list[str],
    memory_gib: float,
    *,
    out_dir: Path | None,
    probes: int,
    steps: int,
    max_micro_batch: int,
    grid: Grid | None = None,
    device: str | None = None,
) -> int:
    if memory_gib <= 0:
        raise ConfigError(f"--memory-gib {memory_gib}: give the budget per rank in GiB, > 0")
    if probes < 1 or steps < 3:
        raise ConfigError("--probes must be >= 1 and --steps >= 3 (tokens/s skips the first)")
    out_dir = out_dir or Path("outputs") / "tune" / time.strftime("%Y-%m-%d/%H-%M-%S")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ConfigError(f"{out_dir} already holds files: pick a new --out")
    start = time.perf_counter()
    result = tune(
        overrides,
        memory_gib,
        out_dir=out_dir,
        probes=probes,
        steps=steps,
        max_micro_batch=max_micro_batch,
        grid=grid,
        device=device,
        measure=True,
    )
    write_json(result, out_dir / "tune.json", overrides)
    print(format_table(result))
    w = result.winner
    print(
        f"\nfastest that fits {memory_gib:g} GiB per rank: {w.name} "
        f"({tokens_per_s(w)}, peak {mib(w.measured_bytes)} MiB; tune took "
        f"{time.perf_counter() - start:.0f} s; {out_dir / 'tune.json'})"
    )
    print(result.command)
    return 0
