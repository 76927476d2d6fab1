"""The time model against published training runs it never saw: every row of
benchmarks/published_runs.json (a measurement, its setup, its source, commit and date) is
planned as fsdp-lab expresses it and predicted on its device's named row, then the table in
docs/benchmarks.md ("Published runs") is written between its markers, untouched by hand.

    python benchmarks/published_runs.py            # predict all, rewrite the doc's table
    python benchmarks/published_runs.py --check    # exit 1 where the doc's table is stale
    python benchmarks/published_runs.py --only torchtitan --verbose

Rows it cannot express (pipeline stages, another framework's kernels or fp8, MFU-only
tables) are listed with the reason, never dropped. A row beyond +-25% names its reason
(``miss`` in the JSON) or says that none is recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fsdp_lab.config.device_rows import device_profile  # noqa: E402
from fsdp_lab.config.hardware_profiles import Link, write_profile  # noqa: E402
from fsdp_lab.planning import plan  # noqa: E402

DATA = ROOT / "benchmarks" / "published_runs.json"
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "benchmarks" / "results" / "published-runs.json"
BEGIN, END = "<!-- published-runs:begin -->", "<!-- published-runs:end -->"
BAND = 0.25  # a row beyond this names its reason
# A network's ring bus bandwidth over its line rate: NCCL reaches 46-48 GB/s of a 400 Gb/s NIC
# (NVIDIA, nccl-tests#290), and a ring's channels cross nodes through every NIC of a node.
NIC_EFFICIENCY = 0.94
PRESETS = {"llama": "llama_tiny", "gpt2": "gpt2_tiny", "qwen3_moe": "qwen3_moe_tiny"}


def overrides(r: dict) -> list[str]:
    """The row as fsdp-lab's overrides."""
    a, nproc = r["arch"], min(r["gpus"], r["gpus_per_node"])
    out = [
        "hardware=gpu",
        f"hardware.nproc_per_node={nproc}",
        f"hardware.num_nodes={r['gpus'] // nproc}",
        f"model={PRESETS[r['family']]}",
        f"model.hidden_size={a['hidden']}",
        f"model.num_layers={a['layers']}",
        f"model.num_heads={a['heads']}",
        f"model.num_kv_heads={a['kv_heads']}",
        f"model.vocab_size={a['vocab']}",
        f"model.max_position_embeddings={r['seq_len']}",
        f"trainer.seq_len={r['seq_len']}",
        f"trainer.micro_batch_size={r['micro_batch']}",
        f"trainer.grad_accum_steps={r['grad_accum']}",
        f"sharding={r['sharding']}",
        f"activation_checkpointing={r['ac']}",
        f"compile={str(r['compile']).lower()}",
        "precision=bf16",
    ]
    if r["family"] == "qwen3_moe":
        out += [f"model.num_experts={a['experts']}", f"model.experts_per_token={a['top_k']}",
                f"model.expert_intermediate_size={a['expert_intermediate']}",
                "model.experts_implementation=grouped_mm"]  # fmt: skip
    else:
        out.append(f"model.intermediate_size={a['intermediate']}")
    if r["finetune"] == "lora":  # AutoModel's: rank 16, alpha 32, every linear layer
        linears = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
        out += ["finetune=lora", "finetune.r=16", "finetune.alpha=32",
                f"finetune.target_modules=[{linears}]"]  # fmt: skip
    if r["sharding"] == "hybrid":
        out.append(f"sharding.replicate_size={r['replicate']}")
    for key, name in (("tp", "tensor"), ("cp", "context"), ("ep", "expert")):
        if r[key] > 1:
            out.append(f"parallel.{name}={r[key]}")
    if r["precision"] == "float8":
        out.append(f"precision.float8_recipe={r['float8_recipe']}")
        if r["float8_all_gather"]:
            out.append("precision.float8_all_gather=true")
    return out


def device(r: dict, tmp: Path) -> str:
    """The row's device: its named row, with the network the row publishes where it does (a
    node's line rate at NCCL's efficiency, its ring's bus bandwidth a GPU)."""
    if not r.get("node_gbps"):
        return r["device"]
    row = device_profile(r["device"])
    link = Link(r["node_gbps"] / 8 * 1e9 * NIC_EFFICIENCY, row.inter_node.latency_s)
    source = f"{r['source']}: {r['node_gbps']} Gb/s a node, at NCCL's {NIC_EFFICIENCY:.0%}"
    path = tmp / f"{r['device']}-{r['node_gbps']}.json"
    write_profile(dataclasses.replace(row, inter_node=link, name=f"{row.name} ({r['node_gbps']} "
                  "Gb/s a node)", sources={**row.sources, "inter_node": source}), path)  # fmt: skip
    return str(path)


def predict(r: dict, tmp: Path) -> dict:
    """The row's predicted tokens/s per GPU (or why it could not be planned)."""
    try:
        built = plan.build_plan(overrides(r), device(r, tmp))
    except Exception as e:  # noqa: BLE001 - a row the plan refuses is reported, not fatal
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    t = built.chosen_plan.time
    published = r["published_tokens_per_s_per_gpu"]
    return {
        "predicted": t.tokens_per_s,
        "error": t.tokens_per_s / published - 1,
        "mfu": t.mfu,
        "split": {k: round(t.share(k), 3) for k in ("compute_s", "exposed_comm_s", "optimizer_s")},
    }


def setup(r: dict) -> str:
    parallel = f"FSDP {r['gpus'] // (r['tp'] * r['cp'] * r['replicate'])}"
    if r["replicate"] > 1:
        parallel = f"HSDP {r['replicate']}x{r['gpus'] // r['replicate']}"
    parallel += "".join(f" {k.upper()} {r[k]}" for k in ("tp", "cp", "ep") if r[k] > 1)
    extras = [f"{r['micro_batch']}x{r['seq_len']}"]
    if r["grad_accum"] > 1:
        extras.append(f"accum {r['grad_accum']}")
    extras.append(f"AC {r['ac']}")
    if r["finetune"] != "full":
        extras.append(r["finetune"])
    if r["compile"]:
        extras.append("compile")
    if r["precision"] == "float8":
        extras.append(f"float8 {r['float8_recipe']}" + (" +AG" if r["float8_all_gather"] else ""))
    net = f" ({r['node_gbps']} Gb/s a node)" if r.get("node_gbps") else ""
    return f"{r['gpus']} x {r['device']}{net}, {parallel}, {', '.join(extras)}"


def render(rows: list[dict], predictions: dict[str, dict]) -> str:
    ok = [r for r in rows if not r["not_expressible"] and "predicted" in predictions[r["id"]]]
    errors = sorted(abs(predictions[r["id"]]["error"]) for r in ok)
    p90 = errors[min(len(errors) - 1, int(0.9 * len(errors)))]
    sources = sorted({r["source"] for r in ok})
    lines = [
        f"{len(ok)} published runs from {len(sources)} sources, predicted on their devices' "
        f"named rows: median |error| **{100 * statistics.median(errors):.1f}%**, 90th "
        f"percentile **{100 * p90:.1f}%**, worst {100 * errors[-1]:.1f}%; "
        f"{sum(e <= BAND for e in errors)} within +-{100 * BAND:.0f}%. Written by "
        "`python benchmarks/published_runs.py` from `benchmarks/published_runs.json`.",
        "",
        "| source | rows | median \\|error\\| | 90th pct | within +-25% |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for source in sources:
        e = sorted(abs(predictions[r["id"]]["error"]) for r in ok if r["source"] == source)
        q = e[min(len(e) - 1, int(0.9 * len(e)))]
        lines.append(f"| {source} | {len(e)} | {100 * statistics.median(e):.1f}% | "
                     f"{100 * q:.1f}% | {sum(x <= BAND for x in e)} |")  # fmt: skip
    lines += ["", "| row | model | setup | published tok/s/GPU | predicted | error |",
              "| --- | --- | --- | ---: | ---: | ---: |"]  # fmt: skip
    for r in ok:
        p = predictions[r["id"]]
        lines.append(f"| {r['id']} | {r['model']} | {setup(r)} | "
                     f"{r['published_tokens_per_s_per_gpu']:,.0f} | {p['predicted']:,.0f} | "
                     f"{100 * p['error']:+.1f}% |")  # fmt: skip
    misses = [r for r in ok if abs(predictions[r["id"]]["error"]) > BAND]
    lines += ["", f"**Beyond +-25%** ({len(misses)} rows), and why:", ""]
    for r in misses:
        why = r.get("miss") or "no reason recorded yet"
        lines.append(f"- {r['id']} ({100 * predictions[r['id']]['error']:+.1f}%): {why}")
    refused = [
        r for r in rows if not r["not_expressible"] and "predicted" not in predictions[r["id"]]
    ]
    if refused:
        lines += ["", "**Planned with an error** (a row fsdp-lab should express):", ""]
        lines += [f"- {r['id']}: {predictions[r['id']]['error']}" for r in refused]
    lines += ["", f"**Not expressible** ({sum(1 for r in rows if r['not_expressible'])} rows):", ""]
    by_reason: dict[str, list[str]] = {}
    for r in rows:
        if r["not_expressible"]:
            by_reason.setdefault(r["not_expressible"], []).append(f"{r['model']} ({r['source']})")
    for why, which in sorted(by_reason.items()):
        lines.append(f"- {why}: {'; '.join(which)}")
    return "\n".join(lines)


# This project's own runs on one H100 80GB HBM3 (benchmarks/results/h100-2026-11-26-*.json):
# (name, overrides, measured step s). Not in the published table: the first one's profiled
# matmul kernels are where the GPU rows' shape_fraction comes from.
LLAMA_1B = ["experiment=gpu_1b", "hardware.nproc_per_node=1"]
QWEN3_MOE = [
    "hardware=gpu", "hardware.nproc_per_node=1", "precision=bf16", "model=qwen3_moe_tiny",
    "model.hidden_size=1024", "model.num_layers=8", "model.num_heads=16",
    "model.num_kv_heads=4", "model.num_experts=64", "model.experts_per_token=8",
    "model.expert_intermediate_size=512", "model.vocab_size=32000", "trainer.seq_len=2048",
    "model.max_position_embeddings=2048", "trainer.micro_batch_size=8",
    "model.experts_implementation=grouped_mm",
]  # fmt: skip
OWN_H100 = [
    ("1.1B Llama, 8 x 2048, compiled", [*LLAMA_1B, "trainer.micro_batch_size=8"], 0.24827),
    ("1.1B Llama, 16 x 2048, compiled", LLAMA_1B, 0.46307),
    ("160M Llama, 16 x 2048, compiled", ["experiment=gpu_160m", "hardware.nproc_per_node=1"],
     0.074058),
    ("Qwen3-MoE 0.9B (64 experts, top 8, grouped_mm), 8 x 2048, eager", QWEN3_MOE,
     8 * 2048 / 114205.18),
]  # fmt: skip


def own_h100() -> str:
    """This project's H100 rows, predicted on the h100 row: a markdown table."""
    lines = ["| run | predicted ms | measured ms | error | predicted MFU |",
             "| --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, args, measured in OWN_H100:
        t = plan.build_plan(args, "h100").chosen_plan.time
        lines.append(f"| {name} | {1e3 * t.step_s:.1f} | {1e3 * measured:.1f} | "
                     f"{100 * (t.step_s / measured - 1):+.1f}% | {100 * t.mfu:.1f}% |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", help="rows whose source contains this")
    p.add_argument("--check", action="store_true", help="exit 1 where docs' table is stale")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--own", action="store_true", help="this project's H100 rows only")
    a = p.parse_args()
    if a.own:
        print(own_h100())
        return
    rows = json.loads(DATA.read_text())
    start = time.perf_counter()
    predictions = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in rows:
            if r["not_expressible"] or (a.only and a.only not in r["source"]):
                continue
            predictions[r["id"]] = predict(r, Path(tmp))
            if a.verbose:
                print(r["id"], setup(r), predictions[r["id"]], file=sys.stderr, flush=True)
    if a.only:
        errs = [abs(v["error"]) for v in predictions.values() if "predicted" in v]
        print(f"{len(errs)} rows: median {100 * statistics.median(errs):.1f}%")
        return
    table = render(rows, predictions)
    doc = DOC.read_text()
    head, _, rest = doc.partition(BEGIN)
    _, _, tail = rest.partition(END)
    new = f"{head}{BEGIN}\n{table}\n{END}{tail}"
    if a.check:  # writes nothing
        sys.exit(0 if new == doc else 1)
    RESULTS.write_text(json.dumps(predictions, indent=1) + "\n")
    DOC.write_text(new)
    print(table.splitlines()[0])
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
