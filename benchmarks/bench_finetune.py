"""Full fine-tuning, frozen blocks, LoRA and QLoRA side by side: step time, peak RSS and state
bytes.

    python scripts/prepare_smollm2.py          # once: SmolLM2-135M-Instruct, offline
    python benchmarks/bench_finetune.py        # full, freeze (half the blocks), lora r=8/16/64,
                                               # qlora r=8 (an NF4 base; needs torchao)
    python benchmarks/bench_finetune.py --steps 10 --seq 256
    python benchmarks/bench_finetune.py --only "lora r=8,qlora r=8"

Each variant fine-tunes the same pretrained model on the same Shakespeare batches on 2 CPU
ranks (fp32, sharding=full). Figures per rank: the median step time after the first, the peak
RSS over the training steps (VmHWM, reset before the first step: the whole process, weights,
gradients, optimizer state and activations), and the model state the rank holds after the
first optimizer step (run.json's state_bytes_per_rank: parameter shards, gradients, AdamW
state). Ratios are to `full`.
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


def variants(num_blocks: int) -> dict[str, list[str]]:
    return {
        "full": [],
        f"freeze {num_blocks // 2}/{num_blocks} blocks": [
            "finetune=freeze",
            f"finetune.freeze_blocks={num_blocks // 2}",
        ],
        **{
            f"lora r={r}": ["finetune=lora", f"finetune.r={r}", f"finetune.alpha={2 * r}"]
            for r in (8, 16, 64)
        },
        "qlora r=8": ["finetune=qlora", "finetune.r=8", "finetune.alpha=16"],
    }


def run(tmp: Path, name: str, overrides: list[str], a) -> dict:
    run_dir = tmp / "".join(c if c.isalnum() else "_" for c in name)
    subprocess.run(
        [
            sys.executable,
            "train.py",
            f"hydra.run.dir={run_dir}",
            "hardware=cpu",
            "model=local",
            f"model.name_or_path={a.model}",
            "data=shakespeare",
            f"trainer.max_steps={a.steps}",
            f"trainer.seq_len={a.seq}",
            f"trainer.micro_batch_size={a.batch}",
            "trainer.eval_every=0",
            "trainer.progress_bar=false",
            "checkpoint=none",
            "logger=none",
            *overrides,
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    steps = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["split"] == "train"]
    facts = json.loads((run_dir / "run.json").read_text())
    world = facts["world_size"]
    return {
        "trainable": facts["trainable_params"],
        "total": facts["total_params"],
        "step_s": statistics.median(r["step_time_s"] for r in steps[1:]),
        "peak": [max(r["peak_mem_bytes_per_rank"][k] for r in steps) for k in range(world)],
        "state": [sum(s.values()) for s in facts["state_bytes_per_rank"]],
        "loss": [r["loss"] for r in steps],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=str(Path("~/.cache/fsdp_lab/smollm2-135m-instruct").expanduser())
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument(
        "--only", help="comma-separated variant names (the first is the ratios' basis)"
    )
    a = parser.parse_args()
    config = json.loads((Path(a.model) / "config.json").read_text())
    results, chosen = {}, variants(config["num_hidden_layers"])
    if a.only:
        chosen = {name: chosen[name] for name in a.only.split(",")}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in chosen.items():
            results[name] = run(Path(tmp), name, overrides, a)
            print(f"  {name}: done", file=sys.stderr)
    basis = next(iter(results))
    full = results[basis]
    print(
        f"{Path(a.model).name}, 2 CPU ranks, sharding=full, fp32, {a.batch} x {a.seq} tokens per "
        f"rank per step, median of steps 2-{a.steps}"
    )
    print(
        f"| finetune | trainable | step (s) | x {basis} | peak RSS per rank (MB) | x {basis} "
        f"| state per rank (MB) | x {basis} |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        peak, state = max(r["peak"]), max(r["state"])
        print(
            f"| {name} | {r['trainable']:,} ({100 * r['trainable'] / r['total']:.2f}%) "
            f"| {r['step_s']:.2f} | {r['step_s'] / full['step_s']:.2f} "
            f"| {' / '.join(str(p // MB) for p in r['peak'])} | {peak / max(full['peak']):.2f} "
            f"| {' / '.join(str(s // MB) for s in r['state'])} | {state / max(full['state']):.2f} |"
        )


if __name__ == "__main__":
    main()
