"""From a calibration's timings (every rank's, ``calibrate.measure``) to a hardware profile:
the rates fitted over the sizes measured (a matmul's latency and FLOP rate per pass, least
squares on relative errors; attention's FLOP rate by head size and length; a collective's
latency and bus bandwidth), the host's costs (an operator, a view, an optimizer tensor and
step, an FSDP unit's hooks, a TP linear's dispatch), the ranks' waits for each other, and
where each figure came from.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import tempfile
import time
from pathlib import Path

from fsdp_lab.config import Dtype, HardwareKind
from fsdp_lab.config.device_rows import device_profile, row_for
from fsdp_lab.config.hardware_kinds import hardware_row
from fsdp_lab.config.hardware_profiles import COLLECTIVES, DeviceProfile, Link, Rate, write_profile
from fsdp_lab.config.precisions import peak_key
from fsdp_lab.planning import op_count
from fsdp_lab.planning.time_model import Collective, collective_s

MIB = 2**20


def _median(v: list) -> float:
    return v[0]


def _spread(v: list) -> float:
    return (v[2] - v[1]) / 2 / v[0] if v[0] > 0 else float("inf")


def _slowest(everyone: list[dict], *path) -> list:
    """One measurement's timing on the rank where it was slowest (a step waits for it)."""

    def at(r):
        for p in path:
            r = r[p]
        return r

    return max((at(r) for r in everyone), key=_median)


def fit_rate(points: list[tuple[float, float]]) -> Rate:
    """``Rate`` t = latency + work / rate by least squares on relative errors (each point's
    equation divided by its time, so that small and large sizes count alike); a negative
    latency is refitted as none."""
    rows = [(1 / t, w / t) for w, t in points]  # x = (latency, 1/rate): a*x0 + b*x1 = 1
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    if det > 0:
        latency = (sa * sbb - sb * sab) / det
        inverse = (saa * sb - sab * sa) / det
        if latency >= 0 and inverse > 0:
            return Rate(per_s=1 / inverse, latency_s=latency)
    inverse = sb / sbb  # no latency: the rate alone
    return Rate(per_s=1 / inverse, latency_s=0.0)


def fit_link(times: dict[int, float], op: str, ranks: int) -> Link:
    """Latency per ring step and bus bandwidth: t = steps x latency + moved / bandwidth
    (``time_model.collective_s``'s form), fitted as ``fit_rate``."""
    steps, share = ranks - 1, (ranks - 1) / ranks
    if op == "all_reduce":
        steps, share = 2 * steps, 2 * share
    rate = fit_rate([(share * size, t) for size, t in times.items()])
    return Link(bytes_per_s=rate.per_s, latency_s=rate.latency_s / steps)


def _shape(key: str) -> tuple[int, ...]:
    return tuple(int(x) for x in key.split("x"))


def _fits(everyone: list[dict], job) -> dict:
    """The rates calibrate fits: matmuls per pass (latency + FLOPs at a rate), attention's
    FLOP/s per pass at each head size and length measured."""
    mm_f, mm_b = [], []
    for key in everyone[0]["matmul"]:
        m, k, n = _shape(key)
        fwd, both = (_slowest(everyone, "matmul", key, i) for i in (0, 1))
        mm_f.append((2 * m * k * n, _median(fwd)))
        mm_b.append((4 * m * k * n, max(_median(both) - _median(fwd), 1e-9)))
    d, at_f, at_b = job.dtype, [], []
    for key in everyone[0]["attention"]:
        b, h, t, dim = _shape(key)
        flops = 4 * b * h * t * (t / 2) * dim  # causal: half the scores
        fwd, both = (_median(_slowest(everyone, "attention", key, i)) for i in (0, 1))
        at_f.append([dim, t, flops / fwd])
        at_b.append([dim, t, 2.5 * flops / max(both - fwd, 1e-9)])
    backward = fit_rate(mm_b)  # a latency per linear's backward: two calls (the gradients)
    backward = dataclasses.replace(backward, latency_s=backward.latency_s / 2)
    return {
        "matmul": {f"{d} forward": fit_rate(mm_f), f"{d} backward": backward},
        "attention": {f"{d} forward": at_f, f"{d} backward": at_b},
    }


def _host_and_memory(
    everyone: list[dict], job, rates: dict, view_s: float
) -> tuple[float, dict[int, float]]:
    """The host's cost of one operator, and the other operators' bytes/s by size class, from
    the decoders: each one's forward and backward less its matmuls' and attention's fitted
    times and its views'; the smallest's rest is its operators' issue (its kernels are
    negligible), the others' rest past their issue is their bytes (counted by tracing the
    same model on meta) at that size class's bandwidth."""
    from fsdp_lab.engine.hardware import calibration as cal
    from fsdp_lab.engine.hardware import devices

    dtype, d = devices.TORCH_DTYPES[Dtype[job.dtype]], job.dtype
    attention_of = dataclasses.replace(_LINKS, attention=rates["attention"])
    rests = []
    for key in everyone[0]["decoders"]:
        hidden, tokens = _shape(key)
        heads = max(1, hidden // 32)
        model, ids = cal.decoder(hidden, tokens, dtype, "meta")
        passes = op_count.count_ops(lambda m=model, i=ids: m(input_ids=i).last_hidden_state.sum())
        known = view_s * sum(p.views for p in passes)
        for phase, p in zip(("forward", "backward"), passes, strict=True):
            known += rates["matmul"][f"{d} {phase}"].seconds(
                p.matmul_flops(), sum(p.matmuls.values())
            )
            flops = _decoder_attention(hidden, tokens) * (1 if phase == "forward" else 2.5)
            if p.attention:
                known += attention_of.attention_s(flops, d, phase, hidden // heads, tokens)
        ops = sum(sum(p.ops.values()) for p in passes)
        nbytes = sum(sum(p.op_bytes.values()) for p in passes)
        rests.append((ops, nbytes, _median(_slowest(everyone, "decoders", key)) - known))
    ops, _, rest = rests[0]
    op_s = max(rest, 0.0) / max(ops, 1)
    # A GPU issues operators while earlier ones run (time_model takes the larger of the
    # two): its larger decoders' rest is their bytes alone. A CPU runs them one by one.
    gpu = not job.row.host
    memory = {}
    for ops, nbytes, rest in rests[1:]:
        moving = rest if gpu else rest - ops * op_s
        if moving > 0:  # else within the noise of the fitted rates: no figure from it
            memory[op_count.size_bucket(nbytes / max(ops, 1))] = nbytes / moving
    return op_s, memory


def _decoder_attention(hidden: int, tokens: int) -> float:
    """``calibration.decoder``'s causal attention's forward FLOPs (half the scores)."""
    return 4 * tokens * (tokens / 2) * hidden


def profile_from(everyone: list[dict], job, base: DeviceProfile) -> DeviceProfile:
    """The measured profile of ``job`` (a ``calibrate.Job``): compute from the rank where each
    measurement was slowest (a step waits for it), bandwidths and collectives from rank 0."""
    first = everyone[0]
    rates = _fits(everyone, job)
    view_s = _median(_slowest(everyone, "views"))
    op_s, memory = _host_and_memory(everyone, job, rates, view_s)
    collectives = {
        op: fit_link(
            {int(k): _median(v) for k, v in first["collectives"][op].items()}, op, job.nproc
        )
        for op in COLLECTIVES
        if "collectives" in first
    }
    compute = _peaks(base, job.dtype, rates["matmul"][f"{job.dtype} forward"].per_s)
    peak = dataclasses.replace(base, compute=compute).flops(job.dtype, 1.0)
    optimizer = {int(k): _median(v) for k, v in first["optimizer"].items()}
    few, many = min(optimizer), max(optimizer)
    tensor_s = max(0.0, (optimizer[many] - optimizer[few]) / (many - few))
    step_s = max(0.0, optimizer[few] - few * tensor_s)  # the norm's all-reduce and the setup
    unit_s = _unit_overhead(first, collectives, job)
    host = 2 * 64 * MIB / _median(first["host"])
    who = f"micro-benchmark: fsdp-lab calibrate on {platform.node()}, {first['device']}, " \
          f"{job.nproc} ranks, {time.strftime('%Y-%m-%d')}"  # fmt: skip
    profile = dataclasses.replace(
        base,
        name=f"measured ({first['device']}, {job.nproc} ranks)",
        compute=compute,
        matmul=rates["matmul"],
        attention=rates["attention"],
        memory_bytes_per_s=memory[max(memory)] if memory else base.memory_bytes_per_s,
        memory_by_size=memory,
        op_overhead_s=op_s,
        view_overhead_s=view_s,
        tensor_step_s=tensor_s,
        optimizer_step_s=step_s,
        unit_overhead_s=unit_s,
        tp_linear_s=_tp_overhead(first),
        straggle=_straggle(first, job),
        grouped_fraction=_grouped_fraction(everyone, peak) if "grouped" in first else None,
        host_link=Link(host, base.host_link.latency_s),
        host_memory_bytes_per_s=(
            memory[max(memory)] if memory and job.row.host else base.host_memory_bytes_per_s
        ),
        intra_node=collectives.get("all_gather", base.intra_node),
        collectives=collectives,
        ranks_per_node=job.nproc,
        learned={},
        sources=_sources(base, who, measured_memory=bool(memory)),
        measured=_record(everyone, job, base),
        aliases=(),
    )
    return dataclasses.replace(profile, step_host_s=_step_host(everyone, job, profile))


def _peaks(base: DeviceProfile, dtype: str, forward: float) -> dict[str, float]:
    """The peaks stay the base row's (MFU is over them; their fractions price what was not
    measured); a dtype the row has no peak of takes the measured forward rate as its own."""
    compute = dict(base.compute)
    if dtype not in compute and peak_key(dtype) not in compute:
        compute[dtype] = forward
    return compute


def _sources(base: DeviceProfile, who: str, *, measured_memory: bool) -> dict[str, str]:
    """Where each figure came from: what calibrate measured, else the base row's source."""
    sources = {**base.sources, **{k: who for k in MEASURED_FIELDS}}
    if not measured_memory:
        for field in ("memory_bytes_per_s", "memory_by_size"):
            sources[field] = "not measured: the base row's (the decoders' time was within " \
                             "their fitted matmuls')"  # fmt: skip
    return sources


MEASURED_FIELDS = (
    "matmul",
    "attention",
    "memory_bytes_per_s",
    "memory_by_size",
    "op_overhead_s",
    "view_overhead_s",
    "tensor_step_s",
    "optimizer_step_s",
    "unit_overhead_s",
    "tp_linear_s",
    "straggle",
    "grouped_fraction",
    "host_link",
    "intra_node",
    "collectives",
    "ranks_per_node",
)


def _unit_overhead(first: dict, collectives: dict[str, Link], job) -> float:
    """FSDP2's host cost per unit and pass: the tiny sharded model's step less the plain
    one's and less its collectives' fitted times, over its units' passes (4 layers and the
    root, forward and backward)."""

    plain, sharded = (_median(v) for v in first["fsdp"])
    if job.nproc > 1 and collectives:
        links = dataclasses.replace(_LINKS, collectives=collectives)
        layer = 16 * 16 * 4
        gather = collective_s(Collective("all_gather", layer, job.nproc), links)
        scatter = collective_s(Collective("reduce_scatter", layer, job.nproc), links)
        comm = 4 * (2 * gather + scatter)
    else:
        comm = 0.0
    return max(sharded - plain - comm, 0.0) / (5 * 2)


def _tp_overhead(first: dict) -> float:
    """A TP linear's DTensor dispatch per pass: the TP MLP's step less the plain one's, over
    its two linears' three dispatches (forward; backward's input and weight gradients)."""
    if "tp" not in first:
        return 0.0
    plain, tp = (_median(v) for v in first["tp"])
    return max(tp - plain, 0.0) / 6


def _step_host(everyone: list[dict], job, profile: DeviceProfile) -> float:
    """A step's host cost beyond its predicted work: the tiny model's measured training step
    (``calibrate_loop``, the slowest rank's) less its prediction on the rest of the profile."""

    from fsdp_lab.planning import calibrate_loop, plan

    measured = _median(_slowest(everyone, "loop"))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        write_profile(profile, path)
        args = calibrate_loop.overrides(job.kind, job.nproc, job.dtype)
        predicted = plan.build_plan(args, str(path)).chosen_plan.time.step_s
    return max(0.0, measured - predicted)


def _straggle(first: dict, job) -> float:
    """The share of a unit's compute a rank waits for the slowest one at the collective after
    it: the wait after the same compute on every rank less a collective's own time, over the
    compute. 0 on one rank, and with more ranks than cores: a waiting rank yields its core to
    another (and the compute rates were measured with every rank computing at once)."""
    if "straggle" not in first or job.nproc > (os.cpu_count() or 1):
        return 0.0
    compute, wait, alone = (_median(v) for v in first["straggle"])
    return max(0.0, wait - alone) / compute


def _grouped_fraction(everyone: list[dict], peak: float) -> float:
    """The grouped GEMMs' FLOP rate (forward and backward, 6 x rows x K x N) over the peak."""
    flops = seconds = 0.0
    for key in everyone[0]["grouped"]:
        e, r, k, n = _shape(key)
        flops += 6 * e * r * k * n
        seconds += _median(_slowest(everyone, "grouped", key))
    return flops / seconds / peak


def _record(everyone: list[dict], job, base: DeviceProfile) -> dict:
    """The profile's ``measured``: when, where, how, and each measurement's 95% interval."""
    import torch

    first = everyone[0]
    spreads = {}
    for name, value in first.items():
        if name == "device":
            continue
        for key, v in _flat(name, value):
            spreads[key] = round(_spread(v), 4)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "host": platform.node(),
        "device": first["device"],
        "torch": torch.__version__,
        "ranks": job.nproc,
        "threads": job.threads,
        "dtype": job.dtype,
        "seconds": job.seconds,
        "base": base.name,
        "interval": spreads,  # each timing's 95% interval, +- this share of its median
    }


def _flat(name: str, value) -> list[tuple[str, list]]:
    """(label, timing) of every timing under one measurement."""
    if isinstance(value, list) and value and not isinstance(value[0], list):
        return [(name, value)]
    if isinstance(value, list):
        return [(f"{name} {'forward' if i == 0 else 'both'}", v) for i, v in enumerate(value)]
    out = []
    for k, v in value.items():
        out += _flat(f"{name} {k}", v)
    return out


_LINKS = DeviceProfile(
    name="links",
    kind="cpu",
    compute={},
    matmul_fraction=1.0,
    memory_bytes_per_s=1.0,
    intra_node=Link(1.0, 0.0),
    inter_node=Link(1.0, 0.0),
    host_link=Link(1.0, 0.0),
    host_memory_bytes_per_s=1.0,
    op_overhead_s=0.0,
    overlap=False,
)


def base_profile(name: str | None, kind: HardwareKind, summary: str) -> DeviceProfile:
    """The profile the measurements replace figures of: --base, else the named row this
    machine is (its summary names its GPU), else the cpu row. An unknown GPU takes the h100
    row's network, and says so in its sources."""
    if name:
        return device_profile(name, "--base")
    fallback = hardware_row(kind).plan_device
    named = None if hardware_row(kind).host else row_for(summary)
    if named is not None or hardware_row(kind).host:
        return device_profile(named or fallback)
    base = device_profile(fallback)
    note = f"not measured: {summary} has no row; the {fallback} row's (name one with --base)"
    return dataclasses.replace(base, sources={**base.sources, "inter_node": note})
