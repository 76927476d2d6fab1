"""Peak host memory per rank while loading a pretrained model: fsdp_lab vs every rank loading it.

    python benchmarks/bench_loading.py                 # SmolLM2-135M, 2 CPU ranks
    python benchmarks/bench_loading.py --model DIR --nproc 4

fsdp_lab (model.pretrained=true): every rank builds the model on meta and shards it; rank 0
alone reads the safetensors into a CPU model and broadcasts it, tensor by tensor, into the other
ranks' shards. The baseline (naive_load.py) calls from_pretrained on every rank, then shards.
Both keep fp32 master weights. Reported: each rank's peak RSS after loading (ru_maxrss), and the
same minus the process's RSS after imports (the baseline's), in MB, side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20


def fsdp_lab_rss(model: str, nproc: int, tmp: Path) -> list[int]:
    run_dir = tmp / "fsdp_lab"
    subprocess.run(
        [
            sys.executable,
            "train.py",
            f"hydra.run.dir={run_dir}",
            "hardware=cpu",
            f"hardware.nproc_per_node={nproc}",
            "model=local",
            f"model.name_or_path={model}",
            "trainer.max_steps=1",
            "trainer.seq_len=32",
            "trainer.micro_batch_size=1",
            "trainer.eval_every=0",
            "checkpoint=none",
            "trainer.progress_bar=false",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return json.loads((run_dir / "run.json").read_text())["load_peak_rss_bytes_per_rank"]


def naive_rss(model: str, nproc: int) -> list[dict]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(ROOT / "benchmarks" / "naive_load.py"),
            f"--model={model}",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model dir (default: SmolLM2-135M, prepared on demand)")
    p.add_argument("--nproc", type=int, default=2)
    a = p.parse_args()
    if a.model is None:
        sys.path.insert(0, str(ROOT / "scripts"))
        from prepare_smollm2 import prepare

        a.model = str(prepare())
    with tempfile.TemporaryDirectory() as tmp:
        ours = fsdp_lab_rss(a.model, a.nproc, Path(tmp))
        naive = naive_rss(a.model, a.nproc)
    from transformers import AutoConfig

    print(
        f"model: {a.model} ({AutoConfig.from_pretrained(a.model).model_type}), "
        f"{a.nproc} ranks; MB of peak RSS (minus the ~{naive[0]['base'] // MB} MB after imports)"
    )
    print("| rank | fsdp_lab | every rank loads | ratio |")
    print("| --- | --- | --- | --- |")
    for r in range(a.nproc):
        base = naive[r]["base"]
        o, n = ours[r] - base, naive[r]["loaded"] - base
        print(
            f"| {r} | {ours[r] // MB} ({o // MB}) | {naive[r]['loaded'] // MB} ({n // MB}) | "
            f"{o / n:.2f} |"
        )


if __name__ == "__main__":
    main()
