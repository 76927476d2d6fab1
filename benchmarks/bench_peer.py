"""fsdp_lab beside Hugging Face Trainer on 2 CPU ranks, side by side in one run.

    python benchmarks/bench_peer.py                  # 3 interleaved rounds, about 10 minutes
    python benchmarks/bench_peer.py --rounds 5 --steps 30

The run a new user would try first: a 13M-parameter Llama (hidden 384, 4 layers, 6 heads,
MLP 1024, vocabulary 8192), seq 256, micro-batch 4 per rank, AdamW with clipping, fp32, on 2
gloo ranks of this machine with one thread each. Three sides alternate in every round:
Trainer (which on CPU ignores FSDP and trains DDP, with its default fused AdamW), fsdp_lab
``sharding=no_shard`` (DDP's semantics: everything replicated, gradients all-reduced) and
``sharding=full``. Each side's figure is its median step time over steps warmup+1..steps
(operations on CPU run as they are called, so each step's time is exact), then the median
over rounds. Target: no_shard <= 1.0x Trainer's step time.
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

MODEL = dict(hidden=384, layers=4, heads=6, kv_heads=6, ffn=1024, vocab=8192)


def run_fsdp_lab(run_dir: Path, sharding: str, a) -> float:
    cmd = [
        sys.executable,
        "train.py",
        f"hydra.run.dir={run_dir}",
        "hardware=cpu",
        f"hardware.nproc_per_node={a.nproc}",
        f"sharding={sharding}",
        "logger=none",
        "checkpoint=none",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        f"trainer.max_steps={a.steps}",
        f"trainer.seq_len={a.seq}",
        f"trainer.micro_batch_size={a.batch}",
        f"model.hidden_size={MODEL['hidden']}",
        f"model.num_layers={MODEL['layers']}",
        f"model.num_heads={MODEL['heads']}",
        f"model.num_kv_heads={MODEL['kv_heads']}",
        f"model.intermediate_size={MODEL['ffn']}",
        f"model.vocab_size={MODEL['vocab']}",
        f"model.max_position_embeddings={a.seq}",
        "optim.lr=1e-3",
    ]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    steps = read_metrics(run_dir / "metrics.jsonl")
    return statistics.median(r["step_time_s"] for r in steps[a.warmup :])


def run_trainer(a) -> float:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={a.nproc}",
        str(ROOT / "benchmarks" / "hf_trainer_side.py"),
        "--cpu",
        "--threads=1",
        *[f"--{k}={v}" for k, v in MODEL.items()],
        f"--seq={a.seq}",
        f"--batch={a.batch}",
        f"--steps={a.steps}",
        f"--warmup={a.warmup}",
    ]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    result = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    if result["fsdp"]:
        raise RuntimeError("Trainer enabled FSDP on CPU: this benchmark assumed DDP")
    return result["median_step_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    sides: dict[str, list[float]] = {"hf_trainer": [], "no_shard": [], "full": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            sides["hf_trainer"].append(run_trainer(a))
            for sharding in ("no_shard", "full"):
                sides[sharding].append(run_fsdp_lab(Path(tmp) / f"{sharding}_{r}", sharding, a))
            print(
                f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f} s/step" for k, v in sides.items()),
                flush=True,
            )
    med = {k: statistics.median(v) for k, v in sides.items()}
    print(f"\n| side | s/step (median of {a.rounds} rounds) | vs Trainer |\n| --- | --- | --- |")
    labels = {
        "hf_trainer": "HF Trainer (DDP on CPU)",
        "no_shard": "fsdp_lab sharding=no_shard",
        "full": "fsdp_lab sharding=full",
    }
    for k, v in med.items():
        print(f"| {labels[k]} | {v:.3f} | {v / med['hf_trainer']:.2f} |")
    print(
        f"\nno_shard / Trainer = {med['no_shard'] / med['hf_trainer']:.3f} (target <= 1.0); "
        f"{a.nproc} ranks, batch {a.batch}x{a.seq} per rank, steps {a.warmup + 1}..{a.steps}"
    )


if __name__ == "__main__":
    main()
