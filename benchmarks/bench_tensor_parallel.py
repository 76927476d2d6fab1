"""Tensor parallelism beside FSDP on 4 CPU ranks: step time and peak RSS per rank of dp 4, dp 2 x
tp 2 (with and without sequence parallelism) and tp 4, side by side, at the same global batch.

    python benchmarks/bench_tensor_parallel.py
    python benchmarks/bench_tensor_parallel.py --hidden 2048 --layers 4 --seq 512

Each layout trains the same Llama (default about 80M parameters: hidden 1024, 4 layers, vocab
8192) for a few steps; each rank's micro-batch is 4 / dp rows, so every layout steps over the
same 4 rows. Figures: the median step time after the first, the max over ranks of the peak RSS
(the whole process on CPU) and of the RSS before the first step (weights and optimizer state
come after it), and the loss of the last step (the layouts train the same model on the same
rows, so it agrees to float rounding).
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

MB = 2**20
LAYOUTS = {  # name: (tensor, sequence_parallel)
    "dp 4": (1, False),
    "dp 2 x tp 2": (2, False),
    "dp 2 x tp 2, sequence parallel": (2, True),
    "tp 4": (4, False),
}


def run(tmp: Path, name: str, tensor: int, sp: bool, a) -> dict:
    run_dir = tmp / name.replace(" ", "_").replace(",", "")
    dp = 4 // tensor
    subprocess.run(
        [
            sys.executable,
            "train.py",
            f"hydra.run.dir={run_dir}",
            "hardware=cpu",
            "hardware.nproc_per_node=4",
            f"parallel.tensor={tensor}",
            f"parallel.sequence_parallel={str(sp).lower()}",
            f"trainer.micro_batch_size={4 // dp}",
            f"trainer.max_steps={a.steps}",
            f"trainer.seq_len={a.seq}",
            "trainer.eval_every=0",
            "trainer.log_every=1",
            "trainer.progress_bar=false",
            "checkpoint=none",
            "logger=none",
            f"model.num_layers={a.layers}",
            f"model.hidden_size={a.hidden}",
            f"model.intermediate_size={4 * a.hidden}",
            "model.num_heads=16",
            "model.num_kv_heads=16",
            f"model.vocab_size={a.vocab}",
            f"model.max_position_embeddings={a.seq}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env={"MALLOC_MMAP_THRESHOLD_": "131072", **__import__("os").environ},
    )
    records = read_metrics(run_dir / "metrics.jsonl")
    facts = json.loads((run_dir / "run.json").read_text())
    return {
        "step_s": statistics.median(r["step_time_s"] for r in records[1:]),
        "peak": max(records[-1]["peak_mem_bytes_per_rank"]),
        "before": max(facts["memory_before_train_bytes_per_rank"]),
        "loss": records[-1]["loss"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = {n: run(Path(tmp), n, t, sp, a) for n, (t, sp) in LAYOUTS.items()}
    base = results["dp 4"]
    print(
        f"Llama hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}, seq {a.seq}, 4 rows per "
        f"step, 4 CPU ranks, median of {a.steps - 1} steps"
    )
    print("| layout | step s | vs dp 4 | peak RSS MB | vs dp 4 | RSS before training MB | loss |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        print(
            f"| {name} | {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f} | "
            f"{r['peak'] // MB} | {r['peak'] / base['peak']:.2f} | {r['before'] // MB} | "
            f"{r['loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
