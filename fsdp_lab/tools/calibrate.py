"""`fsdp-lab calibrate [OVERRIDES] --out PROFILE.json`: measure the machine at hand into a
hardware profile that `fsdp-lab plan --device PROFILE.json` (and tune, and the runs' own
predictions) read.

    fsdp-lab calibrate hardware=cpu hardware.nproc_per_node=2 --out cpu2.json
    fsdp-lab calibrate hardware=gpu precision=bf16 model=local \
         model.name_or_path=DIR --out h100.json

The overrides say which ranks and which model: the node's ``hardware.nproc_per_node`` ranks
start at once (as a run's would, sharing its cores, memory and links) and each measures
(``engine.hardware.calibration``): matmul FLOP/s at the model's shapes in its compute dtype
(a micro-batch's tokens against each projection, the MLP and the head), memory bandwidth, the
cost of issuing one operator and one optimizer tensor, all-gather / reduce-scatter / all-reduce
at the sizes of its FSDP units on the real backend, each after a layer's matmul as in a step
(so that waiting for a late rank is in it; latency and bus bandwidth fitted over the sizes), and
host<->device copies. Each is repeated ``--repeats`` times; where the repeats spread more than
``--max-spread`` (the machine is busy, or throttling) nothing is written and the command says
which measurement and by how much. What one node cannot measure (the network between nodes,
other dtypes) is the ``--base`` profile's (default: the named device this machine is, or cpu).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import platform
import queue
import statistics
import tempfile
import time
from pathlib import Path

from fsdp_lab.config import ConfigError, HardwareKind
from fsdp_lab.config.hardware_profiles import (
    COLLECTIVES,
    DeviceProfile,
    Link,
    device_profile,
    row_for,
    write_profile,
)
from fsdp_lab.config.load import compose
from fsdp_lab.config.precisions import dtype_row
from fsdp_lab.config.rules import validate
from fsdp_lab.tools import memory, plan

MIB = 2**20
SIZES = (64 * 1024, MIB, 16 * MIB)  # besides the units' own: small ones fit the latency
MAX_SIZE = 256 * MIB


@dataclasses.dataclass(frozen=True)
class Job:
    """What every rank measures (picklable: sent to the ranks)."""

    kind: HardwareKind
    nproc: int
    threads: int | None
    dtype: str
    shapes: list[tuple[int, int, int]]
    attention: tuple[int, int, int, int]  # batch, heads, tokens, head dim of one layer's SDPA
    sizes: list[int]
    repeats: int
    store: str
    # a mixture of experts' grouped GEMMs: (experts, rows an expert, K, N); empty: dense
    grouped: list[tuple[int, int, int, int]] = dataclasses.field(default_factory=list)


def shapes_and_sizes(overrides: list[str]) -> tuple[object, object, list, tuple, list, list]:
    """(config, topology, matmul shapes M x K x N of a micro-batch on one rank, its attention's
    (batch, heads, tokens, head dim), collective sizes in bytes: each distinct FSDP unit's
    all-gather and a few small ones, the experts' grouped GEMMs (experts, rows, K, N): the
    gate and up projections and the down one, top_k of each token's copies spread evenly)."""
    cfg = compose(overrides)
    topo, _ = plan.topology(cfg)
    validate(cfg, topo)
    facts = plan.inspect_model(cfg, topo.device)
    layer, tp = facts.layer, cfg.parallel.tensor
    m = cfg.trainer.micro_batch_size * cfg.trainer.seq_len // cfg.parallel.context
    width = layer.expert_intermediate if layer.experts else layer.intermediate
    shapes = [
        (m, layer.hidden, max(1, layer.q_dim // tp)),
        (m, layer.hidden, max(1, width // tp)),
        (m, max(1, width // tp), layer.hidden),
        (m, layer.hidden, max(1, layer.vocab // tp)),
    ]
    b = plan_bytes(cfg)
    units = memory.group_numels(facts.params, topo.world_size // tp, param_bytes=b)
    sizes = sorted({*SIZES, *(min(MAX_SIZE, n * b) for n in units.values() if n)})
    heads = max(1, layer.num_heads // tp)
    attention = (
        cfg.trainer.micro_batch_size,
        heads,
        cfg.trainer.seq_len // cfg.parallel.context,
        layer.q_dim // layer.num_heads,
    )
    grouped = []
    if layer.experts:
        e, width = layer.experts, layer.expert_intermediate
        rows = max(1, m * layer.top_k // e)
        grouped = [(e, rows, layer.hidden, 2 * width), (e, rows, width, layer.hidden)]
    return cfg, topo, list(dict.fromkeys(shapes)), attention, sizes, grouped


def plan_bytes(cfg) -> int:
    return dtype_row(cfg.precision.param_dtype).bytes


def _rank_main(rank: int, job: Job, results) -> None:
    """One rank: join the group, measure, send rank 0 everyone's numbers; exit hard (a rank
    can abort at interpreter exit after destroy_process_group)."""
    code = 0
    try:
        import datetime

        import torch.distributed as dist

        from fsdp_lab.config import HardwareConfig
        from fsdp_lab.engine.hardware import calibration, devices, process_group

        device = devices.rank_device(job.kind, rank)
        devices.set_threads(HardwareConfig(threads_per_rank=job.threads), job.nproc)
        dist.init_process_group(
            process_group.backend(job.kind),
            init_method=f"file://{job.store}",
            rank=rank,
            world_size=job.nproc,
            timeout=datetime.timedelta(seconds=600),
        )
        dtype = devices.TORCH_DTYPES[_dtype_member(job.dtype)]
        mine = {
            "matmul": calibration.matmul_flops(job.shapes, dtype, device, job.repeats),
            "attention": calibration.attention_flops(job.attention, dtype, device, job.repeats),
            "memory": calibration.memory_bandwidth(device, job.repeats),
            "op": calibration.op_overhead(device, job.repeats),
            "host": calibration.host_copy_bandwidth(
                device, job.kind is HardwareKind.gpu, job.repeats
            ),
            "device": devices.device_summary(job.kind),
        }
        mine["optimizer"] = calibration.optimizer_tensor_times(device, job.repeats)
        if job.grouped:
            mine["grouped"] = calibration.grouped_flops(job.grouped, dtype, device, job.repeats)
        if job.nproc > 1:
            mine["collectives"] = calibration.collective_times(
                job.sizes,
                device,
                job.repeats,
                between=job.shapes[min(1, len(job.shapes) - 1)],  # the MLP's (the only one)
                dtype=dtype,
            )
        everyone = process_group.gather_from_processes(mine)
        if rank == 0:
            results.put(everyone)
        dist.barrier()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then a hard exit
        results.put(f"rank {rank}: {type(e).__name__}: {e}")
        code = 1
    results.close()
    results.join_thread()  # the queue's feeder thread sends before the hard exit
    os._exit(code)


def _dtype_member(name: str):
    from fsdp_lab.config import Dtype

    return Dtype[name]


def measure(job: Job, timeout_s: float = 1800) -> list[dict]:
    """Start the ranks, wait for rank 0's report of every rank's numbers."""
    method = "fork" if job.kind is HardwareKind.cpu else "spawn"
    ctx = multiprocessing.get_context(method)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, job, results)) for r in range(job.nproc)]
    for p in procs:
        p.start()
    deadline, report = time.monotonic() + timeout_s, None
    try:
        while report is None:
            try:
                report = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or all(p.exitcode is not None for p in procs):
                    report = f"rank(s) {dead or 'all'} exited without a report"
                elif time.monotonic() > deadline:
                    report = f"no report within {timeout_s:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if isinstance(report, str):
        raise ConfigError(f"fsdp-lab calibrate: a rank failed: {report}")
    return report


def spread(values: list[float]) -> float:
    """How far repeats disagree, relative to their median: (max - min) / median, the highest
    and lowest dropped first where there are five or more (one outlier is not noise)."""
    v = sorted(values)
    if len(v) >= 5:
        v = v[1:-1]
    mid = statistics.median(v)
    return (v[-1] - v[0]) / mid if mid > 0 else float("inf")


def check_spread(measured: dict[str, list[float]], limit: float) -> None:
    """ConfigError naming the noisiest measurement where any spreads more than ``limit``."""
    worst = max(measured, key=lambda k: spread(measured[k]))
    value = spread(measured[worst])
    if value > limit:
        raise ConfigError(
            f"fsdp-lab calibrate: the machine is too noisy to trust: {worst} varied "
            f"{value:.0%} between repeats (--max-spread {limit:.0%}); nothing written. Run it "
            "on an idle machine, or raise --max-spread to accept it"
        )


def fit_link(times: dict[int, list[float]], op: str, ranks: int) -> Link:
    """Latency per ring step and bus bandwidth, by least squares over the sizes' medians:
    t = steps x latency + moved / bandwidth (``time_model.collective_s``'s form)."""
    steps, share = ranks - 1, (ranks - 1) / ranks
    if op == "all_reduce":
        steps, share = 2 * steps, 2 * share
    xs = [share * size for size in times]
    ys = [statistics.median(t) for t in times.values()]
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0
    slope = max(slope, 1e-15)
    intercept = max(0.0, my - slope * mx)
    if n < 2 or intercept == 0.0:
        intercept = max(0.0, min(ys[0] - xs[0] * slope, ys[0]))
    return Link(bytes_per_s=1 / slope, latency_s=intercept / steps)


def base_profile(name: str | None, kind: HardwareKind, summary: str) -> DeviceProfile:
    """The profile the measurements replace figures of: --base, else the named row this
    machine is (its summary names its GPU), else the cpu row."""
    if name:
        return device_profile(name)
    return device_profile(row_for(summary if kind is HardwareKind.gpu else "cpu"))


def profile_from(
    everyone: list[dict], job: Job, base: DeviceProfile, max_spread: float
) -> DeviceProfile:
    """The measured profile: every rank's matmuls (the slowest rank's: a step waits for it),
    rank 0's bandwidths and collectives; refused where the repeats spread too much."""
    first = everyone[0]
    noisy = {f"matmul {k}": v for k, v in first["matmul"].items()}
    noisy |= {"memory bandwidth": first["memory"], "operator overhead": first["op"]}
    noisy["attention"] = first["attention"]
    noisy["optimizer per tensor"] = first["optimizer"]
    if "grouped" in first:
        noisy["experts' grouped GEMMs"] = first["grouped"]
    for op, by_size in first.get("collectives", {}).items():
        for size, t in by_size.items():
            if size >= MIB:  # small ones are latency: jittery, and a small share of a step
                noisy[f"{op} {size / MIB:.1f} MiB"] = t
    check_spread(noisy, max_spread)
    flops = sum(6 * m * k * n for m, k, n in job.shapes)
    seconds = max(
        sum(
            6 * m * k * n / statistics.median(r["matmul"][f"{m}x{k}x{n}"]) for m, k, n in job.shapes
        )
        for r in everyone
    )
    compute = {**base.compute, job.dtype: flops / seconds}
    collectives = {
        op: fit_link(first["collectives"][op], op, job.nproc)
        for op in COLLECTIVES
        if "collectives" in first
    }
    host_rate = statistics.median(first["host"])
    return dataclasses.replace(
        base,
        name=f"calibrated ({first['device']}, {job.nproc} ranks)",
        compute=compute,
        matmul_fraction=1.0,
        # attention's rate over the matmuls' (the slowest rank's, as for the matmuls)
        attention_fraction=min(statistics.median(r["attention"]) for r in everyone)
        / compute[job.dtype],
        memory_bytes_per_s=statistics.median(first["memory"]),
        op_overhead_s=statistics.median(first["op"]),
        tensor_step_s=max(statistics.median(r["optimizer"]) for r in everyone),
        grouped_fraction=(
            min(statistics.median(r["grouped"]) for r in everyone) / compute[job.dtype]
            if "grouped" in first
            else None
        ),
        host_link=Link(host_rate, base.host_link.latency_s),
        host_memory_bytes_per_s=(
            statistics.median(first["memory"])
            if job.kind is HardwareKind.cpu
            else base.host_memory_bytes_per_s
        ),
        intra_node=collectives.get("all_gather", base.intra_node),
        collectives=collectives,
        matmul_at={k: statistics.median(v) for k, v in first["matmul"].items()},
        ranks_per_node=job.nproc,
        measured=_record(first, job, base, noisy),
        aliases=(),
    )


def _record(first: dict, job: Job, base: DeviceProfile, noisy: dict) -> dict:
    """The profile's ``measured``: when, where, how, and each measurement's spread."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "device": first["device"],
        "ranks": job.nproc,
        "dtype": job.dtype,
        "repeats": job.repeats,
        "base": base.name,
        "spread": {k: round(spread(v), 4) for k, v in noisy.items()},
    }


def calibrate_command(
    overrides: list[str], out: Path, *, repeats: int, max_spread: float, base: str | None
) -> int:
    if repeats < 3 or max_spread <= 0:
        raise ConfigError("--repeats must be >= 3 and --max-spread > 0 (e.g. 0.25)")
    if out.exists():
        raise ConfigError(f"--out {out} exists: give a new path (a profile is never overwritten)")
    cfg, topo, shapes, attention, sizes, grouped = shapes_and_sizes(overrides)
    if topo.device is HardwareKind.cpu:
        base_row = base_profile(base, topo.device, "cpu")  # a bad --base fails before measuring
    else:
        base_row = None
    with tempfile.TemporaryDirectory() as tmp:
        job = Job(
            kind=topo.device,
            nproc=topo.nproc_per_node,
            threads=cfg.hardware.threads_per_rank,
            dtype=cfg.precision.param_dtype.name,
            shapes=shapes,
            attention=attention,
            sizes=sizes,
            repeats=repeats,
            store=str(Path(tmp) / "store"),
            grouped=grouped,
        )
        start = time.perf_counter()
        everyone = measure(job)
    base_row = base_row or base_profile(base, topo.device, everyone[0]["device"])
    profile = profile_from(everyone, job, base_row, max_spread)
    write_profile(profile, out)
    print(describe(profile, time.perf_counter() - start))
    print(f"wrote {out}: fsdp-lab plan ... --device {out}")
    return 0


def describe(p: DeviceProfile, seconds: float) -> str:
    """The measured figures, one line each."""
    m = p.measured or {}
    lines = [
        f"{p.name}, measured in {seconds:.0f} s ({m.get('repeats')} repeats; the worst spread "
        f"{max((m.get('spread') or {0: 0}).values()):.0%})",
        f"  matmul {m.get('dtype')}: {p.compute[m.get('dtype', 'fp32')] / 1e9:.1f} GFLOP/s at "
        "the model's shapes; " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in p.matmul_at.items()),
        f"  memory {p.memory_bytes_per_s / 1e9:.2f} GB/s; one operator {p.op_overhead_s * 1e6:.1f} "
        f"us; optimizer {p.tensor_step_s * 1e6:.0f} us a parameter tensor; host<->device "
        f"{p.host_link.bytes_per_s / 1e9:.2f} GB/s",
    ]
    if p.grouped_fraction is not None and m.get("dtype") in p.compute:
        rate = p.grouped_flops(m["dtype"]) / 1e9
        lines.append(f"  experts' grouped GEMMs: {rate:.1f} GFLOP/s")
    for op, link in p.collectives.items():
        lines.append(
            f"  {op}: {link.bytes_per_s / 1e9:.2f} GB/s bus bandwidth, "
            f"{link.latency_s * 1e6:.0f} us a ring step"
        )
    return "\n".join(lines)
