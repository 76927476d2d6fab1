"""The time model against measured steps on CPU ranks (gloo), calibrated once: one `fsdp-lab
calibrate` per rank count at calibrate's own sizes (never a model's), then every setup's
predicted step beside the median step of a real run (steps after the first two), twice (a
second sweep in reverse order: the machine's own drift, stated beside the errors).

    python benchmarks/bench_time_model.py                     # ~25 min on 2 cores
    python benchmarks/bench_time_model.py --only a-full-2 moe-ep2-2 --sweeps 1
    python benchmarks/bench_time_model.py --profiles P2.json P4.json   # skip calibrating
    python benchmarks/bench_time_model.py --first-runs 5       # and 5 fresh machines' first run

The setups' three models share no shape with calibrate's grid or with each other: a Llama
(hidden 192, 6 layers), a Qwen2 (hidden 320, 4 layers, 512 tokens) and a Qwen3-MoE (hidden
128, 16 experts, top 4). They cover the five strategies, 2 and 4 ranks, TP 2, CP 2, EP 2,
LoRA, activation checkpointing, offload and accumulation. Results go to
benchmarks/results/cpu-<date>-time-model.json and a markdown table on stdout
(docs/benchmarks.md, "The time model").
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_lab.planning import plan  # noqa: E402

LLAMA = ["model.hidden_size=192", "model.intermediate_size=512", "model.num_layers=6",
         "model.num_heads=6", "model.num_kv_heads=2", "trainer.seq_len=256",
         "trainer.micro_batch_size=4"]  # fmt: skip
QWEN2 = ["model=qwen2_tiny", "model.hidden_size=320", "model.intermediate_size=864",
         "model.num_layers=4", "model.num_heads=5", "model.num_kv_heads=1",
         "trainer.seq_len=512", "model.max_position_embeddings=512",
         "trainer.micro_batch_size=2"]  # fmt: skip
MOE = ["model=qwen3_moe_tiny", "model.hidden_size=128", "model.num_layers=4",
       "model.num_experts=16", "model.experts_per_token=4", "model.expert_intermediate_size=192",
       "model.experts_implementation=grouped_mm", "trainer.seq_len=256",
       "trainer.micro_batch_size=4"]  # fmt: skip
FOUR = "hardware.nproc_per_node=4"
COMMON = [
    "hardware=cpu",
    "trainer.eval_every=0",
    "trainer.log_every=1",
    "checkpoint=none",
    "logger=none",
    "trainer.progress_bar=false",
]
SETUPS = {
    "a-full-2": [*LLAMA],
    "a-grad_op-2": [*LLAMA, "sharding=grad_op"],
    "a-no_shard-2": [*LLAMA, "sharding=no_shard"],
    "a-full-4": [*LLAMA, FOUR],
    "a-hybrid-4": [*LLAMA, FOUR, "sharding=hybrid"],
    "a-hybrid_zero2-4": [*LLAMA, FOUR, "sharding=hybrid_zero2"],
    "a-ac-2": [*LLAMA, "activation_checkpointing=full"],
    "a-offload-2": [*LLAMA, "offload=cpu"],
    "a-lora-2": [*LLAMA, "finetune=lora"],
    "a-tp2-2": [*LLAMA, "parallel.tensor=2"],
    "a-cp2-2": [*LLAMA, "parallel.context=2"],
    "a-accum2-2": [*LLAMA, "trainer.grad_accum_steps=2"],
    "b-full-2": [*QWEN2],
    "b-grad_op-2": [*QWEN2, "sharding=grad_op"],
    "b-full-4": [*QWEN2, FOUR],
    "b-ac-2": [*QWEN2, "activation_checkpointing=full"],
    "b-lora-2": [*QWEN2, "finetune=lora"],
    "moe-full-2": [*MOE],
    "moe-ep2-2": [*MOE, "parallel.expert=2"],
}


def ranks(setup: list[str]) -> int:
    return 4 if FOUR in setup else 2


def calibrate(out: Path, nproc: int, seconds: float) -> Path:
    """`fsdp-lab calibrate` at its own sizes on ``nproc`` ranks, as a user runs it."""
    cmd = [sys.executable, "-m", "fsdp_lab.tools.cli", "calibrate", "hardware=cpu",
           f"hardware.nproc_per_node={nproc}", "--out", str(out),
           "--seconds", str(seconds)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"calibrate on {nproc} ranks failed:\n{proc.stderr[-2000:]}")
    print(proc.stdout, file=sys.stderr)
    return out


def measure(tmp: Path, name: str, args: list[str], steps: int) -> float:
    """A real run's median step time (steps after the first two)."""
    run_dir = tmp / f"{name}-{time.monotonic_ns()}"
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *args,
           f"trainer.max_steps={steps}", "hardware.profile=cpu"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [
        r["step_time_s"] for r in rows if r.get("split", "train") == "train" and "step_time_s" in r
    ]
    return statistics.median(times[2:])


def first_run(tmp: Path, n: int) -> dict:
    """A fresh machine's first `python train.py`, ``n`` times: no cached profile, so each
    run measures this machine after it ends and prints its step beside the prediction."""
    lines, ratios, seconds = [], [], []
    for i in range(n):
        cache = tmp / f"fresh-cache-{i}"
        cmd = [sys.executable, "train.py", f"hydra.run.dir={tmp / f'first-{i}'}", "logger=none",
               "trainer.progress_bar=false", f"hardware.profile_cache={cache}"]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
        line = next((x for x in proc.stderr.splitlines() if "predicted on" in x), "")
        ratio = re.search(r"\((\d+\.\d+)x\)", line)
        lines.append(line)
        ratios.append(float(ratio.group(1)) if ratio else None)
        seconds.append(round(time.perf_counter() - start, 1))
    return {"lines": lines, "ratios": ratios, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=list(SETUPS))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--sweeps", type=int, default=2)
    p.add_argument("--seconds", type=float, default=30.0, help="calibrate's budget (30)")
    p.add_argument("--profiles", nargs=2, type=Path, metavar=("P2", "P4"),
                   help="profiles of 2 and 4 ranks to use instead of calibrating")  # fmt: skip
    p.add_argument("--first-runs", type=int, default=0,
                   help="also this many fresh machines' first runs")  # fmt: skip
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    names = a.only or list(SETUPS)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        first = first_run(tmp, a.first_runs) if a.first_runs else None
        if a.profiles:
            profiles = dict(zip((2, 4), a.profiles, strict=True))
        else:
            needed = sorted({ranks(SETUPS[n]) for n in names})
            profiles = {r: calibrate(tmp / f"cpu{r}.json", r, a.seconds) for r in needed}
        predicted = {
            n: plan.build_plan(
                [*COMMON, *SETUPS[n]], str(profiles[ranks(SETUPS[n])])
            ).chosen_plan.time
            for n in names
        }
        measured: dict[str, list[float]] = {n: [] for n in names}
        for sweep in range(a.sweeps):
            for n in names if sweep % 2 == 0 else reversed(names):
                measured[n].append(measure(tmp, n, [*COMMON, *SETUPS[n]], a.steps))
                m = measured[n][-1]
                print(f"sweep {sweep + 1} {n}: predicted {predicted[n].step_s:.3f} s, measured"
                      f" {m:.3f} s, {100 * (predicted[n].step_s / m - 1):+.1f}%",
                      file=sys.stderr, flush=True)  # fmt: skip
        saved = {r: json.loads(Path(path).read_text()) for r, path in profiles.items()}
    rows = []
    for n in names:
        t, ms = predicted[n], measured[n]
        rows.append({
            "setup": n,
            "overrides": SETUPS[n],
            "predicted_s": round(t.step_s, 4),
            "measured_s": [round(m, 4) for m in ms],
            "errors": [round(t.step_s / m - 1, 3) for m in ms],
            "split": {k: round(getattr(t, k), 4) for k in
                      ("compute_s", "exposed_comm_s", "optimizer_s", "other_s")},
        })  # fmt: skip
    drift = [
        abs(r["measured_s"][1] / r["measured_s"][0] - 1) for r in rows if len(r["measured_s"]) > 1
    ]
    record = {
        "date": time.strftime("%Y-%m-%d"),
        "host": platform.node(),
        "cores": os.cpu_count(),
        "rows": rows,
        "first_run": first,
        "sweep_drift_median": statistics.median(drift) if drift else None,
        "profiles": saved,
    }
    out = a.out or ROOT / "benchmarks" / "results" / f"cpu-{record['date']}-time-model.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(render(record))
    print(f"\n({out})")


def render(record: dict) -> str:
    """The markdown table docs/benchmarks.md holds, from a results JSON."""
    rows = record["rows"]
    sweeps = max(len(r["measured_s"]) for r in rows)
    head = " | ".join(f"measured s ({i + 1})" for i in range(sweeps))
    errs = " | ".join(f"error ({i + 1})" for i in range(sweeps))
    out = [f"| setup | overrides | predicted s | {head} | {errs} |",
           "| --- | --- | ---: |" + " ---: |" * (2 * sweeps)]  # fmt: skip
    for r in rows:
        model = r["setup"].split("-")[0]
        extra = " ".join(
            o for o in r["overrides"] if o not in {"a": LLAMA, "b": QWEN2, "moe": MOE}[model]
        )
        measured = " | ".join(f"{m:.3f}" for m in r["measured_s"])
        errors = " | ".join(f"{100 * e:+.1f}%" for e in r["errors"])
        out.append(f"| {r['setup']} | `{extra or 'sharding=full'}` | {r['predicted_s']:.3f} | "
                   f"{measured} | {errors} |")  # fmt: skip
    all_errors = [abs(e) for r in rows for e in r["errors"]]
    within = sum(all(abs(e) <= 0.2 for e in r["errors"]) for r in rows)
    out.append("")
    out.append(
        f"{within} of {len(rows)} setups within +-20% in every sweep; median |error| "
        f"{100 * statistics.median(all_errors):.1f}%, worst {100 * max(all_errors):.1f}%"
    )
    if record.get("sweep_drift_median") is not None:
        drift = 100 * record["sweep_drift_median"]
        out.append(f"the same setup's two sweeps differ by {drift:.1f}% (median): the machine's "
                   "own noise")  # fmt: skip
    if record.get("first_run"):
        f = record["first_run"]
        ratios = ", ".join(f"{r:.2f}x" for r in f["ratios"] if r is not None)
        out.append(f"a fresh machine's first `python train.py` ({len(f['ratios'])} fresh caches): "
                   f"measured over predicted {ratios}")  # fmt: skip
    return "\n".join(out)


if __name__ == "__main__":
    main()
