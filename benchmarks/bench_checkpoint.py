"""Checkpoint save cost, side by side in one run: sharded (DCP) vs full vs plain torch.save, and
how long training is blocked by an async save vs a sync one, beside the disk's own write speed;
then what verifying that checkpoint before a resume costs (checkpoint.verify=checksum, size, and
the safe-load scan every resume does).

    python benchmarks/bench_checkpoint.py                 # ~56M-param Llama, 2 CPU ranks
    python benchmarks/bench_checkpoint.py --hidden 768 --layers 12

Runs itself under torchrun. Every save holds model + AdamW state (about 3x the model's fp32
bytes) and goes through fsdp_lab's Checkpointer (markers, fsync, rename included). Each figure is
the median of --repeats saves.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    return p.parse_args()


def timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def disk_write_mb_s(path: Path, num_bytes: int) -> float:
    """Sequential write of num_bytes in 64 MiB chunks, fsynced: the disk's own speed here."""
    chunk = os.urandom(64 * 2**20)
    t = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < num_bytes:
            f.write(chunk)
            written += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - t
    path.unlink()
    return written / 2**20 / elapsed


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from fsdp_lab.config import (
        CheckpointConfig,
        HardwareKind,
        ModelArch,
        ModelConfig,
        OptimConfig,
        OptimImpl,
        PrecisionConfig,
        PrefetchConfig,
        ShardingConfig,
        WrapConfig,
    )
    from fsdp_lab.config import (
        CheckpointFormat as F,
    )
    from fsdp_lab.config.topology import Topology
    from fsdp_lab.engine import fsdp, precision, wrap
    from fsdp_lab.engine import model as model_lib
    from fsdp_lab.state import checkpoint as ckpt
    from fsdp_lab.state.checkpoint import Checkpointer
    from fsdp_lab.train.optim import build_optimizer, build_scheduler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology(world_size=world, nproc_per_node=world, num_nodes=1, device=HardwareKind.cpu)
    hf = model_lib.build_hf_config(
        ModelConfig(
            arch=ModelArch.llama,
            vocab_size=a.vocab,
            hidden_size=a.hidden,
            intermediate_size=4 * a.hidden,
            num_layers=a.layers,
            num_heads=8,
            num_kv_heads=8,
        )
    )
    model = model_lib.build_meta_model(hf)
    mesh = fsdp.build_mesh(ShardingConfig(), topo, device_type="cpu")
    fsdp.apply_fsdp(
        model,
        wrap.select_units(model, WrapConfig()),
        mesh=mesh,
        reshard_after_forward=True,
        mp_policy=precision.build_mp_policy(PrecisionConfig()),
        offload_policy=None,
        prefetch=PrefetchConfig(),
    )
    model_lib.materialize(
        model, device=torch.device("cpu"), source=lambda: model_lib.build_full_model(hf, seed=0)
    )
    optimizer = build_optimizer(model, OptimConfig(), implementation=OptimImpl.fused)
    scheduler = build_scheduler(optimizer, OptimConfig(), max_steps=10)
    ids = torch.randint(0, a.vocab, (1, 32))
    model(input_ids=ids, labels=ids).loss.backward()  # so AdamW has its state
    optimizer.step()
    optimizer.zero_grad()

    root = Path(a.dir)
    params = sum(p.numel() for p in model.parameters())

    def checkpointer(fmt, name, **kw):
        return Checkpointer(
            CheckpointConfig(format=fmt, keep_last=1, **kw),
            root / name,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=None,
            config={},
            device=torch.device("cpu"),
        )

    results: dict[str, list[float]] = {
        k: [] for k in ("sharded", "full", "torch_save", "async_blocked", "async_total")
    }
    sharded, full = checkpointer(F.sharded, "sharded"), checkpointer(F.full, "full")
    background = checkpointer(F.sharded, "async", async_enabled=True)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    for i in range(a.repeats):
        results["sharded"].append(timed(lambda: sharded.save(i + 1, 0, blocking=True)))
        results["full"].append(timed(lambda: full.save(i + 1, 0, blocking=True)))
        model_sd = get_model_state_dict(model, options=opts)
        optim_sd = get_optimizer_state_dict(model, optimizer, options=opts)
        plain = root / "plain.pt"

        def torch_save():
            if rank == 0:
                torch.save({"model": model_sd, "optim": optim_sd}, plain)
                with open(plain, "rb+") as f:
                    os.fsync(f.fileno())

        results["torch_save"].append(timed(torch_save))
        dist.barrier()
        t = time.perf_counter()
        background.save(i + 1, 0)  # returns once the state is staged; writing goes on
        results["async_blocked"].append(time.perf_counter() - t)
        background.wait()
        results["async_total"].append(time.perf_counter() - t)
    if rank == 0:
        ckpt_bytes = sum(p.stat().st_size for p in (root / "sharded").rglob("*") if p.is_file())
        mb = ckpt_bytes / 2**20
        disk = statistics.median(disk_write_mb_s(root / "disk.bin", ckpt_bytes) for _ in range(2))
        med = {k: statistics.median(v) for k, v in results.items()}
        print(
            f"\nmodel {params / 1e6:.1f}M params, checkpoint {mb:.0f} MB (model + AdamW), "
            f"{world} ranks, median of {a.repeats}\n"
        )
        print("| save | seconds | MB/s | vs torch.save |\n|---|---|---|---|")
        for name, label in (
            ("torch_save", "plain torch.save (rank 0, state already gathered)"),
            ("full", "checkpoint=full (gather to rank 0 + save)"),
            ("sharded", "checkpoint=sharded (DCP, every rank writes)"),
            ("async_total", "sharded async: until complete"),
        ):
            print(
                f"| {label} | {med[name]:.2f} | {mb / med[name]:.0f} | "
                f"{med[name] / med['torch_save']:.2f} |"
            )
        print(
            f"| sharded async: training blocked | {med['async_blocked']:.2f} | | "
            f"{med['async_blocked'] / med['torch_save']:.2f} |"
        )
        print(f"\ndisk write speed (fsynced, same size): {disk:.0f} MB/s")
        print(
            f"async blocks training {med['async_blocked'] / med['sharded']:.2f}x as long as a "
            "sync sharded save"
        )
        verify_table(ckpt.latest_checkpoint(root / "sharded"), mb, med["sharded"], a.repeats)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def verify_table(path: Path, mb: float, save_s: float, repeats: int) -> None:
    """What checking the checkpoint before a resume costs (files in the page cache, as right
    after a save or on a re-run; a cold read adds the disk's read time)."""
    from fsdp_lab.config import CheckpointVerify
    from fsdp_lab.state import integrity, safe_load

    def median_s(fn) -> float:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    marker = integrity.read_marker(path)
    rows = {
        "checkpoint.verify=checksum": median_s(
            lambda: integrity.verify(path, CheckpointVerify.checksum)
        ),
        "checkpoint.verify=size": median_s(lambda: integrity.verify(path, CheckpointVerify.size)),
        "safe-load scan (every resume)": median_s(lambda: safe_load.scan(path, marker)),
    }
    print(f"\n| before a resume ({mb:.0f} MB) | seconds | MB/s | vs the sharded save |")
    print("|---|---|---|---|")
    for name, s in rows.items():
        print(f"| {name} | {s:.3f} | {mb / s:.0f} | {s / save_s:.3f} |")


def main() -> None:
    a = parse()
    if "RANK" in os.environ:
        worker(a)
    own = a.dir is None
    out = Path(a.dir or tempfile.mkdtemp(prefix="fsdp_lab_bench_ckpt_"))
    try:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={a.nproc}",
            __file__,
            *sys.argv[1:],
            "--dir",
            str(out),
        ]
        subprocess.run(cmd, check=True)
    finally:
        if own:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
