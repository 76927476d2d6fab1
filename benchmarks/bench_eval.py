"""The cost of an evaluation boundary that shows what the model learned, against a training step:
16 prompts x 64 new tokens (eval.prompts) and one lm-evaluation-harness task (eval.harness_tasks,
the 16 questions of tests/harness_tasks' lab_facts_mc), on the sharded model in lockstep.

    python benchmarks/bench_eval.py                       # the default tiny Llama, then SmolLM2
    python benchmarks/bench_eval.py --only tiny           # or --only smollm2
    python scripts/prepare_smollm2.py                     # once, for the SmolLM2 side

Each model trains on Shakespeare on 2 CPU ranks (fp32, sharding=full; hardware=gpu on a GPU
machine with --gpu). Read back from the run's metrics.jsonl: the median step time after the
first, the generation's time at the last boundary (samples_time_s; the first boundary, at step
0, includes first-call warm-up), the harness's (harness_time_s: lm-eval's task set-up, the
64 log-likelihood requests, and the gathering of answers), and the validation's for scale.
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

PROMPTS = [
    "ROMEO:",
    "JULIET:",
    "KING HENRY:",
    "First Citizen:",
    "To be, or not to be",
    "Now is the winter of our discontent",
    "O Romeo, Romeo!",
    "Friends, Romans, countrymen,",
    "All the world's a stage,",
    "The quality of mercy",
    "If music be the food of love,",
    "Once more unto the breach,",
    "What light through yonder window breaks?",
    "Double, double toil and trouble;",
    "Shall I compare thee",
    "Good night, good night!",
]
NEW_TOKENS = 64
MODELS = {
    "tiny": ["model=llama_tiny", "trainer.max_steps=20", "trainer.eval_every=20"],
    "smollm2": ["model=local", "trainer.max_steps=6", "trainer.eval_every=6"],
}


def run(tmp: Path, name: str, a) -> dict:
    run_dir = tmp / name
    overrides = list(MODELS[name])
    if name == "smollm2":
        overrides.append(f"model.name_or_path={a.smollm2}")
    prompts = tmp / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    subprocess.run(
        [
            sys.executable,
            "train.py",
            f"hydra.run.dir={run_dir}",
            "hardware=gpu" if a.gpu else "hardware=cpu",
            *(["precision=bf16"] if a.gpu else []),
            "data=shakespeare",
            f"trainer.seq_len={a.seq}",
            "trainer.micro_batch_size=4",
            "trainer.progress_bar=false",
            f"eval.prompts={prompts}",
            f"eval.max_new_tokens={NEW_TOKENS}",
            "eval.batch_size=8",
            "eval.harness_tasks=[lab_facts_mc]",
            "eval.harness_include_path=tests/harness_tasks",
            "checkpoint=none",
            "logger=none",
            f"eval.keep_gathered={str(a.keep_gathered).lower()}",
            *overrides,
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        env={"HF_DATASETS_OFFLINE": "1", **os.environ},
    )
    rows = read_metrics(run_dir / "metrics.jsonl", "train")
    step = statistics.median(r["step_time_s"] for r in rows[1:])
    samples = read_metrics(run_dir / "metrics.jsonl", "samples")
    harness = read_metrics(run_dir / "metrics.jsonl", "harness")
    val = read_metrics(run_dir / "metrics.jsonl", "val")
    facts = json.loads((run_dir / "run.json").read_text())
    return {
        "params": facts["total_params"],
        "hardware": facts["hardware"],
        "step_s": step,
        "first_samples_s": samples[0]["samples_time_s"],
        "samples_s": samples[-1]["samples_time_s"],
        "new_tokens": samples[-1]["new_tokens"],
        "harness_s": harness[-1]["harness_time_s"],
        "scores": harness[-1]["scores"],
        "val_s": val[-1]["eval_time_s"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--smollm2", default=str(Path("~/.cache/fsdp_lab/smollm2-135m-instruct").expanduser())
    )
    p.add_argument("--only", choices=sorted(MODELS), help="one model only")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--gpu", action="store_true", help="hardware=gpu, precision=bf16")
    p.add_argument(
        "--keep-gathered", action="store_true", help="eval.keep_gathered=true: gather once"
    )
    a = p.parse_args()
    names = [a.only] if a.only else list(MODELS)
    print(
        f"{len(PROMPTS)} prompts x {NEW_TOKENS} new tokens; lab_facts_mc (16 questions, "
        f"64 requests); 2 ranks, sharding=full, 4 x {a.seq} tokens per rank per step\n"
    )
    print(
        "| model | params | step (s) | generation (s) | x step | new tokens | tokens/s "
        "| harness task (s) | x step | validation (s) |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            r = run(Path(tmp), name, a)
            print(
                f"| {name} | {r['params'] / 1e6:.1f}M | {r['step_s']:.3f} | {r['samples_s']:.2f} "
                f"(first {r['first_samples_s']:.2f}) | {r['samples_s'] / r['step_s']:.1f} | "
                f"{r['new_tokens']} | {r['new_tokens'] / r['samples_s']:.0f} | "
                f"{r['harness_s']:.2f} | {r['harness_s'] / r['step_s']:.1f} | {r['val_s']:.2f} |",
                flush=True,
            )
            print(f"<!-- {name}: {r['hardware']}; scores {r['scores']} -->", flush=True)


if __name__ == "__main__":
    main()
