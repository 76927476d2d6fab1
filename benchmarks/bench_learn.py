"""`fsdp-lab calibrate --from-runs` out of sample: one calibrate of this machine, 16 CPU runs with
profile=trace (three models, the strategies, checkpointing, LoRA, accumulation, batch and
length), learn from 8 of them, predict the other 8, and the error before and after.

    python benchmarks/bench_learn.py                  # ~8 min on 2 cores
    python benchmarks/bench_learn.py --profile P2.json

The split is fixed (every other setup in the list below learns), so a rerun compares alike.
Results go to benchmarks/results/cpu-<date>-learn.json and a markdown table on stdout
(docs/benchmarks.md, "Learning from your runs").
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_time_model import COMMON, LLAMA, MOE, QWEN2, calibrate  # noqa: E402

from fsdp_lab.config.device_rows import device_profile  # noqa: E402
from fsdp_lab.planning import learn  # noqa: E402

SETUPS = {
    "a-full": [*LLAMA],
    "a-grad_op": [*LLAMA, "sharding=grad_op"],
    "a-ac": [*LLAMA, "activation_checkpointing=full"],
    "a-op": [*LLAMA, "activation_checkpointing=op"],
    "a-lora": [*LLAMA, "finetune=lora"],
    "a-accum2": [*LLAMA, "trainer.grad_accum_steps=2"],
    "a-batch2": [*LLAMA, "trainer.micro_batch_size=2"],
    "a-seq512": [
        *LLAMA,
        "trainer.seq_len=512",
        "model.max_position_embeddings=512",
        "trainer.micro_batch_size=2",
    ],
    "b-full": [*QWEN2],
    "b-no_shard": [*QWEN2, "sharding=no_shard"],
    "b-ac": [*QWEN2, "activation_checkpointing=full"],
    "b-lora": [*QWEN2, "finetune=lora"],
    "b-seq256": [*QWEN2, "trainer.seq_len=256", "trainer.micro_batch_size=4"],
    "moe-full": [*MOE],
    "moe-ep2": [*MOE, "parallel.expert=2"],
    "moe-ac": [*MOE, "activation_checkpointing=full"],
}


def run(tmp: Path, name: str, args: list[str], steps: int) -> Path:
    """A traced run (profile=trace's window, steps 5-7) of ``steps`` steps."""
    run_dir = tmp / name
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *COMMON, *args,
           f"trainer.max_steps={steps}", "profile=trace", "hardware.profile=cpu"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-2000:]}")
    return run_dir


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", type=Path, help="a 2-rank profile (default: calibrate now)")
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        path = a.profile or calibrate(tmp / "cpu2.json", 2, 30.0)
        base = device_profile(str(path))
        names = list(SETUPS)
        dirs = {}
        for n in names:
            dirs[n] = run(tmp, n, SETUPS[n], a.steps)
            print(f"ran {n}", file=sys.stderr, flush=True)
        learns = names[0::2]  # the other half checks
        observed = {n: learn.observe(dirs[n], base) for n in names}
        learned = learn.fit([observed[n] for n in learns])
        refined = learn.refined(base, learned, [dirs[n] for n in learns])
        rows = []
        for n in names:
            o = observed[n]
            rows.append({
                "setup": n,
                "role": "learn" if n in learns else "check",
                "measured_s": round(o.step_s, 4),
                "before_s": round(learn.predicted_step(o, base), 4),
                "after_s": round(learn.predicted_step(o, refined), 4),
                "before_error": round(learn.predicted_step(o, base) / o.step_s - 1, 3),
                "after_error": round(learn.predicted_step(o, refined) / o.step_s - 1, 3),
            })  # fmt: skip
    record = {"date": time.strftime("%Y-%m-%d"), "learned": learned, "rows": rows}
    out = ROOT / "benchmarks" / "results" / f"cpu-{record['date']}-learn.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(render(record))
    print(f"\n({out})")


def render(record: dict) -> str:
    lines = ["| setup | role | measured s | predicted before | after | error before | after |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for r in record["rows"]:
        lines.append(f"| {r['setup']} | {r['role']} | {r['measured_s']:.3f} | "
                     f"{r['before_s']:.3f} | {r['after_s']:.3f} | {100 * r['before_error']:+.1f}% "
                     f"| {100 * r['after_error']:+.1f}% |")  # fmt: skip
    checks = [r for r in record["rows"] if r["role"] == "check"]
    before = statistics.median(abs(r["before_error"]) for r in checks)
    after = statistics.median(abs(r["after_error"]) for r in checks)
    k = record["learned"]
    lines += ["", f"Learned from the 8 `learn` runs: kernels {k['compute_scale']:.2f}x, exposed "
              f"communication {k['comm_scale']:.2f}x, {1e3 * k['host_s']:.1f} ms of host time a "
              f"step. On the 8 `check` runs it never saw: median |error| {100 * before:.1f}% "
              f"before, {100 * after:.1f}% after."]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
