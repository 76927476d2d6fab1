"""One rank of pipeline-parallel training under each of several schedules, with the worker's own
code, for tests: run under torchrun (one process group for every schedule, so the start-up is
paid once).

    python -m torch.distributed.run --standalone --nproc_per_node N tests/pipeline_ranks.py \
        OUT_DIR STEPS SCHEDULE[,SCHEDULE...] OVERRIDES...

For each schedule: the train state as a rank of train.py builds it (``train.build``), then
STEPS optimizer steps of ``train.loop.train_step`` on the run's batches. Rank 0 writes
OUT_DIR/<schedule>.json: each step's loss and gradient norm (every rank holds them).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    out, steps, schedules, *overrides = sys.argv[1:]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from fsdp_lab.config import HardwareKind, compose
    from fsdp_lab.train.build import RankContext, build_train_state
    from fsdp_lab.train.loop import averaged_ranks, train_step
    from fsdp_lab.train.worker import topology_from_env

    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ctx = RankContext(
        rank, HardwareKind.cpu, torch.device("cpu"), topology_from_env(HardwareKind.cpu), world, 1
    )
    for schedule in schedules.split(","):
        cfg = compose(
            [
                "hardware=cpu",
                f"hardware.nproc_per_node={world}",
                "checkpoint=none",
                "resume=never",
                "trainer.eval_every=0",
                f"trainer.max_steps={steps}",
                f"parallel.pipeline_schedule={schedule}",
                *overrides,
            ]
        )
        state = build_train_state(cfg, ctx, Path(out) / schedule)
        records = []
        for step in range(int(steps)):
            rows, targets = state.data.step_batches(step)
            result = train_step(
                state.sharded.model,
                [state.sharded.place_batch(b) for b in rows],
                targets=targets,
                dp=averaged_ranks(state.data),
                optimizer=state.optimizer,
                scaler=None,
                grad_clip=cfg.optim.grad_clip,
                loss=state.loss,
                pipeline=state.sharded.pipeline,
            )
            state.scheduler.step()
            # averaged over the world's ranks, as the loop's window does
            loss = result.loss.detach().clone()
            dist.all_reduce(loss)
            records.append({"loss": loss.item() / world, "grad_norm": float(result.grad_norm)})
        if rank == 0:
            facts = dataclasses.asdict(state.sharded.pipeline.layout.schedule)
            facts = {k: v for k, v in facts.items() if isinstance(v, str | int | bool)}
            path = Path(out) / f"{schedule}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"records": records, "schedule": facts}))
        dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
