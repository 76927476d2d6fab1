"""`fsdp-lab calibrate [OVERRIDES]`: measure the machine at hand into a hardware profile, which
`fsdp-lab plan`, `tune` and the runs' own predictions read.

    fsdp-lab calibrate hardware=cpu hardware.nproc_per_node=2          # this machine's cache
    fsdp-lab calibrate hardware=gpu precision=bf16 --out h100.json     # a file to share
    fsdp-lab calibrate --from-runs outputs/2026-11-29/*                # refined by your runs

The overrides say which ranks and dtype (``hardware.*``, ``precision``); what is measured is
calibrate's own grid of sizes (``GRIDS``), never a model's, so that one profile prices any
model. The node's ``hardware.nproc_per_node`` ranks start at once (as a run's would, sharing
its cores, memory and links) and each measures (``engine.hardware.calibration``): matrix
multiplies forward and backward and causal attention at a grid of sizes (a rate and a
per-call latency fitted over them), an elementwise operator's bandwidth by its size, the
host's cost of an operator (a tiny decoder layer's, its operators counted by ``plan_trace``)
and of a view, an optimizer step per parameter tensor, FSDP2's hooks per unit, a TP linear's
dispatch, all-gather / reduce-scatter / all-reduce at several sizes (latency and bus bandwidth
fitted), and host<->device copies. Each figure is a median taken until its 95% interval is
tight or its share of ``--seconds`` is spent; the interval is recorded beside it.

Without ``--out`` the profile goes to this machine's cache (``planning.machine``), which a run
on this machine, plan and tune then read. What one node cannot measure (the network between
nodes) is ``--base``'s (default: the named GPU this machine is, or cpu).
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import queue
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_lab.config import ConfigError, Dtype, HardwareConfig, HardwareKind
from fsdp_lab.config.hardware_kinds import HardwareRow, hardware_row
from fsdp_lab.config.hardware_profiles import (
    DeviceProfile,
    write_profile,
)
from fsdp_lab.config.load import compose
from fsdp_lab.config.rules import validate
from fsdp_lab.config.topology import Topology
from fsdp_lab.engine.hardware import calibration as cal
from fsdp_lab.engine.hardware import devices, process_group
from fsdp_lab.engine.hardware.calibration import Timing
from fsdp_lab.engine.hardware.timing import Budget
from fsdp_lab.planning import calibrate_fit, calibrate_loop, machine, plan

KIB, MIB = 2**10, 2**20


@dataclass(frozen=True)
class Grid:
    """The sizes calibrate measures: matmuls (M, K, N), causal attention (batch, heads,
    tokens, head dim), one-layer decoders (hidden, tokens: the first so small that its
    kernels are negligible), collectives (bytes), grouped GEMMs (experts, rows an expert, K,
    N)."""

    matmuls: tuple[tuple[int, int, int], ...]
    attention: tuple[tuple[int, int, int, int], ...]
    decoders: tuple[tuple[int, int], ...]
    collectives: tuple[int, ...]
    grouped: tuple[tuple[int, int, int, int], ...]


GRIDS = {  # by whether the device is the host's CPU (HardwareRow.host)
    True: Grid(
        matmuls=(
            (64, 64, 64),
            (256, 64, 256),
            (512, 256, 512),
            (1024, 256, 1024),
            (2048, 512, 256),
            (512, 1024, 2048),
        ),
        attention=(
            (1, 4, 256, 32),
            (1, 4, 1024, 32),
            (1, 4, 256, 64),
            (1, 4, 1024, 64),
            (1, 4, 256, 128),
            (1, 4, 1024, 128),
        ),
        decoders=((16, 8), (64, 512), (256, 512), (512, 512)),
        collectives=(4 * KIB, 256 * KIB, 4 * MIB, 16 * MIB),
        grouped=((8, 64, 64, 128), (16, 128, 256, 256)),
    ),
    False: Grid(
        matmuls=(
            (1024, 1024, 1024),
            (4096, 2048, 2048),
            (8192, 4096, 4096),
            (16384, 4096, 14336),
            (8192, 14336, 4096),
        ),
        attention=(
            (1, 16, 2048, 64),
            (1, 16, 8192, 64),
            (1, 16, 2048, 128),
            (1, 16, 8192, 128),
        ),
        decoders=((16, 8), (1024, 2048), (2048, 2048), (4096, 2048)),
        collectives=(64 * KIB, 4 * MIB, 64 * MIB, 256 * MIB),
        grouped=((64, 2048, 1024, 1024), (128, 2048, 2048, 1536)),
    ),
}
# A run's first prediction on a new machine: fewer sizes (each head size at one length, the
# decoder at three), each figure from fewer, shorter samples.
QUICK_GRIDS = {
    True: Grid(
        matmuls=((64, 64, 64), (512, 256, 512), (1024, 256, 1024), (512, 512, 1024)),
        attention=((1, 4, 256, 64), (1, 4, 1024, 64), (1, 4, 512, 32), (1, 4, 512, 128)),
        decoders=((16, 8), (128, 256), (384, 256)),
        collectives=(4 * KIB, 256 * KIB, 4 * MIB),
        grouped=((8, 64, 64, 128),),
    ),
    False: Grid(
        matmuls=((1024, 1024, 1024), (8192, 4096, 4096), (8192, 14336, 4096)),
        attention=((1, 16, 2048, 128), (1, 16, 8192, 128), (1, 16, 4096, 64)),
        decoders=((16, 8), (2048, 2048), (4096, 2048)),
        collectives=(64 * KIB, 16 * MIB, 256 * MIB),
        grouped=((64, 2048, 1024, 1024),),
    ),
}
QUICK_SECONDS = 5.0


@dataclass(frozen=True)
class Job:
    """What every rank measures (picklable: sent to the ranks)."""

    kind: HardwareKind
    nproc: int
    threads: int | None
    dtype: str
    grid: Grid
    seconds: float  # the whole measurement's budget
    store: str
    quick: bool = False  # fewer, shorter samples (QUICK_GRIDS)

    @property
    def row(self) -> HardwareRow:
        return hardware_row(self.kind)

    def timeout_s(self) -> float:
        """How long the ranks may take in all: the budget, plus starting them and building
        the loop's model, with room for a loaded machine (measurements overrun)."""
        return 120 + 8 * self.seconds

    def budget(self, share: float):
        """A measurement's budget: ``share`` of the whole, split over its sizes."""

        if self.quick:
            return Budget(seconds=max(0.02, self.seconds * share), min_samples=5, sample_s=0.005)
        return Budget(seconds=max(0.02, self.seconds * share))


# The budget's shares by measurement (per size where there are several); they add up to 1.
SHARES = {"matmul": 0.18, "attention": 0.08, "decoders": 0.12, "views": 0.02,
          "optimizer": 0.08, "fsdp": 0.08, "tp": 0.04, "collectives": 0.18, "straggle": 0.06,
          "loop": 0.12, "grouped": 0.02, "host": 0.02}  # fmt: skip


def _rank_main(rank: int, job: Job, results) -> None:
    """One rank: join the group, measure, send rank 0 everyone's numbers; exit hard (a rank
    can abort at interpreter exit after destroy_process_group)."""
    code = 0
    try:
        everyone = _measure_rank(rank, job)
        if rank == 0:
            results.put(("ok", everyone))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then a hard exit
        results.put(("error", f"rank {rank}: {type(e).__name__}: {e}"))
        code = 1
    results.close()
    results.join_thread()  # the queue's feeder thread sends before the hard exit
    os._exit(code)


def _measure_rank(rank: int, job: Job) -> list[dict] | None:

    device = devices.rank_device(job.kind, rank)
    devices.set_threads(HardwareConfig(threads_per_rank=job.threads), job.nproc)
    dist.init_process_group(
        process_group.backend(job.kind),
        init_method=f"file://{job.store}",
        rank=rank,
        world_size=job.nproc,
        timeout=datetime.timedelta(seconds=job.timeout_s()),
    )
    dtype = devices.TORCH_DTYPES[Dtype[job.dtype]]
    g = job.grid
    each = lambda name, n: job.budget(SHARES[name] / max(1, n))
    mine: dict = {"device": devices.device_summary(job.kind)}
    mine["matmul"] = cal.matmuls(list(g.matmuls), dtype, device, each("matmul", 2 * len(g.matmuls)))
    mine["attention"] = cal.attention(
        list(g.attention), dtype, device, each("attention", 2 * len(g.attention))
    )
    mine["views"] = cal.views(device, each("views", 1))
    mine["decoders"] = cal.decoders(
        list(g.decoders), dtype, device, each("decoders", len(g.decoders))
    )
    mine["host"] = cal.host_copies(device, not job.row.host, each("host", 1))
    if g.grouped and _has_grouped_mm():
        mine["grouped"] = cal.grouped(
            list(g.grouped), dtype, device, each("grouped", len(g.grouped))
        )
    mine["optimizer"] = cal.optimizer(device, each("optimizer", 2))
    mine["fsdp"] = cal.fsdp_units(device, each("fsdp", 2))
    mine["tp"] = cal.tp_linears(device, each("tp", 2))
    if job.nproc > 1:
        mine["collectives"] = cal.collectives(
            list(g.collectives), device, each("collectives", 3 * len(g.collectives))
        )
        mine["straggle"] = cal.straggle(device, each("straggle", 1), g.matmuls[len(g.matmuls) // 2])
    loop = compose(calibrate_loop.overrides(job.kind, job.nproc, job.dtype))
    topo = Topology.nodes(job.nproc, 1, job.kind)
    mine["loop"] = calibrate_loop.step(loop, topo, device, each("loop", 1))
    everyone = process_group.gather_from_processes(_plain(mine))
    dist.barrier()
    return everyone if rank == 0 else None


def _has_grouped_mm() -> bool:

    return hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")


def _plain(value):
    """Timings as lists and shape tuples as strings: what pickles and reads back as JSON."""

    if isinstance(value, Timing):
        return value.to_json()
    if isinstance(value, dict):
        return {("x".join(map(str, k)) if isinstance(k, tuple) else k): _plain(v)
                for k, v in value.items()}  # fmt: skip
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def measure(job: Job) -> list[dict]:
    """Start the ranks, wait for rank 0's report of every rank's numbers; on a rank's death
    or the timeout stop them all (the living would wait in a collective for the dead)."""
    import transformers.models.llama.modeling_llama  # noqa: F401 - forked ranks inherit it

    method = job.row.start_method.value
    ctx = multiprocessing.get_context(method)
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, job, results)) for r in range(job.nproc)]
    for p in procs:
        p.start()
    deadline, report = time.monotonic() + job.timeout_s(), None
    try:
        while report is None:
            try:
                status, value = results.get(timeout=1.0)
                report = value if status == "ok" else str(value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or all(p.exitcode is not None for p in procs):
                    report = f"rank(s) {dead or 'all'} exited without a report"
                elif time.monotonic() > deadline:
                    report = f"no report within {job.timeout_s():.0f} s"
    finally:
        if isinstance(report, str) or report is None:
            for p in procs:
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    if isinstance(report, str):
        raise ConfigError(f"fsdp-lab calibrate: a rank failed: {report}")
    return report


def run_calibration(
    kind: HardwareKind,
    nproc: int,
    *,
    threads: int | None,
    dtype: str,
    seconds: float,
    base: str | None = None,
    quick: bool = False,
) -> DeviceProfile:
    """Measure this machine's ``nproc`` ranks for ``seconds`` into a profile (``quick``: the
    few sizes of a run's first prediction)."""
    if base:
        calibrate_fit.base_profile(base, kind, "")  # a bad --base fails before measuring
    with tempfile.TemporaryDirectory() as tmp:
        grid = (QUICK_GRIDS if quick else GRIDS)[hardware_row(kind).host]
        job = Job(kind=kind, nproc=nproc, threads=threads, dtype=dtype, grid=grid,
                  seconds=seconds, store=str(Path(tmp) / "store"), quick=quick)  # fmt: skip
        everyone = measure(job)
    return calibrate_fit.profile_from(
        everyone, job, calibrate_fit.base_profile(base, kind, everyone[0]["device"])
    )


def quick(cfg, topo, seconds: float = QUICK_SECONDS) -> DeviceProfile:
    """A run's first measurement of this machine: its ranks and dtype, ``seconds`` long."""
    return run_calibration(
        topo.device,
        topo.nproc_per_node,
        threads=cfg.hardware.threads_per_rank,
        dtype=cfg.precision.param_dtype.name,
        seconds=seconds,
        quick=True,
    )


def calibrate_command(
    overrides: list[str], out: Path | None, *, seconds: float, base: str | None
) -> int:

    if seconds < 1:
        raise ConfigError(f"--seconds {seconds:g}: give calibrate at least 1 s (default 30)")
    if out is not None and out.exists():
        raise ConfigError(f"--out {out} exists: give a new path (a profile is never overwritten)")
    cfg = compose(overrides)
    devices.resolve_kind(cfg.hardware)  # hardware=gpu without CUDA: the one-line error
    topo, _ = plan.topology(cfg)
    validate(cfg, topo)
    cache = machine.cache_path(cfg, machine.key_of(cfg, topo))
    path = out or cache
    with machine.measuring(cache, wait=True):  # never beside another measurement
        start = time.perf_counter()
        profile = run_calibration(
            topo.device,
            topo.nproc_per_node,
            threads=cfg.hardware.threads_per_rank,
            dtype=cfg.precision.param_dtype.name,
            seconds=seconds,
            base=base,
        )
        write_profile(profile, path)
        if out is None:
            machine.failed_path(cache).unlink(missing_ok=True)
    print(describe(profile, time.perf_counter() - start))
    where = f"--device {path}" if out else "(this machine's profile: runs, plan and tune read it)"
    print(f"wrote {path} {where}")
    return 0


def describe(p: DeviceProfile, seconds: float) -> str:
    """The measured figures, one line each, with their 95% intervals' widest."""
    m = p.measured or {}
    d = m.get("dtype", "fp32")
    intervals = m.get("interval") or {"": 0.0}
    worst = max(intervals, key=intervals.get)
    lines = [
        f"{p.name}, measured in {seconds:.0f} s; the widest 95% interval +-"
        f"{intervals[worst]:.0%} ({worst})",
    ]
    fwd, bwd = p.matmul.get(f"{d} forward"), p.matmul.get(f"{d} backward")
    if fwd and bwd:
        lines.append(
            f"  matmul {d}: forward {fwd.per_s / 1e9:.1f} GFLOP/s + {fwd.latency_s * 1e6:.1f}"
            f" us a call, backward {bwd.per_s / 1e9:.1f} GFLOP/s + {bwd.latency_s * 1e6:.1f} us"
        )
    for phase in ("forward", "backward"):
        points = p.attention.get(f"{d} {phase}", [])
        lines.append(f"  attention {phase} GFLOP/s (head size x keys): " + ", ".join(
            f"{dim:.0f}x{t:.0f} {rate / 1e9:.1f}" for dim, t, rate in points))  # fmt: skip
    memory = ", ".join(f"{2**b / MIB:.2g} MiB {v / 1e9:.1f}" for b, v in p.memory_by_size.items())
    lines.append(f"  other operators' GB/s by their size: {memory}")
    lines.append(
        f"  host: an operator {p.op_overhead_s * 1e6:.1f} us, a view "
        f"{p.view_overhead_s * 1e6:.2f} us, an optimizer step {p.optimizer_step_s * 1e6:.0f} us + "
        f"{p.tensor_step_s * 1e6:.0f} us a tensor,"
        f" an FSDP unit's pass {p.unit_overhead_s * 1e6:.0f} us, a TP linear's pass "
        f"{p.tp_linear_s * 1e6:.0f} us; host<->device {p.host_link.bytes_per_s / 1e9:.2f} GB/s"
    )
    lines.append(f"  ranks wait for the slowest for {p.straggle:.1%} of their compute; a step's "
                 f"host cost besides: {p.step_host_s * 1e3:.2f} ms")  # fmt: skip
    if p.grouped_fraction is not None:
        rate = p.grouped_flops(d)
        lines.append(f"  experts' grouped GEMMs: {rate / 1e9:.1f} GFLOP/s")
    for op, link in p.collectives.items():
        lines.append(
            f"  {op}: {link.bytes_per_s / 1e9:.2f} GB/s bus bandwidth, "
            f"{link.latency_s * 1e6:.0f} us a ring step"
        )
    return "\n".join(lines)
