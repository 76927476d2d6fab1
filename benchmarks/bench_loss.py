"""The loss over the vocabulary, every implementation side by side: time and peak memory.

    python benchmarks/bench_loss.py                           # CPU: SmolLM2's 49k vocabulary
    python benchmarks/bench_loss.py --device cuda --tokens 32768 --hidden 2048 --vocab 32000

For N tokens of hidden size H and a vocabulary of V, each implementation takes the same hidden
states and head weight (the compute dtype) and targets, and computes the mean cross-entropy and
its gradients: ``hf`` as a causal LM does (logits = hidden @ W.T, upcast to fp32,
F.cross_entropy), ``chunked`` (fsdp_lab.train.loss.linear_cross_entropy, eager and compiled), and on
GPU ``liger`` and ``cce`` where installed. Each runs in a process of its own, so the peak is its
own: the allocator's peak on GPU, the resident-set high-water mark on CPU, less what the inputs
hold. Differences from ``hf`` are reported for the loss and both gradients.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(a) -> dict:
    import torch
    import torch.nn.functional as F

    from fsdp_lab.engine.hardware import devices, memory
    from fsdp_lab.train import loss as loss_lib

    device = torch.device(a.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(a.tokens, a.hidden, generator=gen) / 4).to(device, dtype)
    weight = (torch.randn(a.vocab, a.hidden, generator=gen) / a.hidden**0.5).to(device, dtype)
    targets = torch.randint(0, a.vocab, (a.tokens,), generator=gen).to(device)
    targets[::97] = loss_lib.IGNORE_INDEX
    hidden.requires_grad_(True)
    weight.requires_grad_(True)

    def run():
        match a.impl:
            case "hf":
                logits = (hidden @ weight.t()).float()
                return F.cross_entropy(logits, targets, ignore_index=loss_lib.IGNORE_INDEX)
            case "chunked" | "chunked_compiled":
                return loss_lib.linear_cross_entropy(
                    hidden,
                    weight,
                    targets,
                    chunk_size=a.chunk_size
                    or loss_lib.tokens_per_chunk(loss_lib.LossConfig(), a.vocab),
                    compiled=a.impl == "chunked_compiled",
                )
            case "liger":
                return loss_lib._liger(hidden, weight, targets, reduction="mean")
            case "cce":
                return loss_lib._cce(hidden, weight, targets, reduction="mean")
        raise ValueError(a.impl)

    def step():
        hidden.grad = weight.grad = None
        value = run()
        value.backward()
        return value

    for _ in range(2):  # warm-up (and compilation)
        step()
    devices.synchronize(device)
    base = memory.current_memory_bytes(device)
    memory.reset_peak_memory(device)
    times = []
    for _ in range(a.reps):
        start = time.perf_counter()
        value = step()
        devices.synchronize(device)
        times.append(time.perf_counter() - start)
    peak = memory.peak_memory_bytes(device) - base
    times.sort()
    out = {
        "impl": a.impl,
        "ms": 1e3 * times[len(times) // 2],
        "peak_mib": peak / 2**20,
        "loss": value.item(),
    }
    torch.save(
        {
            "loss": value.detach().cpu(),
            "grad_hidden": hidden.grad.float().cpu(),
            "grad_weight": weight.grad.float().cpu(),
        },
        a.save,
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["bf16", "fp32"],
        help="default: bf16 on GPU, fp32 on CPU (bf16 matmuls are slow there)",
    )
    p.add_argument("--tokens", type=int, default=4096, help="B x T, e.g. 4 x 1024")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--chunk-size", type=int, default=None)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--impls", default=None, help="comma-separated; default: all that apply")
    p.add_argument("--impl", default=None, help=argparse.SUPPRESS)
    p.add_argument("--save", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    a.dtype = a.dtype or ("fp32" if a.device == "cpu" else "bf16")
    if a.impl:  # a child: one implementation
        print(json.dumps(measure(a)), flush=True)
        return
    import importlib.util
    import tempfile

    import torch

    impls = (
        a.impls.split(",")
        if a.impls
        else (
            ["hf", "chunked", "chunked_compiled"]
            + [
                name
                for name, module in (("liger", "liger_kernel"), ("cce", "cut_cross_entropy"))
                if a.device != "cpu" and importlib.util.find_spec(module)
            ]
        )
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for impl in impls:
            save = Path(tmp) / f"{impl}.pt"
            args = [
                f"--{k.replace('_', '-')}={v}"
                for k, v in vars(a).items()
                if v is not None and k not in ("impls", "impl", "save")
            ]
            proc = subprocess.run(
                [sys.executable, __file__, *args, f"--impl={impl}", f"--save={save}"],
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                rows.append(
                    {"impl": impl, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
                )
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            row["grads"] = torch.load(save)
            rows.append(row)
    ref = next((r for r in rows if r["impl"] == "hf" and "grads" in r), None)
    print(f"\n{a.tokens} tokens, hidden {a.hidden}, vocab {a.vocab}, {a.dtype} on {a.device}\n")
    print("| loss | ms (fwd+bwd) | peak MiB | vs hf memory | loss diff | grad diff (max rel) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['impl']} | failed: {r['error'][:120]} | | | | |")
            continue
        diff = grad = mem = "-"
        if ref is not None:
            g, h = r["grads"], ref["grads"]
            diff = f"{abs(g['loss'] - h['loss']).item():.1e}"
            grad = max(
                (g[k] - h[k]).abs().max().item() / h[k].abs().max().item()
                for k in ("grad_hidden", "grad_weight")
            )
            grad = f"{grad:.1e}"
            mem = f"{r['peak_mib'] / ref['peak_mib']:.2f}" if ref["peak_mib"] > 0 else "-"
        print(f"| {r['impl']} | {r['ms']:.1f} | {r['peak_mib']:.0f} | {mem} | {diff} | {grad} |")


if __name__ == "__main__":
    main()
