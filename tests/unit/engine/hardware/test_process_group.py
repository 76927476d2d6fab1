"""The process group: the backend each device gets, and rank 0's solo work outlasting the
collective timeout."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_lab.config import HardwareKind
from fsdp_lab.engine.hardware import process_group


def test_gpu_backend_puts_cpu_tensors_on_gloo():
    assert process_group.backend(HardwareKind.gpu) == "cuda:nccl,cpu:gloo"  # gloo: offloaded grads
    assert process_group.backend(HardwareKind.cpu) == "gloo"


def _solo_work_rank(rank: int, port: int, result_dir: str) -> None:
    import datetime
    import os
    import time

    import torch
    import torch.distributed as dist

    from fsdp_lab.engine.hardware import process_group

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=2))
    if rank == 0:
        time.sleep(4)  # rank 0's solo work outlasts the 2 s collective timeout
    process_group.after_rank0("solo")
    t = torch.tensor([float(rank == 0)])
    dist.broadcast(t, src=0)
    Path(f"{result_dir}/rank{rank}").write_text(str(t.item()))
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_wait_for_rank0_solo_work_beyond_the_collective_timeout(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_solo_work_rank, args=(port, str(tmp_path)), nprocs=2)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["1.0", "1.0"]
