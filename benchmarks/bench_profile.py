"""What profile=trace costs: the same run with profile=none and profile=trace, side by side.

    python benchmarks/bench_profile.py                 # 2 CPU ranks, about 7M params
    python benchmarks/bench_profile.py --rounds 3 --layers 8

The runs alternate (none, trace, none, ...) so drift in machine speed hits both. Per round each
side's step times come from metrics.jsonl (the loop's own timing); reported as medians over
rounds of each side's median step time:

- outside the window (steps 2 to the warm-up step, and after the window): trace / none should
  be 1.00 — the profiler records nothing there and the loop does what profile=none does;
- inside the window (the recorded steps): the profiler's cost while it records;
- the window's analysis (``analysis_s`` in run.json: every rank reads its trace back and splits
  its steps) and the size of a rank's trace.
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

from fsdp_lab.observe.run_logs import read_metrics  # noqa: E402

WAIT, WARMUP, ACTIVE = 8, 1, 5


def run(tmp: Path, name: str, a, profile: str) -> tuple[dict[int, float], dict]:
    run_dir = tmp / name
    cmd = [
        sys.executable,
        "train.py",
        f"hydra.run.dir={run_dir}",
        "hardware=cpu",
        "debug=smoke",
        f"trainer.max_steps={a.steps}",
        "trainer.log_every=10",
        f"trainer.seq_len={a.seq}",
        f"model.max_position_embeddings={a.seq}",
        "model.hidden_size=256",
        f"model.num_layers={a.layers}",
        "model.num_heads=8",
        "model.num_kv_heads=4",
        "model.intermediate_size=768",
        "model.vocab_size=8192",
        f"profile={profile}",
        f"profile.wait={WAIT}",
        f"profile.warmup={WARMUP}",
        f"profile.active={ACTIVE}",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    times = {r["step"]: r["step_time_s"] for r in read_metrics(run_dir / "metrics.jsonl")}
    facts = json.loads((run_dir / "run.json").read_text())
    return times, facts.get("profile", {})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    a = p.parse_args()
    first = WAIT + WARMUP + 1
    window = set(range(first, first + ACTIVE))
    outside = [s for s in range(2, a.steps + 1) if s not in window and s != first - 1]
    sides: dict[str, dict[str, list[float]]] = {
        "none": {"out": [], "in": []},
        "trace": {"out": [], "in": []},
    }
    analysis, trace_mb = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for side in ("none", "trace"):
                times, profile = run(Path(tmp), f"{side}{r}", a, side)
                sides[side]["out"].append(statistics.median(times[s] for s in outside))
                sides[side]["in"].append(statistics.median(times[s] for s in window))
                if profile:
                    analysis.append(profile["analysis_s"])
                    trace_mb.append(
                        (Path(tmp) / f"{side}{r}/profile/rank0.trace.json.gz").stat().st_size
                        / 2**20
                    )
            print(
                f"round {r}: "
                + ", ".join(
                    f"{k} {v['out'][-1] * 1000:.1f}/{v['in'][-1] * 1000:.1f} ms"
                    for k, v in sides.items()
                ),
                flush=True,
            )
    med = {k: {w: statistics.median(v[w]) for w in v} for k, v in sides.items()}
    print("\n| | profile=none | profile=trace | trace / none |\n|---|---|---|---|")
    for w, label in (
        ("out", "steps outside the window"),
        ("in", f"steps {first}-{first + ACTIVE - 1} (the window)"),
    ):
        n, t = med["none"][w], med["trace"][w]
        print(f"| {label}, ms/step | {n * 1000:.1f} | {t * 1000:.1f} | {t / n:.3f} |")
    print(
        f"\nanalysis of the window (every rank): {statistics.median(analysis):.2f} s; "
        f"rank 0's trace {statistics.median(trace_mb):.1f} MB gzipped; {a.layers} layers, "
        f"2 ranks, seq {a.seq}, median of {a.rounds} rounds"
    )


if __name__ == "__main__":
    main()
