"""A torch.profiler Chrome trace as a device-neutral timeline: the steps, compute, each
collective with its kind and FSDP unit, and the host's data and optimizer regions.

Two readers, chosen by what the trace holds:

- **gpu** (the trace has GPU kernels): compute is every kernel, copy and memset that is not
  NCCL's; communication is NCCL's kernels (``ncclDevKernel_AllGather_...``), on whatever stream.
  A kernel belongs to the step and the FSDP unit whose annotation was open on the CPU thread
  when it was launched (its ``correlation`` id leads to that launch). A step's device span runs
  from its first kernel to the next step's first kernel: the host runs ahead of the device.
  Work launched before the profiler recorded (the previous step's tail, still running when the
  window opens: no launch in the trace) belongs to no step; on the H100's 1.1B trace it made
  the first profiled step 315 ms instead of 247. Each kernel also gets a kind
  (``kernel_kind``: matmul, attention, fused, optimizer...), so the analysis can say what the
  compute was.
- **cpu** (gloo): a collective runs on one of gloo's threads (``gloo:all_gather``); compute is
  the main thread's operators, except those that wait: ``c10d::*`` (issuing a collective) and any
  operator that encloses an FSDP annotation or a ``c10d::*`` call (an autograd node whose hook
  waits for a reduce-scatter). A gloo collective is matched to the ``c10d::*`` call that issued
  it in order of issue, and so to the FSDP annotation around that call. FSDP2 on CPU waits for
  each collective as it issues it (there are no streams to overlap on), so almost all of it is
  exposed: the CPU numbers measure the waits, the GPU numbers the overlap.

Steps are the loop's ``fsdp_lab::step N`` annotations (N: the optimizer step, 1-based), or
``ProfilerStep#N`` in a trace from elsewhere.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_lab.config import ConfigError
from fsdp_lab.config.profiling import CONTEXT_ALL_GATHER_REGION, CONTEXT_REDUCE_SCATTER_REGION
from fsdp_lab.observe.profile.intervals import Interval, union
from fsdp_lab.observe.profile.result import OTHER_UNIT, ROOT_UNIT

STEP_PREFIX = "fsdp_lab::step "  # the loop's annotation of each optimizer step
DATA_REGION = "fsdp_lab::data"  # the loop's annotation around preparing the next batch
_STEP = re.compile(r"^(?:fsdp_lab::step |ProfilerStep#)(\d+)$")
# FSDP2's record_function names: "FSDP::all_gather (model.layers.3)", "FSDP::post_backward_reduce"
# (the root: no name, or "()"), "FSDP::backward_prefetch for model.layers.2".
_FSDP = re.compile(r"^FSDP::(\w+)(?: \((.*)\)| for (.*))?$")
_OPTIMIZER = ("Optimizer.step#", "Optimizer.zero_grad#")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_LOOK_BACK = 16


@dataclass
class Collective:
    start: float  # microseconds
    end: float
    kind: str  # all_gather | reduce_scatter | all_reduce | other
    unit: str  # the FSDP unit's module name, ROOT_UNIT, or OTHER_UNIT


@dataclass
class Timeline:
    """What the analysis measures, on the device's clock (microseconds)."""

    device: str  # cpu | gpu
    rank: int | None  # from the trace's distributedInfo, where torch recorded it
    steps: list[tuple[int, float, float]]  # (step, start, end), in order
    compute: list[Interval]  # sorted, disjoint
    comm: list[Collective]
    regions: dict[str, list[Interval]] = field(default_factory=dict)  # data, optimizer
    kernels: list[tuple[float, float, str]] = field(default_factory=list)  # gpu: (start, end, kind)


def load_trace(path: Path) -> dict:
    """A Chrome trace as torch.profiler exports it (.json or .json.gz)."""
    try:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            trace = json.load(f)
    except (OSError, ValueError, EOFError) as e:
        raise ConfigError(f"cannot read the trace {path}: {str(e).splitlines()[0]}") from e
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ConfigError(f"{path} is not a torch.profiler trace (no traceEvents list)")
    return trace


def build_timeline(trace: dict) -> Timeline:
    """The trace's timeline: the gpu reader if it holds kernels, else the cpu reader."""
    # Kineto repeats annotations on the GPU's timeline (gpu_user_annotation): the host's count.
    events = [
        e
        for e in trace["traceEvents"]
        if e.get("ph") == "X" and "dur" in e and e.get("cat") != "gpu_user_annotation"
    ]
    steps = _steps(events)
    rank = (trace.get("distributedInfo") or {}).get("rank")
    main = {e["tid"] for e in events if _STEP.match(e["name"])}
    host = [e for e in events if e.get("tid") in main]
    regions = {
        "data": union(_span(e) for e in host if e["name"] == DATA_REGION),
        "optimizer": union(_span(e) for e in host if e["name"].startswith(_OPTIMIZER)),
    }
    if any(e.get("cat") == "kernel" for e in events):
        device_steps, compute, comm, kernels = _gpu(events, steps)
        return Timeline("gpu", rank, device_steps, compute, comm, regions, kernels)
    compute, comm = _cpu(host, [e for e in events if e.get("tid") not in main])
    return Timeline("cpu", rank, steps, compute, comm, regions)


def _span(e: dict) -> Interval:
    return (float(e["ts"]), float(e["ts"]) + float(e["dur"]))


def _steps(events: list[dict]) -> list[tuple[int, float, float]]:
    """The step annotations; the loop's own where present (ProfilerStep#N counts from the
    profiler's start, not the run's)."""
    ours = [e for e in events if e["name"].startswith(STEP_PREFIX)]
    chosen = ours or [e for e in events if _STEP.match(e["name"])]
    return sorted((int(_STEP.match(e["name"]).group(1)), *_span(e)) for e in chosen)


# Context parallelism's collectives, by the annotation around them (engine.context_parallel):
# kinds of their own, so the report tells them from FSDP's gathers and reductions.
CONTEXT_KINDS = {
    CONTEXT_ALL_GATHER_REGION: "context_all_gather",
    CONTEXT_REDUCE_SCATTER_REGION: "context_reduce_scatter",
}


def _context_regions(events: list[dict]) -> _Enclosing:
    """The spans of context parallelism's annotations, each carrying its collectives' kind."""
    return _Enclosing(
        [(*_span(e), CONTEXT_KINDS[e["name"]]) for e in events if e["name"] in CONTEXT_KINDS]
    )


# A collective's kind by the words in its operator's or kernel's name.
_KINDS = {
    "allgather": "all_gather",
    "reducescatter": "reduce_scatter",
    "allreduce": "all_reduce",
    "alltoall": "all_to_all",  # EP's token exchange (NCCL's SendRecv kernels: from the c10d call)
}


# A pipeline's sends and receives between stages, by their call (c10d::send, c10d::recv_) or
# gloo's operation; NCCL's SendRecv kernels take the kind of the c10d call that launched them
# (EP's all-to-all runs on the same kernels). On a CPU rank a receive spans its wait for the
# previous stage: the schedule's bubble shows there.
_P2P = re.compile(r"^(c10d::(send|recv)|gloo:(send|recv))")


def collective_kind(name: str) -> str:
    """all_gather, reduce_scatter, all_reduce, all_to_all, pipeline_p2p or other, from an
    operator's or kernel's name (c10d::_allgather_base_, gloo:all_to_all,
    ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL, c10d::send)."""
    if _P2P.match(name.lower()):
        return "pipeline_p2p"
    flat = name.lower().replace("_", "")
    return next((kind for word, kind in _KINDS.items() if word in flat), "other")


# A GPU kernel's kind by its name, first match wins (names as CUDA 13 / torch 2.11 on an H100
# print them: nvjet_sm90_tst_256x128_..., cudnn_generated_fort_native_sdpa_sm90_flash_bprop...,
# triton_poi_fused_..., multi_tensor_apply_kernel<...FusedAdam...>).
KERNEL_KINDS = (
    # torch.compile's kernels first: a fused kernel holding a softmax or a loss is still fused.
    ("fused", re.compile(r"^triton_")),  # norms, SwiGLU, RoPE, compiled loss chunks...
    ("attention", re.compile(r"flash|fmha|sdpa|attention|cudnn::fusion|attn")),
    ("matmul", re.compile(r"gemm|nvjet|xmma|cutlass|wgmma|cublas|matmul|splitk|grouped_mm")),
    ("optimizer", re.compile(r"multi_tensor_apply|adam|_foreach")),
    ("loss", re.compile(r"cross_entropy|nll_loss|log_softmax|softmax")),
    ("copy", re.compile(r"copy_kernel|chunk_cat|catarraybatched|split_with_sizes")),
)
KERNEL_KIND_NAMES = ("matmul", "attention", "fused", "optimizer", "loss", "copy", "other")


def kernel_kind(name: str, cat: str = "kernel") -> str:
    """matmul, attention, fused (torch.compile's Triton kernels), optimizer, loss, copy
    (memcpy, memset, dtype casts, FSDP2's copy-in/out) or other (elementwise, reductions...).
    torch.compile's kernels are ``fused`` even where a loss or softmax is inside them."""
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    low = name.lower()
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(low)), "other")


class _Enclosing:
    """Spans of one thread carrying a value (an FSDP unit, a collective's kind), to find the
    innermost one open at a moment."""

    def __init__(self, spans: list[tuple[float, float, str]]) -> None:
        self.spans = sorted(spans)
        self.starts = [s for s, _, _ in self.spans]

    def at(self, t: float, default: str) -> str:
        """The value of the innermost (latest-starting) span open at ``t``, else ``default``."""
        last = bisect.bisect_right(self.starts, t) - 1
        # Annotations nest a few deep, and an enclosing one started just before the ones
        # inside it: a short look back finds it without scanning the whole window.
        for start, end, value in reversed(self.spans[max(last - _LOOK_BACK, 0) : last + 1]):
            if start <= t < end:
                return value
        return default


def _units(events: list[dict]) -> _Enclosing:
    """FSDP2's annotations around its collectives, by unit ("" or "()": the root)."""
    spans = []
    for e in events:
        m = _FSDP.match(e["name"])
        if m and m.group(1) in ("all_gather", "post_backward_reduce", "backward_prefetch"):
            unit = m.group(2) if m.group(2) is not None else m.group(3)
            spans.append((*_span(e), unit or ROOT_UNIT))
    return _Enclosing(spans)


def _cpu(host: list[dict], others: list[dict]) -> tuple[list[Interval], list[Collective]]:
    """The main thread's compute; gloo's collectives matched to the calls that issued them."""
    issued = sorted(
        (e for e in host if e["name"].startswith("c10d::") and e.get("cat") == "cpu_op"),
        key=lambda e: e["ts"],
    )
    blockers = sorted(float(e["ts"]) for e in host if e["name"].startswith(("FSDP::", "c10d::")))
    compute = []
    for e in host:
        if e.get("cat") != "cpu_op" or e["name"].startswith("c10d::"):
            continue
        start, end = _span(e)
        i = bisect.bisect_right(blockers, start)
        if i < len(blockers) and blockers[i] < end:
            continue  # it encloses a wait: its own work is in the operators under it
        compute.append((start, end))
    units, context = _units(host), _context_regions(host)
    pending = deque((float(e["ts"]), collective_kind(e["name"])) for e in issued)
    comm = []
    # gloo's collectives run on its threads; a pipeline's sends and receives on the main one
    ran = [e for e in others if e["name"].startswith("gloo:")]
    ran += [e for e in host if e["name"].startswith("gloo:") and _P2P.match(e["name"])]
    for e in sorted(ran, key=lambda e: e["ts"]):
        start, end = _span(e)
        kind, unit = collective_kind(e["name"]), OTHER_UNIT
        call = _take_issue(pending, start, kind)
        if call is not None:
            kind, unit = context.at(call[0], call[1]), units.at(call[0], OTHER_UNIT)
        comm.append(Collective(start, end, kind, unit))
    return union(compute), comm


def _take_issue(pending: deque, start: float, kind: str) -> tuple[float, str] | None:
    """The earliest call issued before ``start`` that can have run as this gloo collective (gloo
    runs a reduce-scatter as an all-reduce), removed from ``pending``. Calls never matched by
    a collective (a group of one rank runs none) are passed over."""
    for i, (t, issued_kind) in enumerate(pending):
        if t > start:
            return None
        if issued_kind == kind or (issued_kind, kind) == ("reduce_scatter", "all_reduce"):
            del pending[i]
            return t, issued_kind
    return None


@dataclass
class _Thread:
    """What one launching thread's annotations say of a kernel it launched at a moment (backward
    runs on autograd's device thread): its FSDP unit, the collective a c10d call asked for (NCCL
    names some kernels ncclDevKernel_Generic), and context parallelism's regions."""

    units: _Enclosing
    calls: _Enclosing
    context: _Enclosing

    def collective(self, at: float, kind: str) -> tuple[str, str]:
        """(kind, unit) of a collective kernel launched at ``at`` whose own name says ``kind``."""
        if kind == "other":
            kind = self.calls.at(at, kind)
        return self.context.at(at, kind), self.units.at(at, OTHER_UNIT)


def _launching_threads(events: list[dict]) -> dict:
    """Each thread's annotations around collectives, by thread id."""
    by_thread: dict = {}
    for e in events:
        if e["name"].startswith(("FSDP::", "c10d::", "nccl:")) or e["name"] in CONTEXT_KINDS:
            by_thread.setdefault(e.get("tid"), []).append(e)
    return {
        tid: _Thread(
            _units(evs),
            _Enclosing(
                [
                    (*_span(e), collective_kind(e["name"]))
                    for e in evs
                    if e["name"].startswith(("c10d::", "nccl:"))
                ]
            ),
            _context_regions(evs),
        )
        for tid, evs in by_thread.items()
    }


def _gpu(
    events: list[dict], cpu_steps: list[tuple[int, float, float]]
) -> tuple[
    list[tuple[int, float, float]], list[Interval], list[Collective], list[tuple[float, float, str]]
]:
    """Device steps, compute, NCCL collectives and the compute kernels with their kinds, from
    the kernels, through their launches."""
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    threads = _launching_threads(events)
    starts = [s for _, s, _ in cpu_steps]
    first: dict[int, float] = {}  # step index -> its first device event's start
    last_end: dict[int, float] = {}
    compute, comm, kernels = [], [], []
    for e in events:
        if e.get("cat") not in _DEVICE_CATS:
            continue
        start, end = _span(e)
        launch = launches.get(e.get("args", {}).get("correlation"))
        at = float(launch["ts"]) if launch is not None else start
        k = bisect.bisect_right(starts, at) - 1
        # Launched before the window (its launch not recorded): no step's work. A trace with no
        # launches at all (runtime events off) places kernels by their own start instead.
        before_window = launch is None and bool(launches)
        if not before_window and 0 <= k < len(cpu_steps) and at <= cpu_steps[k][2]:
            first[k] = min(first.get(k, start), start)
            last_end[k] = max(last_end.get(k, end), end)
        if e.get("cat") == "kernel" and e["name"].lower().startswith("nccl"):
            tid = launch.get("tid") if launch is not None else None
            kind, unit = collective_kind(e["name"]), OTHER_UNIT
            if tid in threads:
                kind, unit = threads[tid].collective(at, kind)
            comm.append(Collective(start, end, kind, unit))
        else:
            compute.append((start, end))
            kernels.append((start, end, kernel_kind(e["name"], e.get("cat", ""))))
    device_steps = []
    for k, (step, cpu_start, cpu_end) in enumerate(cpu_steps):
        begin = first.get(k, cpu_start)
        following = next((first[j] for j in range(k + 1, len(cpu_steps)) if j in first), None)
        finish = following if following is not None else last_end.get(k, cpu_end)
        device_steps.append((step, begin, max(finish, begin)))
    return device_steps, union(compute), comm, kernels
