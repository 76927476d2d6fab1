"""Record the gloo flight recorder dumps next to this file (test_flight.py reads them).

Two ranks, 3 s timeout. ``behind``: rank 1 skips collective #5, which rank 0 times out in.
``mismatch``: rank 1 enters an all_gather as #5 where rank 0 all-reduces; both time out.
Each rank then saves its record as a failed rank does (``flight.save``); for ``behind`` rank 0
also keeps torch's own JSON dump. Run: PYTHONPATH=. python tests/unit/observe/data/<this file>
"""

import datetime
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_lab.engine.hardware import process_group
from fsdp_lab.observe import flight

OUT = Path(__file__).resolve().parent


def step(t):
    dist.all_reduce(t)


def main(rank, case, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    process_group.set_flight_recorder(100, None)
    timeout = datetime.timedelta(seconds=3)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timeout)
    t = torch.ones(10)
    for _ in range(3):
        step(t)
    dist.all_gather_into_tensor(torch.empty(20), t)
    try:
        if rank == 0:
            step(t)
        elif case == "mismatch":
            dist.all_gather_into_tensor(torch.empty(20), t)
        else:
            time.sleep(5)
    except RuntimeError as e:
        print(rank, str(e)[-80:])
    flight.save(process_group.flight_records(), OUT / f"{case}_rank{rank}.flight.json", rank)
    if case == "behind" and rank == 0:
        raw = torch._C._distributed_c10d._dump_fr_trace_json()
        (OUT / "behind_rank0.torch.json").write_bytes(raw)
    os._exit(0)


if __name__ == "__main__":
    import torch.multiprocessing as mp

    for i, case in enumerate(sys.argv[1:] or ["behind", "mismatch"]):
        mp.spawn(main, args=(case, 29820 + i), nprocs=2)
