"""Activation checkpointing: peak memory and step time of none, selective and full, side by side.

    python benchmarks/bench_activation_checkpointing.py
    python benchmarks/bench_activation_checkpointing.py --seq 2048 --layers 8

Each mode trains the same Llama (default 8 layers, hidden 256, SDPA attention) for a few steps
on 2 CPU ranks; the figures are the max over ranks of the peak RSS (on CPU the whole process:
imports, weights, optimizer state and activations) and the median step time after the first.
The loss must be identical in every mode. Ratios are to `none`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_lab.observe.run_logs import read_metrics  # noqa: E402

MB = 2**20


def run(tmp: Path, mode: str, a) -> tuple[int, float, list[float]]:
    run_dir = tmp / mode
    subprocess.run(
        [
            sys.executable,
            "train.py",
            f"hydra.run.dir={run_dir}",
            "hardware=cpu",
            f"activation_checkpointing={mode}",
            "activation_checkpointing.every=2",
            f"trainer.max_steps={a.steps}",
            f"trainer.seq_len={a.seq}",
            f"trainer.micro_batch_size={a.batch}",
            "trainer.eval_every=0",
            "trainer.progress_bar=false",
            "checkpoint=none",
            f"model.num_layers={a.layers}",
            "model.hidden_size=256",
            "model.intermediate_size=1024",
            "model.num_heads=8",
            "model.num_kv_heads=4",
            f"model.max_position_embeddings={a.seq}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    records = read_metrics(run_dir / "metrics.jsonl")
    return (
        records[-1]["peak_mem_bytes"],
        statistics.median(r["step_time_s"] for r in records[1:]),
        [r["loss"] for r in records],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: run(Path(tmp), mode, a) for mode in ("none", "selective", "full")}
    peak0, time0, loss0 = results["none"]
    print(f"{a.layers} layers, seq {a.seq}, micro-batch {a.batch}, 2 ranks")
    print("| mode | peak RSS MB | vs none | step s | vs none | loss identical |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode, (peak, step, loss) in results.items():
        print(
            f"| {mode} | {peak // MB} | {peak / peak0:.2f} | {step:.3f} | {step / time0:.2f} | "
            f"{loss == loss0} |"
        )


if __name__ == "__main__":
    main()
