"""Loading and exporting a pretrained model: per-rank reads against rank 0's whole-model route.

    python benchmarks/bench_loading.py                      # 0.2B and 0.8B Llamas, 4 CPU ranks
    python benchmarks/bench_loading.py --sizes 0.2b --nproc 2
    python benchmarks/bench_loading.py --model DIR          # a model directory of your own

Each model is a Llama saved by `save_pretrained` in bf16 (several safetensors files). Per size,
side by side in one run, alternating: `python train.py model=local model.name_or_path=DIR
hardware=cpu trainer.max_steps=1 checkpoint.export_hf=true` with `model.loading=per_rank` (each
rank reads only its shards) and `model.loading=rank0` (rank 0 builds the whole model in fp32 and
broadcasts it: the route before per-rank reads). For each: every rank's peak RSS while loading
(run.json `load_peak_rss_bytes_per_rank`) and while exporting (`export_peak_rss_bytes_per_rank`,
the high-water mark reset before the export, and the RSS it started from), the time from
starting `python train.py` to the start of its first step (rank 0's last line before it), and
`fsdp-lab plan`'s host figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
READY = "numbers read from the device"  # rank 0's last line before its first step
SIZES = {  # name -> LlamaConfig sizes (bf16 on disk)
    "0.2b": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16),
    "0.8b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16),
}


def save_llama(path: Path, sizes: dict) -> int:
    """A Llama with random weights, as `save_pretrained` writes it in bf16; its parameters."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        num_attention_heads=sizes["hidden_size"] // 64,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        **sizes,
    )
    with torch.device("meta"):
        count = sum(p.numel() for p in LlamaForCausalLM(config).parameters())
    if not (path / "config.json").is_file():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.save_pretrained(path, max_shard_size="500MB")
        del model
    return count


def run(model: str, route: str, nproc: int, run_dir: Path) -> dict:
    """One train.py run; its load and export peaks and the time to its first step."""
    cmd = [
        sys.executable,
        "train.py",
        f"hydra.run.dir={run_dir}",
        "hardware=cpu",
        f"hardware.nproc_per_node={nproc}",
        "model=local",
        f"model.name_or_path={model}",
        f"model.loading={route}",
        "trainer.max_steps=1",
        "trainer.seq_len=32",
        "trainer.micro_batch_size=1",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        "checkpoint=none",
        "checkpoint.export_hf=true",
        "logger=none",
    ]
    started = time.perf_counter()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    lines, first = [], None
    for line in proc.stdout:  # rank 0 says this once the state is built, before the first step
        if first is None and READY in line:
            first = time.perf_counter() - started
        lines.append(line)
    if proc.wait() != 0:
        raise SystemExit(f"{route} failed:\n{''.join(lines)[-3000:]}")
    facts = json.loads((run_dir / "run.json").read_text())
    return {
        "load": facts["load_peak_rss_bytes_per_rank"],
        "export": facts["export_peak_rss_bytes_per_rank"],
        "export_start": facts["export_start_rss_bytes_per_rank"],
        "first_step_s": first,  # to the start of the first step
        "total_s": time.perf_counter() - started,
    }


def plan_host(model: str, nproc: int, *extra: str) -> dict:
    out = subprocess.run(
        [
            *(sys.executable, "-m", "fsdp_lab.tools.cli", "plan", "--json", "model=local"),
            *(f"model.name_or_path={model}", f"hardware.nproc_per_node={nproc}", *extra),
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)["host"]


def _gb(values) -> str:
    return "[" + ", ".join(f"{v / GB:.2f}" for v in values) + "]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="0.2b,0.8b", help=f"of {', '.join(SIZES)}")
    p.add_argument("--model", help="a model directory instead of the generated Llamas")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds per route")
    p.add_argument("--out", type=Path, help="also write the results here as JSON")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = (
            {"model": (a.model, None)}
            if a.model
            else {
                s: (str(Path(tmp) / s), save_llama(Path(tmp) / s, SIZES[s]))
                for s in a.sizes.split(",")
            }
        )
        for name, (path, params) in models.items():
            sides: dict[str, list[dict]] = {"per_rank": [], "rank0": []}
            for i in range(a.rounds):
                for route in sides:
                    sides[route].append(
                        run(path, route, a.nproc, Path(tmp) / f"{name}-{route}-{i}")
                    )
            results[name] = {
                "params": params,
                "plan": plan_host(path, a.nproc, "hardware=cpu"),
                **{route: runs[-1] for route, runs in sides.items()},
                "first_step_s": {r: min(x["first_step_s"] for x in v) for r, v in sides.items()},
            }
    print(f"{a.nproc} CPU ranks; host peak RSS per rank, GB (the process's own ~0.45 GB included)")
    print("| model | route | load | export (its rise over the trained state) | first step (s) |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        for route in ("per_rank", "rank0"):
            x = r[route]
            rise = [p - s for p, s in zip(x["export"], x["export_start"], strict=True)]
            print(
                f"| {name} | {route} | {_gb(x['load'])} | {_gb(x['export'])} ({_gb(rise)}) | "
                f"{r['first_step_s'][route]:.1f} |"
            )
        ratio = r["first_step_s"]["per_rank"] / r["first_step_s"]["rank0"]
        plan = r["plan"]
        print(
            f"| {name} | per_rank / rank0 | rank 0 "
            f"{max(r['per_rank']['load']) / max(r['rank0']['load']):.2f}x | | {ratio:.2f}x |"
        )
        print(
            f"| {name} | plan (besides the process) | {plan['load'] / GB:.2f} "
            f"(rank0 route: {plan['load_rank0'] / GB:.2f}) | {plan['export_writer'] / GB:.2f} | |"
        )
    if a.out:
        a.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
