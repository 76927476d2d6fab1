"""The time model against measured steps on CPU ranks (gloo): for each setup `fsdp-lab
calibrate` at its model's shapes on its ranks, then the plan's predicted step time beside the
median step time of a real run right after (steps after the first two), and the error.

    python benchmarks/bench_time_model.py                 # every setup, ~15 min on 2 cores
    python benchmarks/bench_time_model.py --only m1-full-2 m2-full-2 --steps 6
    python benchmarks/bench_time_model.py --again benchmarks/results/cpu-...-time-model.json
        # the same profiles and measured steps, predicted again (after a change to the model)

Setups cover the five strategies, two model sizes (a Llama of hidden 256 x 4 layers, and of
hidden 512 x 8 layers) and a mixture of experts, 2 and 4 ranks, TP 2, activation
checkpointing, offload, LoRA and gradient accumulation. Results go to
benchmarks/results/cpu-<date>-time-model.json and a markdown table on stdout
(docs/benchmarks.md, "The time model").
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

from fsdp_lab.tools import plan, plan_compare  # noqa: E402

M1 = ["model.hidden_size=256", "model.intermediate_size=1024", "model.num_layers=4"]
M2 = ["model.hidden_size=512", "model.intermediate_size=1408", "model.num_layers=8"]
# A Qwen3-MoE of hidden 256 x 4 layers, 16 experts of width 256, top 4 (grouped_mm)
MOE = ["model=qwen3_moe_tiny", "model.hidden_size=256", "model.num_layers=4",
       "model.num_experts=16", "model.experts_per_token=4", "model.expert_intermediate_size=256",
       "model.experts_implementation=grouped_mm"]  # fmt: skip
MODELS = {"m1": M1, "m2": M2, "moe": MOE}
COMMON = [
    "hardware=cpu",
    "trainer.seq_len=256",
    "trainer.micro_batch_size=4",
    "trainer.eval_every=0",
    "trainer.log_every=1",
    "checkpoint=none",
    "logger=none",
    "trainer.progress_bar=false",
]
SETUPS = {
    "m1-full-2": [*M1],
    "m1-grad_op-2": [*M1, "sharding=grad_op"],
    "m1-no_shard-2": [*M1, "sharding=no_shard"],
    "m1-full-4": [*M1, "hardware.nproc_per_node=4"],
    "m1-hybrid-4": [*M1, "hardware.nproc_per_node=4", "sharding=hybrid"],
    "m1-hybrid_zero2-4": [*M1, "hardware.nproc_per_node=4", "sharding=hybrid_zero2"],
    "m1-ac-2": [*M1, "activation_checkpointing=full"],
    "m1-offload-2": [*M1, "offload=cpu"],
    "m1-lora-2": [*M1, "finetune=lora"],
    "m1-tp2-2": [*M1, "parallel.tensor=2"],
    "m1-accum2-2": [*M1, "trainer.grad_accum_steps=2"],
    "m2-full-2": [*M2],
    "m2-grad_op-2": [*M2, "sharding=grad_op"],
    "m2-full-4": [*M2, "hardware.nproc_per_node=4"],
    "m2-ac-2": [*M2, "activation_checkpointing=full"],
    "m2-lora-2": [*M2, "finetune=lora"],
    "moe-full-2": [*MOE],
}


# One H100 80GB HBM3, measured (benchmarks/results/h100-2026-11-26-*.json): predicted from
# the h100 row alone. (name, overrides, measured step s)
LLAMA_1B = ["experiment=gpu_1b", "hardware.nproc_per_node=1"]
QWEN3_MOE = [
    "hardware=gpu", "hardware.nproc_per_node=1", "precision=bf16", "model=qwen3_moe_tiny",
    "model.hidden_size=1024", "model.num_layers=8", "model.num_heads=16",
    "model.num_kv_heads=4", "model.num_experts=64", "model.experts_per_token=8",
    "model.expert_intermediate_size=512", "model.vocab_size=32000", "trainer.seq_len=2048",
    "model.max_position_embeddings=2048", "trainer.micro_batch_size=8",
    "model.experts_implementation=grouped_mm",
]  # fmt: skip
H100_ROWS = [
    ("1.1B Llama, 8 x 2048, compiled", [*LLAMA_1B, "trainer.micro_batch_size=8"], 0.24827),
    ("1.1B Llama, 16 x 2048, compiled", LLAMA_1B, 0.46307),
    ("160M Llama, 16 x 2048, compiled", ["experiment=gpu_160m", "hardware.nproc_per_node=1"],
     0.074058),
    ("Qwen3-MoE 0.9B (64 experts, top 8, grouped_mm), 8 x 2048, eager", QWEN3_MOE,
     8 * 2048 / 114205.18),
]  # fmt: skip

# Published multi-GPU runs (docs/benchmarks.md cites each): (name, overrides, device, nodes,
# published tokens/s per GPU). torchtitan's selective op-level checkpointing recomputes only
# cheap operators: modelled as none.
LLAMA3_8B = ["hardware=gpu", "precision=bf16", "model.hidden_size=4096",
             "model.intermediate_size=14336", "model.num_layers=32", "model.num_heads=32",
             "model.num_kv_heads=8", "model.vocab_size=128256", "trainer.seq_len=8192",
             "model.max_position_embeddings=8192"]  # fmt: skip
LLAMA3_70B = ["hardware=gpu", "precision=bf16", "model.hidden_size=8192",
              "model.intermediate_size=28672", "model.num_layers=80", "model.num_heads=64",
              "model.num_kv_heads=8", "model.vocab_size=128256", "trainer.seq_len=8192",
              "model.max_position_embeddings=8192"]  # fmt: skip
MPT_7B = ["hardware=gpu", "precision=bf16", "model=gpt2_tiny", "model.hidden_size=4096",
          "model.intermediate_size=16384", "model.num_layers=32", "model.num_heads=32",
          "model.num_kv_heads=32", "model.vocab_size=50368", "trainer.seq_len=2048",
          "model.max_position_embeddings=2048"]  # fmt: skip
PUBLISHED = [
    ("torchtitan Llama 3.1 8B, 8 x H100, FSDP, 2 x 8192, compile", [*LLAMA3_8B,
     "trainer.micro_batch_size=2", "compile=true"], "h100", 1, 6667),
    ("torchtitan Llama 3 8B, 64 x A100 80GB, FSDP, 1 x 8192", [*LLAMA3_8B,
     "trainer.micro_batch_size=1"], "a100-80gb", 8, 2973),
    ("torchtitan Llama 3 70B, 64 x A100 80GB, FSDP, 1 x 8192, full AC", [*LLAMA3_70B,
     "trainer.micro_batch_size=1", "activation_checkpointing=full"], "a100-80gb", 8, 331),
    ("torchtitan (Trainy) Llama 3.1 8B, 32 x H200, FSDP, 2 x 8192, compile, float8", [
     *LLAMA3_8B, "trainer.micro_batch_size=2", "compile=true",
     "precision.float8_recipe=tensorwise", "precision.float8_all_gather=true"], "h200", 4,
     10938),
    ("llm-foundry MPT-7B, 8 x H100, FSDP, 6 x 2048", [*MPT_7B, "trainer.micro_batch_size=6"],
     "h100", 1, 10643),
]  # fmt: skip


def predicted_rows() -> list[dict]:
    """The H100 rows and the published runs, predicted (no run)."""
    out = []
    for name, overrides, measured in H100_ROWS:
        t = plan.build_plan(overrides, "h100").chosen_plan.time
        error = t.step_s / measured - 1
        out.append({"kind": "h100", "name": name, "predicted_s": t.step_s,
                    "measured_s": measured, "error": error, "mfu": t.mfu})  # fmt: skip
    for name, overrides, device, nodes, published in PUBLISHED:
        args = plan_compare.with_device(overrides, device, nodes)
        t = plan.build_plan(args, device).chosen_plan.time
        out.append({"kind": "published", "name": name, "predicted_tokens_per_s_per_gpu":
                    t.tokens_per_s, "published": published, "error": t.tokens_per_s / published - 1,
                    "mfu": t.mfu, "exposed_comm_share": t.share("exposed_comm_s")})  # fmt: skip
    return out


def ranks(setup: list[str]) -> int:
    return next(
        (int(o.split("=")[1]) for o in setup if o.startswith("hardware.nproc_per_node=")), 2
    )


def key(setup: list[str]) -> str:
    """The profile a setup is priced on: its model's shapes on its ranks."""
    model = next(k for k, v in MODELS.items() if setup[: len(v)] == v)
    return f"{model}-cpu{ranks(setup)}"


def calibrate(tmp: Path, setup: str, name: str, a) -> Path:
    """`fsdp-lab calibrate` at the model's shapes on its ranks, as a user runs it."""
    out = tmp / f"{setup}.json"
    model, nproc = MODELS[name.split("-")[0]], name.split("cpu")[1]
    cmd = [
        sys.executable, "-m", "fsdp_lab.tools.cli", "calibrate", *COMMON, *model,
        f"hardware.nproc_per_node={nproc}", "--out", str(out), "--max-spread", str(a.max_spread),
        "--repeats", str(a.repeats),
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"calibrate {name} failed:\n{proc.stderr[-2000:]}")
    print(proc.stdout, file=sys.stderr)
    return out


def measure(tmp: Path, name: str, args: list[str], steps: int) -> float:
    run_dir = tmp / name
    cmd = [sys.executable, "train.py", f"hydra.run.dir={run_dir}", *args]
    proc = subprocess.run(
        [*cmd, f"trainer.max_steps={steps}"], cwd=ROOT, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-2000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [
        r["step_time_s"] for r in rows if r.get("split", "train") == "train" and "step_time_s" in r
    ]
    return statistics.median(times[2:])


def _save(rows: list, profiles: dict, predicted: list | None = None) -> Path:
    out = ROOT / "benchmarks" / "results" / f"cpu-{time.strftime('%Y-%m-%d')}-time-model.json"
    record = {"rows": rows, "profiles": profiles, "predicted_only": predicted or []}
    out.write_text(json.dumps(record, indent=2) + "\n")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", choices=list(SETUPS))
    p.add_argument("--steps", type=int, default=12)
    # 2 shared cores: gloo's small collectives after a matmul spread up to ~130% (a rank's
    # compute running late), which the median absorbs; the benchmark takes them
    p.add_argument("--max-spread", type=float, default=2.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--again",
        type=Path,
        help="a results JSON of this benchmark: its profiles and measured steps, predicted anew",
    )
    p.add_argument(
        "--recalibrate", action="store_true", help="with --again: measure the profiles anew"
    )
    p.add_argument(
        "--predicted-only",
        action="store_true",
        help="only the H100 rows and the published runs, predicted (seconds, no run)",
    )
    a = p.parse_args()
    if a.predicted_only:
        for r in predicted_rows():
            print(json.dumps(r))
        return
    names = a.only or list(SETUPS)
    earlier = json.loads(a.again.read_text()) if a.again else {"rows": [], "profiles": {}}
    known = {r["setup"]: r["measured_s"] for r in earlier["rows"]}
    rows = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        profiles: dict[str, dict] = {}
        for name in names:
            args = [*COMMON, *SETUPS[name]]
            # calibrated right before the setup runs, so both see the machine in one state
            # (on a shared 2-core VM its speed drifts by 20-30% over minutes)
            saved = earlier["profiles"].get(name)
            if saved is None or a.recalibrate:
                saved = json.loads(calibrate(tmp, name, key(SETUPS[name]), a).read_text())
            profiles[name] = saved
            path = tmp / f"{name}.profile.json"
            path.write_text(json.dumps(saved))
            predicted = plan.build_plan(args, str(path)).chosen_plan.time
            measured = known.get(name) or measure(tmp, name, args, a.steps)
            rows.append(
                {
                    "setup": name,
                    "overrides": SETUPS[name],
                    "predicted_s": round(predicted.step_s, 4),
                    "measured_s": round(measured, 4),
                    "error": round(predicted.step_s / measured - 1, 3),
                    "split": {
                        k: round(getattr(predicted, k), 4)
                        for k in ("compute_s", "exposed_comm_s", "optimizer_s", "other_s")
                    },
                }
            )
            _save(rows, profiles)  # each setup as it ends: a failure later keeps it
            r = rows[-1]
            print(f"{name}: predicted {r['predicted_s']:.3f} s, measured {r['measured_s']:.3f} s,"
                  f" {100 * r['error']:+.1f}%", file=sys.stderr, flush=True)  # fmt: skip
    out = _save(rows, profiles, predicted_rows())
    print("| setup | predicted s | measured s | error |\n| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['setup']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | "
              f"{100 * r['error']:+.1f}% |")  # fmt: skip
    worst = max(abs(r["error"]) for r in rows)
    print(f"\nworst |error| {100 * worst:.1f}% over {len(rows)} setups ({out})")


if __name__ == "__main__":
    main()
