"""fsdp_lab beside Hugging Face Trainer (accelerate FSDP2) and a hand-written loop, on one GPU.

    python benchmarks/bench_gpu.py                       # 160M and 1B Llama, seq 2048, bf16
    python benchmarks/bench_gpu.py --models 160m --steps 40 --sides fsdp_lab,hf_docs
    python benchmarks/bench_gpu.py --models 160m --batch 8 --seq 1024   # the first GPU run's shape
    python benchmarks/bench_gpu.py --models 1b --sides fsdp_lab,fsdp_lab_float8   # float8 vs bf16

Every side trains the same Llama (random init), batch, sequence length, precision (bf16 compute,
fp32 master weights and reduction) and optimizer (AdamW, clipping at 1.0), one after another on
the same device, each in its own processes:

| side            | what runs                                                              |
| --------------- | ---------------------------------------------------------------------- |
| fsdp_lab        | ``train.py`` with its defaults plus compile=true (the GPU recipes')    |
| fsdp_lab_chunked| the same with loss=chunked (where liger-kernel is not installed)       |
| fsdp_lab_float8 | the same with float8 linears and all-gathers (precision=float8's)      |
| fsdp_lab_before | ``train.py`` as before this benchmark existed: loss=hf, foreach AdamW,  |
|                 | a host sync every step (log_every=1), no compile                        |
| hf_docs         | Trainer as transformers' FSDP guide sets it up (FSDP2, bf16, SDPA)      |
| hf_fast         | the same plus torch_compile, adamw_torch_fused and use_liger_kernel     |
| ceiling         | a minimal fully_shard + per-layer torch.compile loop (ceiling_fsdp.py)  |

Each side's figure is the wall time of steps warmup+1..steps with the device synchronised at
both ends (process start, weight init and compilation excluded). MFU = tokens/s x (6N +
12·L·H·Q·T) / the device's dense bf16 peak (named in the output). Peak memory is the allocator's
peak during the steps. Results go to stdout as a Markdown table and, with --json, to a file.
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
sys.path.insert(0, str(ROOT))

from fsdp_lab.observe.run_logs import read_metrics  # noqa: E402

# Llama shapes. 160m: the first GPU run's model (hidden 1024, 8 layers, vocab 32000); 1b:
# TinyLlama-1.1B's. batch: sequences per step at seq 2048 that fill an 80 GB device with every
# side's activations (HF's fp32 logits included) and no activation checkpointing.
MODELS = {
    "160m": dict(hidden=1024, layers=8, heads=16, kv_heads=8, ffn=2816, vocab=32000, batch=16),
    "1b": dict(hidden=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000, batch=8),
}
SIDES = (
    "fsdp_lab",
    "fsdp_lab_chunked",
    "fsdp_lab_float8",
    "fsdp_lab_before",
    "hf_docs",
    "hf_fast",
    "ceiling",
)


def model_args(m: dict, a) -> list[str]:
    return [f"--{k}={m[k]}" for k in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab")] + [
        f"--seq={a.seq}",
        f"--batch={a.batch or m['batch']}",
        f"--steps={a.steps}",
        f"--warmup={a.warmup}",
    ]


def run_fsdp_lab(m: dict, a, tmp: Path, *, side: str) -> dict:
    run_dir = tmp / side
    speed = {
        "fsdp_lab": ["compile=true", f"trainer.log_every={a.warmup}"],
        "fsdp_lab_chunked": ["compile=true", f"trainer.log_every={a.warmup}", "loss=chunked"],
        "fsdp_lab_float8": [
            "compile=true",
            f"trainer.log_every={a.warmup}",
            "precision.float8_recipe=tensorwise",
        ],
        "fsdp_lab_before": [
            "loss=hf",
            "optim.implementation=foreach",
            "trainer.log_every=1",
            "compile=false",
        ],
    }[side]
    cmd = [
        sys.executable,
        "train.py",
        f"hydra.run.dir={run_dir}",
        "hardware=gpu",
        "hardware.nproc_per_node=1",
        "precision=bf16",
        "model=llama_tiny",
        f"model.hidden_size={m['hidden']}",
        f"model.num_layers={m['layers']}",
        f"model.num_heads={m['heads']}",
        f"model.num_kv_heads={m['kv_heads']}",
        f"model.intermediate_size={m['ffn']}",
        f"model.vocab_size={m['vocab']}",
        f"model.max_position_embeddings={a.seq}",
        f"trainer.seq_len={a.seq}",
        f"trainer.micro_batch_size={a.batch or m['batch']}",
        f"trainer.max_steps={a.steps}",
        "trainer.eval_every=0",
        "trainer.progress_bar=false",
        "checkpoint=none",
        "logger=none",
        "optim.lr=3e-4",
        *speed,
        *a.fsdp_lab_args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "?")
    steps = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
    s_per_step = (steps[a.steps]["elapsed_s"] - steps[a.warmup]["elapsed_s"]) / (a.steps - a.warmup)
    run = json.loads((run_dir / "run.json").read_text())
    return {
        "s_per_step": s_per_step,
        "tokens_per_s": run["tokens_per_step"] / s_per_step,
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in steps.values()),
        "loss_kind": run.get("loss_kind"),
        "optimizer": run.get("optimizer"),
    }


def run_torchrun(script: str, m: dict, a, *extra: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        str(ROOT / "benchmarks" / script),
        *model_args(m, a),
        *extra,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=a.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
        raise RuntimeError(tail[-1] if tail else f"exit {proc.returncode}")
    return json.loads(lines[-1])


def flops_per_token(m: dict, seq: int) -> int:
    """fsdp_lab's count (metrics.flops_per_token): 6N + 12·L·H·Q·T, embeddings excluded."""
    from transformers import LlamaConfig

    from fsdp_lab.engine.model import build_meta_model
    from fsdp_lab.observe.metrics import flops_per_token as count

    cfg = LlamaConfig(
        vocab_size=m["vocab"],
        hidden_size=m["hidden"],
        intermediate_size=m["ffn"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"],
        max_position_embeddings=seq,
    )
    return count(build_meta_model(cfg), cfg, seq)


def device_peak() -> tuple[str, float | None]:
    import torch

    from fsdp_lab.config.hardware_profiles import peak_tflops

    if not torch.cuda.is_available():
        return "no GPU", None
    name = torch.cuda.get_device_name(0)
    peaks = peak_tflops(name)
    return name, peaks[0] * 1e12 if peaks else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="160m,1b")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps (compile, allocator)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument(
        "--batch", type=int, default=None, help="sequences per step (default: per model)"
    )
    p.add_argument("--timeout", type=int, default=900, help="seconds per side")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--fsdp-lab-args", nargs="*", default=[], help="more train.py overrides")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / "inductor"))
    name, peak = device_peak()
    print(
        f"device: {name}; dense bf16 peak {peak / 1e12:.0f} TFLOP/s"
        if peak
        else f"device: {name}; no known peak, MFU not reported",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for key in a.models.split(","):
            m = MODELS[key]
            fpt = flops_per_token(m, a.seq)
            for side in a.sides.split(","):
                t0 = time.perf_counter()
                try:
                    match side:
                        case (
                            "fsdp_lab" | "fsdp_lab_chunked" | "fsdp_lab_float8" | "fsdp_lab_before"
                        ):
                            r = run_fsdp_lab(m, a, Path(tmp) / key, side=side)
                        case "hf_docs" | "hf_fast":
                            r = run_torchrun(
                                "hf_trainer_side.py", m, a, f"--mode={side.removeprefix('hf_')}"
                            )
                        case "ceiling":
                            r = run_torchrun("ceiling_fsdp.py", m, a)
                        case _:
                            raise ValueError(f"unknown side {side}")
                    r["status"] = "ok"
                except Exception as e:  # noqa: BLE001 - one failed side must not end the run
                    r = {"status": f"failed: {str(e)[:300]}"}
                r.update(model=key, side=side, wall_s=time.perf_counter() - t0, flops_per_token=fpt)
                if r["status"] == "ok" and peak:
                    r["mfu"] = r["tokens_per_s"] * fpt / peak
                results.append(r)
                print(json.dumps(r), flush=True)
    print_table(results, name)
    if a.json:
        a.json.write_text(json.dumps({"device": name, "results": results}, indent=1))


def print_table(results: list[dict], device: str) -> None:
    print(f"\n{device}; ratios are tokens/s over the side named\n")
    print("| model | side | tokens/s | MFU | peak GiB | vs hf_docs | vs hf_fast | vs ceiling |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        if r["status"] != "ok":
            print(f"| {r['model']} | {r['side']} | {r['status']} | | | | | |")
            continue
        same = {o["side"]: o for o in results if o["model"] == r["model"] and o["status"] == "ok"}

        def ratio(other: str) -> str:
            if other not in same:
                return "-"
            return f"{r['tokens_per_s'] / same[other]['tokens_per_s']:.2f}"

        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        mem = f"{r['peak_mem_bytes'] / 2**30:.1f}" if r.get("peak_mem_bytes") else "-"
        print(
            f"| {r['model']} | {r['side']} | {r['tokens_per_s']:,.0f} | {mfu} | {mem} | "
            f"{ratio('hf_docs')} | {ratio('hf_fast')} | {ratio('ceiling')} |"
        )


if __name__ == "__main__":
    main()
