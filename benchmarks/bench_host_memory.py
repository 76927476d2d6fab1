"""A CPU rank's host memory under glibc's own heap, trimmed each step, and a fixed mmap threshold.

    python benchmarks/bench_host_memory.py                     # 72M Qwen2, 2 ranks, 20 steps
    python benchmarks/bench_host_memory.py --steps 50 --freeze  # a frozen base, as issue 36 tried
    python benchmarks/bench_host_memory.py --steps 50 --lora    # LoRA on that base
    python benchmarks/bench_host_memory.py --jemalloc /usr/lib/x86_64-linux-gnu/libjemalloc.so.2

Each side trains the same model (a Qwen2 with tied embeddings: hidden 768, 8 layers, vocabulary
32000, seq 64, micro-batch 1) on 2 CPU ranks: glibc's own heap untouched
(`hardware.malloc_trim=false`), its free pages given back after each step
(`hardware.malloc_trim=true`, the default), and `hardware.malloc_mmap_threshold=131072`,
optionally jemalloc preloaded, in alternating rounds. Per side:
the peak RSS per rank (max over ranks) at a quarter of the run and at its end (does it settle?),
the median step time after the first two, and `fsdp-lab plan`'s peak plus the process's own
memory (RSS before the first step less its parameter shards) for comparison. Ratios are to
glibc's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_lab.observe.run_logs import read_metrics  # noqa: E402

MB = 2**20
MODEL = [
    "model=qwen2_tiny",
    "model.hidden_size=768",
    "model.intermediate_size=2048",
    "model.num_layers=8",
    "model.num_heads=12",
    "model.num_kv_heads=4",
    "model.vocab_size=32000",
    "trainer.seq_len=64",
    "trainer.micro_batch_size=1",
    "hardware=cpu",
]
FREEZE = ["finetune=freeze", "finetune.freeze_blocks=8", "finetune.freeze=[model.embed_tokens]"]
LORA = ["finetune=lora", "finetune.r=16"]


def run(tmp: Path, side: str, overrides: list[str], a) -> dict:
    run_dir = tmp / "".join(c if c.isalnum() else "_" for c in side)
    env = dict(os.environ)
    if side == "jemalloc":
        env["LD_PRELOAD"] = a.jemalloc
    threshold = "131072" if side == "fixed 131072" else "null"
    trim = "true" if side == "trim each step" else "false"
    subprocess.run(
        [
            sys.executable,
            "train.py",
            f"hydra.run.dir={run_dir}",
            *overrides,
            f"hardware.malloc_mmap_threshold={threshold}",
            f"hardware.malloc_trim={trim}",
            f"trainer.max_steps={a.steps}",
            "trainer.log_every=1",
            "trainer.eval_every=0",
            "trainer.progress_bar=false",
            "checkpoint=none",
            "logger=none",
        ],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
    )
    steps = read_metrics(run_dir / "metrics.jsonl")
    facts = json.loads((run_dir / "run.json").read_text())
    quarter = steps[max(len(steps) // 4 - 1, 0)]
    return {
        "rss_quarter": max(quarter["peak_mem_bytes_per_rank"]),
        "rss_end": max(steps[-1]["peak_mem_bytes_per_rank"]),
        "before": max(facts["memory_before_train_bytes_per_rank"]),
        "step_s": statistics.median(r["step_time_s"] for r in steps[2:]),
        "loss": steps[-1]["loss"],
    }


def plan_peak(overrides: list[str]) -> tuple[int, int]:
    """The plan's peak per rank and its parameter shard bytes (rank 0's)."""
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_lab.tools.cli", "plan", *overrides, "--json"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    chosen = json.loads(proc.stdout)
    chosen = chosen["strategies"][chosen["chosen"]]
    return chosen["peak"], chosen["rank0"]["params"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--freeze", action="store_true", help="freeze every block and the embeddings")
    p.add_argument("--lora", action="store_true", help="LoRA (r=16) on a frozen base")
    p.add_argument("--jemalloc", help="a libjemalloc.so to preload as a third side")
    a = p.parse_args()
    overrides = MODEL + (FREEZE if a.freeze else []) + (LORA if a.lora else [])
    sides = ["glibc's own", "trim each step", "fixed 131072"] + (["jemalloc"] if a.jemalloc else [])
    planned, shard = plan_peak(overrides)
    results: dict[str, list[dict]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for side in sides:
                results[side].append(run(Path(tmp) / str(r), side, overrides, a))
    base = results[sides[0]]
    base_rss = statistics.median(x["rss_end"] for x in base)
    base_step = statistics.median(x["step_s"] for x in base)
    # The process's own memory: its RSS before the first step less the parameter shards in it.
    before = statistics.median(x["before"] for s in sides for x in results[s]) - shard
    print(
        f"2 CPU ranks, {'LoRA, ' if a.lora else ''}"
        f"{'frozen base' if a.freeze or a.lora else 'every parameter trains'}, "
        f"{a.steps} steps, {a.rounds} rounds; plan {planned / MB:.0f} MB + process "
        f"{before / MB:.0f} MB = {(planned + before) / MB:.0f} MB\n"
    )
    print(
        "| side | peak RSS at 1/4 MB | at the end MB | vs glibc | vs plan + process | step s "
        "| vs glibc |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for side in sides:
        rss_q = statistics.median(x["rss_quarter"] for x in results[side])
        rss = statistics.median(x["rss_end"] for x in results[side])
        step = statistics.median(x["step_s"] for x in results[side])
        print(
            f"| {side} | {rss_q / MB:.0f} | {rss / MB:.0f} | {rss / base_rss:.2f} | "
            f"{rss / (planned + before):.2f} | {step:.3f} | {step / base_step:.2f} |"
        )
    losses = {round(x["loss"], 6) for s in sides for x in results[s]}
    print(f"\nfinal losses identical across sides: {len(losses) == 1}")


if __name__ == "__main__":
    main()
