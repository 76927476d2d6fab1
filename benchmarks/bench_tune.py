"""`fsdp-lab tune` against the grid it searches: does it find the grid's best, and how fast?

    python benchmarks/bench_tune.py                   # ~60M Llama, 2 CPU ranks, 12 candidates
    python benchmarks/bench_tune.py --repeats 3 --steps 8 --budget-gib 2.0 --seq 128

The grid: sharding full, grad_op, no_shard x activation checkpointing none, full x micro-batch
2, 4 (12 candidates) of a ~60M-parameter Llama (hidden 768, 8 layers, vocabulary 4096, fp32,
seq 256 unless --seq) on 2 CPU ranks. The budget defaults to the predicted peak of sharding=full
without checkpointing at micro-batch 4 (+16 MiB): near the no-checkpointing peaks, so some
candidates fit and some do not.

1. `tune` itself (3 probes), timed end to end.
2. Every candidate of the grid, `--repeats` times, interleaved (candidate order rotated per
   repeat: run-to-run spread on this machine is about +-10%), each the same probe tune runs.
   The grid's best: the highest mean tokens/s among those measured within the budget.
3. The default config (sharding=full, no checkpointing, micro-batch 4) if it fits.

Writes benchmarks/results/cpu-<date>-tune.md and prints it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_lab.planning import tune, tune_probes  # noqa: E402

MODEL = [
    "hardware=cpu",
    "model.hidden_size=768",
    "model.intermediate_size=2048",
    "model.num_layers=8",
    "model.num_heads=12",
    "model.vocab_size=4096",
]
GRID = tune.Grid.parse("full,grad_op,no_shard", "none,full", "2,4", "1")
DEFAULT = "sharding=full activation_checkpointing=none offload=none trainer.micro_batch_size=4"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget-gib", type=float, help="default: near the no-checkpointing peak")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--probes", type=int, default=3)
    p.add_argument("--seq", type=int, default=256)
    a = p.parse_args()
    model = [*MODEL, f"trainer.seq_len={a.seq}"]
    candidates, device, _ = tune.enumerate_candidates(model, 4, GRID)
    baseline = tune.process_baseline_bytes(device)
    by_name = {c.name: c for c in candidates}
    budget_gib = a.budget_gib
    if budget_gib is None:
        c = by_name[DEFAULT]
        fit = tune_probes.predicted_bytes(c.plan_peak_bytes, baseline) + 16 * tune.MIB
        budget_gib = round(fit / tune.GIB, 3)
    budget = int(budget_gib * tune.GIB)
    env = tune.MALLOC_ENV
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        result = tune.tune(
            model,
            budget_gib,
            out_dir=Path(tmp) / "tune",
            probes=a.probes,
            steps=a.steps,
            max_micro_batch=4,
            grid=GRID,
        )
        tune_s = time.perf_counter() - start
        tps: dict[str, list[float]] = {c.name: [] for c in candidates}
        peak: dict[str, int] = {}
        grid_start = time.perf_counter()
        for r in range(a.repeats):
            order = candidates[r % len(candidates) :] + candidates[: r % len(candidates)]
            for i, c in enumerate(order):
                probe = tune.Candidate(c.strategy, c.ac, c.offload, c.micro_batch)
                run_dir = Path(tmp) / f"grid-{r}-{i}"
                tune.probe(model, probe, run_dir, steps=a.steps, budget=budget, env=env)
                print(f"repeat {r} {c.name}: {probe.verdict} {tune._tps(probe)}", flush=True)
                if probe.tokens_per_s:
                    tps[c.name].append(probe.tokens_per_s)
                if probe.measured_bytes:
                    peak[c.name] = max(peak.get(c.name, 0), probe.measured_bytes)
        grid_s = time.perf_counter() - grid_start
    lines = [
        f"# fsdp-lab tune vs its grid ({time.strftime('%Y-%m-%d')}, 2 CPU ranks)",
        "",
        f"model: {' '.join(model)}; budget {budget_gib:g} GiB per "
        f"rank (peak RSS); grid of {len(candidates)}; {a.steps} steps per probe; "
        f"{a.repeats} interleaved repeats of the grid.",
        "",
        "| candidate | planned MiB | grid peak MiB | grid tokens/s (mean) | spread | fits |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    fits = {}
    for c in candidates:
        planned = tune_probes.predicted_bytes(c.plan_peak_bytes, result.baseline_bytes)
        values = tps[c.name]
        mean = statistics.mean(values) if values else None
        spread = (max(values) - min(values)) / mean if values and mean else None
        ok = c.name in peak and peak[c.name] <= budget
        if ok and mean:
            fits[c.name] = mean
        lines.append(
            f"| {c.name} | {planned / tune.MIB:.0f} | {peak.get(c.name, 0) / tune.MIB:.0f} | "
            f"{mean or 0:,.0f} | {'-' if spread is None else f'{spread:.0%}'} | "
            f"{'yes' if ok else 'no'} |"
        )
    best = max(fits, key=fits.get) if fits else None
    w = result.winner
    lines += [
        "",
        f"- tune's pick: `{w.name}`, {w.tokens_per_s:,.0f} tokens/s in its probe, "
        f"{fits.get(w.name, 0):,.0f} mean over the grid's repeats; tune took {tune_s:.0f} s "
        f"({a.probes} probes), the grid {grid_s:.0f} s ({len(candidates) * a.repeats} runs).",
        f"- the grid's best that fits: `{best}`, {fits.get(best, 0):,.0f} tokens/s; tune's pick "
        f"is {fits.get(w.name, 0) / fits[best]:.2f}x of it."
        if best
        else "- nothing fit",
        f"- the default ({DEFAULT}): "
        + (f"{fits[DEFAULT]:,.0f} tokens/s" if DEFAULT in fits else "does not fit the budget"),
    ]
    text = "\n".join(lines) + "\n"
    out = ROOT / "benchmarks" / "results" / f"cpu-{time.strftime('%Y-%m-%d')}-tune.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
