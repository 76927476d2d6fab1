"""fsdp_lab's training step vs a minimal hand-written fully_shard loop, side by side in one run.

    python benchmarks/bench_overhead.py              # 2 CPU ranks, full sharding
    python benchmarks/bench_overhead.py --rounds 3 --steps 30

Both run the same Llama (about 7M params), global batch, strategy and AdamW + clipping on
2 gloo ranks. The runs alternate (fsdp_lab, minimal, fsdp_lab, ...) so drift in machine speed
hits both; each side's figure is the median over rounds of (wall time of steps 2..N) / (N-1),
measured inside the loop so process start-up is excluded on both sides. Target: ratio <= 1.05.
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

MODEL = dict(hidden=256, layers=4, heads=8, kv_heads=4, ffn=768, vocab=8192)


def run_fsdp_lab(tmp: Path, round_: int, a) -> float:
    run_dir = tmp / f"fsdp_lab_{round_}"
    cmd = [
        sys.executable,
        "train.py",
        f"hydra.run.dir={run_dir}",
        "hardware=cpu",
        f"hardware.nproc_per_node={a.nproc}",
        f"sharding={a.sharding}",
        "trainer.progress_bar=false",
        f"trainer.max_steps={a.steps}",
        f"trainer.seq_len={a.seq}",
        f"trainer.micro_batch_size={a.batch}",
        "model.hidden_size={hidden}",
        "model.num_layers={layers}",
        "model.num_heads={heads}",
        "model.num_kv_heads={kv_heads}",
        "model.intermediate_size={ffn}",
        "model.vocab_size={vocab}",
        f"model.max_position_embeddings={a.seq}",
        f"logger.wandb.mode={a.wandb}",
    ]
    cmd = [c.format(**MODEL) for c in cmd]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    elapsed = [r["elapsed_s"] for r in read_metrics(run_dir / "metrics.jsonl")]
    return (elapsed[-1] - elapsed[0]) / (len(elapsed) - 1)


def run_minimal(a) -> float:
    threads = max(1, 2 // a.nproc)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={a.nproc}",
        str(ROOT / "benchmarks" / "minimal_fsdp.py"),
        *[f"--{k}={v}" for k, v in MODEL.items()],
        f"--seq={a.seq}",
        f"--batch={a.batch}",
        f"--steps={a.steps}",
        f"--threads={threads}",
        f"--reshard={1 if a.sharding == 'full' else 0}",
    ]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["s_per_step"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--wandb",
        default="offline",
        choices=["offline", "disabled"],
        help="fsdp_lab's W&B logging during the timed steps (offline: as by default)",
    )
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--sharding", choices=["full", "grad_op"], default="full")
    a = p.parse_args()
    ours, base = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            ours.append(run_fsdp_lab(Path(tmp), r, a))
            base.append(run_minimal(a))
            print(
                f"round {r}: fsdp_lab {ours[-1]:.4f} s/step, minimal {base[-1]:.4f} s/step",
                flush=True,
            )
    o, b = statistics.median(ours), statistics.median(base)
    print(f"\n| side | s/step (median of {a.rounds}) |\n|---|---|")
    print(f"| minimal fully_shard loop | {b:.4f} |\n| fsdp_lab | {o:.4f} |")
    print(
        f"\nratio fsdp_lab / minimal = {o / b:.3f} (target <= 1.05) — {a.nproc} ranks, "
        f"sharding={a.sharding}, batch {a.batch}x{a.seq} per rank"
    )


if __name__ == "__main__":
    main()
