"""Context parallelism on a long sequence: per-rank memory at CP 1, 2 and 4 against the plan,
step time at the same global tokens, CP's share of the step from profile=trace, and a sequence
that fits a per-rank memory limit at CP 4 and not at CP 1 (the plan says so first).

    python benchmarks/bench_context_parallel.py                     # 16k tokens, ~8 min on 2 cores
    python benchmarks/bench_context_parallel.py --seq 8192 --steps 3

Every run trains the same Llama (hidden 256, 4 layers, 4 heads / 2 KV heads) on one sequence a
step (CP N on N ranks: one CP group, the same global tokens), fp32, sharding=full, with
``hardware.malloc_mmap_threshold`` so that RSS follows live tensors. Memory: each rank's peak
RSS over the steps less its RSS before the first (what the plan's peak less the parameters
predicts, as tests/integration/test_plan_runs.py measures it). The limit is RLIMIT_DATA on
every rank (``prlimit --data``), chosen from the plan as `fsdp-lab tune` sizes a budget: the
process's own baseline + 1.15 x the plan + 96 MiB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_lab.config import HardwareKind  # noqa: E402
from fsdp_lab.observe.run_logs import read_metrics  # noqa: E402
from fsdp_lab.planning import plan, tune_probes  # noqa: E402

MIB = 2**20


def overrides(a, context: int) -> list[str]:
    return [
        "hardware=cpu",
        f"hardware.nproc_per_node={context}",
        f"parallel.context={context}",
        f"trainer.seq_len={a.seq}",
        f"model.max_position_embeddings={a.seq}",
        "trainer.micro_batch_size=1",
        "model.hidden_size=256",
        "model.intermediate_size=1024",
        "model.num_layers=4",
        "trainer.eval_every=0",
        "trainer.log_every=1",
        "checkpoint=none",
        "logger=none",
        "trainer.progress_bar=false",
        "hardware.malloc_mmap_threshold=131072",
    ]


def planned(a, context: int) -> tuple[int, int]:
    """(the plan's peak less the parameters on rank 0, its peak) in bytes."""
    s = plan.build_plan([*overrides(a, context), f"trainer.max_steps={a.steps}"]).chosen_plan
    return s.peak_over_start(0), s.peak


def train(run_dir: Path, args: list[str], limit: int | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *args]
    if limit is not None:
        cmd = ["prlimit", f"--data={limit}", *cmd]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)


def measure(tmp: Path, a, context: int) -> dict:
    """Steps of CP ``context``: each rank's measured memory, the median step time."""
    run_dir = tmp / f"cp{context}"
    proc = train(run_dir, [*overrides(a, context), f"trainer.max_steps={a.steps}"])
    if proc.returncode != 0:
        raise SystemExit(f"CP {context} failed:\n{proc.stderr[-2000:]}")
    facts = json.loads((run_dir / "run.json").read_text())
    steps = read_metrics(run_dir / "metrics.jsonl")
    before = facts["memory_before_train_bytes_per_rank"]
    measured = [
        max(r["peak_mem_bytes_per_rank"][rank] for r in steps) - before[rank]
        for rank in range(context)
    ]
    plan_less, plan_peak = planned(a, context)
    return {
        "context": context,
        "measured_mib": [round(m / MIB, 1) for m in measured],
        "plan_mib": round(plan_less / MIB, 1),
        "ratio": round(max(measured) / plan_less, 3),
        "plan_peak_mib": round(plan_peak / MIB, 1),
        "step_s": statistics.median(r["step_time_s"] for r in steps[1:]),
        "loss": [r["loss"] for r in steps],
    }


def profile(tmp: Path, a, context: int) -> dict:
    """CP's share of a profiled step: its collectives' time, and FSDP's, per step."""
    run_dir = tmp / f"profile{context}"
    args = [
        *overrides(a, context),
        "trainer.max_steps=3",
        "profile=trace",
        "profile.wait=1",
        "profile.warmup=0",
        "profile.active=2",
    ]
    proc = train(run_dir, args)
    if proc.returncode != 0:
        raise SystemExit(f"profile CP {context} failed:\n{proc.stderr[-2000:]}")
    p = json.loads((run_dir / "run.json").read_text())["profile"]
    cp = sum(u["time_s"] for u in p["units"] if u["kind"].startswith("context_"))
    fsdp = sum(u["time_s"] for u in p["units"] if not u["kind"].startswith("context_"))
    step = p["summary"]["step_s"]
    return {
        "step_s": step,
        "cp_comm_s": cp,
        "cp_share": cp / step,
        "other_comm_s": fsdp,
        "compute_share": p["summary"]["compute_share"],
    }


def limit_check(tmp: Path, a, results: dict) -> dict:
    """A per-rank limit the plan says CP 4 fits and CP 1 does not, then both run under it."""
    baseline = tune_probes.process_baseline_bytes(HardwareKind.cpu)
    need = {
        c: tune_probes.predicted_bytes(r["plan_peak_mib"] * MIB, baseline)
        for c, r in results.items()
    }
    limit = -(-need[4] // (64 * MIB)) * 64 * MIB  # CP 4's budget, rounded up to 64 MiB
    if need[1] <= limit:
        raise SystemExit(f"the plan says CP 1 fits {limit // MIB} MiB too: use a longer --seq")
    out = {"limit_mib": limit // MIB, "plan_needs_mib": {c: n // MIB for c, n in need.items()}}
    for context in (1, 4):
        run_dir = tmp / f"limit{context}"
        args = [*overrides(a, context), "trainer.max_steps=2"]
        proc = train(run_dir, args, limit=limit)
        errors = [x for x in proc.stderr.splitlines() if "error" in x.lower()]
        out[f"cp{context}"] = {
            "exit": proc.returncode,
            "error": errors[-1][:200] if errors and proc.returncode else None,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", type=Path, help="write the results here too")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {c: measure(Path(tmp), a, c) for c in (1, 2, 4)}
        profiles = {c: profile(Path(tmp), a, c) for c in (2, 4)}
        limited = limit_check(Path(tmp), a, results)
    base = results[1]
    print(f"Llama hidden 256, 4 layers, one sequence of {a.seq} tokens a step, fp32, 2 CPU cores")
    print("| CP | ranks | measured MiB per rank | plan MiB | measured / plan | vs CP 1 | step s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for c, r in results.items():
        print(
            f"| {c} | {c} | {max(r['measured_mib'])} | {r['plan_mib']} | {r['ratio']} | "
            f"{max(r['measured_mib']) / max(base['measured_mib']):.2f} | {r['step_s']:.2f} "
            f"({r['step_s'] / base['step_s']:.2f}x) |"
        )
    print("| CP | profiled step s | CP collectives s | CP share | FSDP's and others' comm s |")
    print("| --- | --- | --- | --- | --- |")
    for c, r in profiles.items():
        print(
            f"| {c} | {r['step_s']:.2f} | {r['cp_comm_s']:.3f} | {r['cp_share']:.1%} | "
            f"{r['other_comm_s']:.3f} |"
        )
    print(
        f"per-rank limit {limited['limit_mib']} MiB (plan needs {limited['plan_needs_mib']}): "
        f"CP 1 exit {limited['cp1']['exit']} ({limited['cp1']['error']}); "
        f"CP 4 exit {limited['cp4']['exit']}"
    )
    losses = [round(r["loss"][0], 5) for r in results.values()]
    print(f"first-step loss at CP 1, 2, 4: {losses}")
    if a.json:
        a.json.write_text(
            json.dumps({"results": results, "profiles": profiles, "limit": limited}, indent=1)
        )


if __name__ == "__main__":
    main()
