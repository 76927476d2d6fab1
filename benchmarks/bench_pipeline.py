"""Pipeline parallelism's bubble on CPU ranks: the share of a step the time model's schedule
row predicts idle, beside the share measured, for 1F1B and Interleaved1F1B at 4 and 8
microbatches (PP 2 on 2 ranks, one thread each).

    python benchmarks/bench_pipeline.py                 # ~3 min on 2 cores
    python benchmarks/bench_pipeline.py --steps 6 --json out.json

Every run trains the same Llama (hidden 256, 8 layers, 256 tokens, 8 rows a micro-batch, fp32)
on the same global batch. The measured bubble is 1 - (PP 1's step / 2) / PP 2's step: the share
of PP 2's step that is not the half of the work a rank would do split perfectly (it includes
the sends between stages, which the time model prices apart). ``fsdp-lab plan``'s step for
each layout is beside it (priced on this machine's calibrated profile where one is cached).
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

from fsdp_lab.config import compose  # noqa: E402
from fsdp_lab.config.pipeline import layout  # noqa: E402
from fsdp_lab.observe.run_logs import read_metrics  # noqa: E402
from fsdp_lab.planning import plan  # noqa: E402

LAYOUTS = [("1F1B", 4), ("1F1B", 8), ("Interleaved1F1B", 4), ("Interleaved1F1B", 8)]


def overrides(a, schedule: str | None, microbatches: int) -> list[str]:
    common = [
        "hardware=cpu",
        "hardware.threads_per_rank=1",
        "model.hidden_size=256",
        "model.intermediate_size=1024",
        "model.num_layers=8",
        "trainer.seq_len=256",
        "trainer.micro_batch_size=8",
        f"trainer.max_steps={a.steps}",
        "trainer.eval_every=0",
        "trainer.log_every=1",
        "checkpoint=none",
        "logger=none",
        "trainer.progress_bar=false",
    ]
    if schedule is None:
        return [*common, "hardware.nproc_per_node=1"]
    return [
        *common,
        "hardware.nproc_per_node=2",
        "parallel.pipeline=2",
        f"parallel.pipeline_schedule={schedule}",
        f"parallel.pipeline_microbatches={microbatches}",
    ]


def measure(tmp: Path, name: str, args: list[str]) -> float:
    """The median step time of a run, its first step left out."""
    run_dir = tmp / name
    proc = subprocess.run(
        [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-2000:]}")
    return statistics.median(r["step_time_s"] for r in read_metrics(run_dir / "metrics.jsonl")[1:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", type=Path, help="write the results here too")
    a = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        one = measure(Path(tmp), "pp1", overrides(a, None, 1))
        for schedule, m in LAYOUTS:
            args = overrides(a, schedule, m)
            step = measure(Path(tmp), f"{schedule}-{m}", args)
            cfg = compose(args)
            predicted = layout(cfg.parallel, 8, cfg.trainer.micro_batch_size).bubble()
            time = plan.build_plan(args).chosen_plan.time
            rows.append(
                {
                    "schedule": schedule,
                    "microbatches": m,
                    "step_s": step,
                    "bubble_predicted": predicted,
                    "bubble_measured": 1 - (one / 2) / step,
                    "plan_step_s": time.step_s,
                    "plan_bubble_s": time.bubble_s,
                    "plan_p2p_s": time.p2p_s,
                }
            )
    print("Llama hidden 256, 8 layers, 8 x 256 tokens a step, fp32, PP 2 on 2 CPU ranks")
    print(f"PP 1 on 1 rank: {one * 1e3:.1f} ms a step")
    print("| schedule | microbatches | step ms | bubble predicted | measured | plan's step ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['schedule']} | {r['microbatches']} | {r['step_s'] * 1e3:.1f} | "
            f"{r['bubble_predicted']:.1%} | {r['bubble_measured']:.1%} | "
            f"{r['plan_step_s'] * 1e3:.1f} |"
        )
    if a.json:
        a.json.write_text(json.dumps({"pp1_step_s": one, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
