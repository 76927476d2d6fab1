"""Finished runs' losses against the unsharded single-process reference (tests/reference.py, on
the CPU in fp32) over the same global batches: python compare_reference.py RUN_DIR...
A GPU run in fp32 with TF32 off is compared; the figure is the largest loss difference."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from omegaconf import OmegaConf  # noqa: E402
from reference import reference_run  # noqa: E402

from fsdp_lab.config import to_typed  # noqa: E402
from fsdp_lab.observe.run_logs import read_metrics  # noqa: E402

for arg in sys.argv[1:]:
    run = Path(arg)
    cfg = to_typed(OmegaConf.load(run / "config.yaml"))
    facts = json.loads((run / "run.json").read_text())
    records = read_metrics(run / "metrics.jsonl")
    want, norms = reference_run(cfg, world_size=facts["world_size"])
    diff = max(abs(r["loss"] - w) for r, w in zip(records, want, strict=True))
    norm = max(abs(r["grad_norm"] - n) / n for r, n in zip(records, norms, strict=True))
    print(
        f"{run.name}: world size {facts['world_size']}, backend {facts.get('backend')}, "
        f"{len(records)} steps, max |loss - reference| {diff:.2e}, grad norm rel {norm:.2e}"
    )
