"""One rank of a load (and export) with the worker's own code, for tests: run under torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node N tests/loading_ranks.py \
        [--compare] [--export DIR] OUT_DIR OVERRIDES...

Builds the run's model on meta, shards and fills it as a rank of train.py does
(``train.build._shard_and_fill``), and writes OUT_DIR/rank<R>.json: its host peak RSS after the
load (and after the export), the frozen base's fingerprint, and with ``--compare`` every tensor
this rank holds compared bitwise with transformers' ``from_pretrained`` (upcast to fp32), or
for a random init with the whole model ``engine.model.full_model`` draws in one process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--export", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fsdp_lab.config import HardwareKind, compose
    from fsdp_lab.engine import model as model_lib
    from fsdp_lab.engine.hardware import memory
    from fsdp_lab.train.build import RankContext, _shard_and_fill
    from fsdp_lab.train.worker import topology_from_env

    world = int(os.environ["WORLD_SIZE"])
    cfg = compose(["hardware=cpu", f"hardware.nproc_per_node={world}", *args.overrides])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    topo = topology_from_env(HardwareKind.cpu)
    ctx = RankContext(rank, HardwareKind.cpu, torch.device("cpu"), topo, world, 1)
    hf_config = model_lib.build_hf_config(cfg.model)
    meta = model_lib.model_on_meta(hf_config, cfg.model.task, cfg.finetune)
    started = time.perf_counter()
    sharded = _shard_and_fill(cfg, ctx, meta, hf_config)
    dist.barrier()
    facts = {
        "rank": rank,
        "load_s": time.perf_counter() - started,
        "load_rss": memory.host_peak_rss_bytes(),
        "fingerprint": sharded.frozen_fingerprint,
    }
    if args.compare:
        facts.update(_compare(sharded.model, cfg, hf_config))
    if args.export is not None:
        from fsdp_lab.state.export import ExportTarget, export_model

        dist.barrier()
        memory.reset_host_peak()
        target = ExportTarget(args.export)
        export_model(
            sharded.owned_tensors(), sharded.full_tensors, target, cfg, hf_config, writer=rank == 0
        )
        facts["export_rss"] = memory.host_peak_since_reset_bytes()
        dist.barrier()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(facts))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _compare(model, cfg, hf_config) -> dict:
    """Every tensor this rank holds against the whole model's same region."""
    from fsdp_lab.engine import conversion, loading
    from fsdp_lab.engine import model as model_lib

    if cfg.model.pretrained:
        whole = model_lib.load_pretrained(cfg.model.name_or_path, cfg.model.task).state_dict()
    else:
        whole = model_lib.full_model(
            hf_config, seed=cfg.seed, task=cfg.model.task, finetune_cfg=cfg.finetune
        ).state_dict()
    checked, bad = 0, []
    for name, (_, _, t) in conversion.owned_tensors(model).items():
        key = conversion.checkpoint_key(name)
        if key not in whole:  # adapters: drawn, not read
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        want = whole[key][loading.local_region(t)]
        checked += 1
        if local.dtype != torch.float32 or not torch.equal(local.detach(), want.to(local.dtype)):
            bad.append(name)
    return {"checked": checked, "bad": bad}


if __name__ == "__main__":
    main()
