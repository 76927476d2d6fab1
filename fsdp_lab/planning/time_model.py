"""A training step's time on one rank, from its work and a device's rates: the arithmetic of
``fsdp-lab plan --device``. The memory plan's other half (``memory``, ``activation_memory``).

Pure: numbers in, numbers out; imports no torch. A step is ``micro_batches`` forward and
backward passes over the FSDP units, then the optimizer. Per unit and pass (``PassWork``,
counted by ``plan_trace`` from the operators the model dispatches):

* **compute**: each matrix multiply at the device's rate for its size and pass (measured by
  calibrate, or the achievable fraction of the peak), attention at the attention kernels'
  rate, a mixture of experts' grouped GEMMs at theirs, every other operator's bytes at the
  memory's bandwidth for its size, and the host's cost of issuing each operator and view.
  On a GPU the host issues kernels ahead of the device, so a pass costs the larger of its
  kernels and its issue; on a CPU the sum. Activation checkpointing's recompute is its
  unit's forward again in backward.
* **communication** (``collective_s``): ring all-gather and reduce-scatter of S bytes over n
  ranks take (n-1) x latency + (n-1)/n x S / bus bandwidth, an all-reduce twice that; a group
  that spans nodes runs at the network's rate.
* **overlap** (FSDP2's prefetch, the rule of torch's ``_tools/fsdp_ilp.py``; the kernels under
  a collective slowed by ``overlap_slowdown`` of its time): in forward the
  next unit's all-gather runs under this unit's compute, exposed by max(0, gather - compute);
  in backward the next unit's all-gather and the previous unit's reduce-scatter run under
  this unit's, exposed by max(0, gather + reduce-scatter - compute); the first gather and the
  last reduce-scatter are exposed whole. Without overlap (a CPU: gloo is waited for as it is
  issued) every collective is exposed. Collectives inside a unit's compute (TP's all-reduces,
  CP's key/value gathers, EP's all-to-alls) wait for the data they carry: exposed whole.
* **optimizer**: AdamW's bytes (param, grad, two moments, read and written; the gradient
  norm) at the memory bandwidth of where the state lives (the host under offload), and each
  parameter tensor's issue cost (``tensor_step_s``: DTensor dispatch, clipping's all-reduce).
* **other**: offload's host<->device copies of the shards, a step's host cost that nothing
  else prices (``step_host_s``, measured by calibrate on its tiny model's whole step), and what
  ``calibrate --from-runs`` learned the user's runs spend outside the model (``learned``).

Gradients are reduced once per step (the last micro-batch: ``set_requires_gradient_sync``);
parameters are gathered every micro-batch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fsdp_lab.config.hardware_profiles import DeviceProfile
from fsdp_lab.config.precisions import peak_key

# AdamW per trainable element (fp32): param read+write 8, grad read 4, exp_avg and exp_avg_sq
# read+write 16; clip_grad_norm_ reads the grad for the norm and scales it in place, 12 more.
OPTIMIZER_BYTES_PER_PARAM = 40
SOURCES = {
    "OPTIMIZER_BYTES_PER_PARAM": "count: torch's fused AdamW reads and writes the fp32 "
    "parameter and both moments and reads the gradient (28 bytes); clip_grad_norm_ reads the "
    "gradient for its norm and scales it in place (12)",
}
FORWARD, BACKWARD = "forward", "backward"
SPLIT = ("compute_s", "exposed_comm_s", "optimizer_s", "other_s")  # they add up to the step
TIME_HEADER = (
    f"{'step':>9} {'tok/s/rank':>11} {'MFU':>6} {'compute':>6} {'exp.comm':>6} "
    f"{'optim':>6} {'other':>6}"
)


@dataclass(frozen=True)
class Collective:
    """``count`` collectives ``op`` of ``nbytes`` each (the whole tensor: what an all-gather
    produces, what a reduce-scatter or all-reduce takes) over ``ranks`` ranks."""

    op: str  # all_gather | reduce_scatter | all_reduce | all_to_all
    nbytes: float
    ranks: int
    across_nodes: bool = False
    count: float = 1.0


@dataclass(frozen=True)
class PassWork:
    """One unit's forward or backward over one micro-batch on one rank: what its kernels
    compute and move, and how many operators the host issues (``plan_trace`` counts them)."""

    matmul_flops: float = 0.0
    matmul_calls: float = 0.0
    fp8_flops: float = 0.0  # of matmul_flops, those float8 linears run
    attention_flops: float = 0.0  # causal: half the scores counted
    head_dim: int = 0  # its attention's head size and keys (rates depend on them)
    attention_tokens: int = 0
    grouped_flops: float = 0.0  # a mixture of experts' grouped GEMMs
    # other operators: (size class, operators, bytes read and written) each; a size class is
    # log2 of one operator's bytes (a device's bandwidth depends on it)
    op_bytes: tuple[tuple[int, float, float], ...] = ()
    views: float = 0.0  # operators that move nothing (views, allocations): issue alone
    tp_linears: float = 0.0  # tensor-parallel linears (DTensor dispatch each)

    def ops(self) -> float:
        return sum(n for _, n, _ in self.op_bytes)

    def plus(self, other: PassWork) -> PassWork:
        """Both passes' work as one (a checkpointed unit's backward: its forward again)."""
        summed = {f.name: getattr(self, f.name) + getattr(other, f.name)
                  for f in dataclasses.fields(self)}  # fmt: skip
        summed["head_dim"] = self.head_dim or other.head_dim
        summed["attention_tokens"] = self.attention_tokens or other.attention_tokens
        return PassWork(**summed)


@dataclass(frozen=True)
class UnitWork:
    """One FSDP unit's work for one micro-batch on one rank."""

    name: str
    forward: PassWork
    backward: PassWork  # a checkpointed unit's recompute included
    gather: Collective | None = None  # its parameters' all-gather (None: never gathered)
    regather: bool = True  # gathered again for backward (resharded after forward)
    reduce: tuple[Collective, ...] = ()  # its gradients' reduction (HSDP: two levels)
    # the copies around that reduction: once a step, in the last micro-batch's backward
    reduce_copies: PassWork = PassWork()
    inner: tuple[Collective, ...] = ()  # collectives inside its forward+backward (TP, CP, EP)
    sharded: bool = True  # an FSDP unit (its hooks run around each pass)


@dataclass(frozen=True)
class StepWork:
    """A step on one rank: its units in forward order. The root unit comes first (its
    all-gather is the step's first, its reduce-scatter the last; its compute there is the
    embeddings'); the root's head and loss come last as a unit of compute alone."""

    units: tuple[UnitWork, ...]
    micro_batches: int
    tokens: float  # the rank's share of a micro-batch's positions (a TP or CP group's ranks
    # split their rows' positions between them: what tokens/s per rank counts)
    dtype: str  # compute dtype name: bf16 | fp16 | fp32
    optimizer_params: int  # the rank's trainable elements the optimizer steps
    offload_bytes: float = 0.0  # host<->device bytes per step (offload=cpu on a GPU)
    optimizer_on_host: bool = False  # offload=cpu: AdamW runs on the host's memory
    optimizer_tensors: int = 0  # the parameter tensors the optimizer steps (trainable ones)
    model_flops_per_token: float = 0.0  # MFU's numerator per token (6N + attention), no recompute
    # Pipeline parallelism: the schedule's idle share of a step on the heaviest rank
    # (``config.pipeline.ScheduleRow.bubble``), and the bytes this rank sends and receives to
    # its neighbour stages in a step (activations forward, their gradients back).
    pipeline_bubble: float = 0.0
    pipeline_bytes: float = 0.0


@dataclass(frozen=True)
class StepTime:
    """A predicted step, seconds; ``compute + exposed_comm + optimizer + other == step``."""

    step_s: float
    compute_s: float
    exposed_comm_s: float
    optimizer_s: float
    other_s: float
    comm_s: float  # every collective's time, hidden or not
    tokens_per_s: float  # per rank
    mfu: float | None  # model FLOP/s over the device's dense peak in the compute dtype
    device: str
    exposed_by_kind: dict[str, float] = field(default_factory=dict)  # fsdp, tp/cp/ep/pp (inner)
    bubble_s: float = 0.0  # the pipeline schedule's idle time (in other_s)
    p2p_s: float = 0.0  # the pipeline's sends between stages (in exposed_comm_s)

    def share(self, name: str) -> float:
        return getattr(self, name) / self.step_s if self.step_s > 0 else 0.0

    def cells(self) -> str:
        """Its row under ``TIME_HEADER``: time, tokens/s per rank, MFU, the split's shares."""
        mfu = f"{100 * self.mfu:5.1f}%" if self.mfu is not None else "    -"
        split = "".join(f" {100 * self.share(k):5.1f}%" for k in SPLIT)
        step = f"{self.step_s * 1e3:.1f} ms" if self.step_s < 1 else f"{self.step_s:.2f} s"
        return f"{step:>9} {self.tokens_per_s:>11,.0f} {mfu:>6}{split}"

    def to_json(self) -> dict:
        """Its fields by name (tokens_per_s: per rank), as plan --json and run.json hold it."""
        return dataclasses.asdict(self)


def _pipeline_s(work: StepWork, device: DeviceProfile, busy: float) -> tuple[float, float]:
    """A pipeline's (sends, bubble) seconds: the point-to-point sends exposed (a stage waits
    for its input), and the schedule's idle share of the pipelined part, ``busy``."""
    p2p = work.pipeline_bytes / device.intra_node.bytes_per_s if work.pipeline_bytes else 0.0
    bubble = (busy + p2p) * work.pipeline_bubble / (1 - work.pipeline_bubble)
    return p2p, bubble


def collective_s(c: Collective | None, device: DeviceProfile) -> float:
    """Seconds of ``c.count`` ring collectives (0 over one rank: FSDP2 copies)."""
    if c is None or c.ranks <= 1 or c.nbytes <= 0:
        return 0.0
    link = device.link(c.op, across_nodes=c.across_nodes)
    n = c.ranks
    steps, moved = n - 1, (n - 1) / n * c.nbytes
    if c.op == "all_reduce":
        steps, moved = 2 * steps, 2 * moved
    return c.count * (steps * link.latency_s + moved / link.bytes_per_s)


def compute_s(w: PassWork, device: DeviceProfile, dtype: str, phase: str) -> float:
    """One pass of a unit: its kernels (matmuls, float8 ones at float8's rate, attention,
    grouped GEMMs, other operators' bytes) and the host's issue of its operators."""
    dense = w.matmul_flops - w.fp8_flops
    kernels = device.matmul_s(dense, w.matmul_calls, dtype, phase)
    if w.fp8_flops:
        kernels += w.fp8_flops / device.flops("fp8")
    if w.attention_flops:
        kernels += device.attention_s(
            w.attention_flops, dtype, phase, w.head_dim, w.attention_tokens
        )
    if w.grouped_flops:
        kernels += w.grouped_flops / device.grouped_flops(dtype)
    kernels += sum(device.bytes_s(nbytes, bucket) for bucket, _, nbytes in w.op_bytes)
    issue = (
        w.ops() * device.op_overhead_s
        + w.views * device.view_overhead_s
        + w.tp_linears * device.tp_linear_s
    )
    return max(kernels, issue) if device.overlap else kernels + issue


def _pass_times(work: StepWork, device: DeviceProfile, phase: str) -> list[float]:
    return [
        compute_s(u.forward if phase == FORWARD else u.backward, device, work.dtype, phase)
        + (device.unit_overhead_s if u.sharded else 0.0)
        for u in work.units
    ]


def _exposed_forward(compute: list[float], gathers: list[float], overlap: bool) -> float:
    """The forward's exposed gathers: the first whole, each next one less the compute of the
    unit before it (the root's embeddings before the first block: little)."""
    if not overlap:
        return sum(gathers)
    exposed = gathers[0] if gathers else 0.0
    for i in range(1, len(gathers)):
        exposed += max(0.0, gathers[i] - compute[i - 1])
    return exposed


def _exposed_backward(
    compute: list[float], gathers: list[float], reduces: list[float], overlap: bool
) -> float:
    """Backward runs the units in reverse; under unit j's compute the next one's gather and
    the previous one's reduce-scatter; the last reduce-scatter (the root's) is exposed whole."""
    if not overlap:
        return sum(gathers) + sum(reduces)
    order = list(reversed(range(len(compute))))
    exposed = gathers[order[0]] if order else 0.0
    for k, j in enumerate(order):
        gather_next = gathers[order[k + 1]] if k + 1 < len(order) else 0.0
        reduce_prev = reduces[order[k - 1]] if k > 0 else 0.0
        exposed += max(0.0, gather_next + reduce_prev - compute[j])
    return exposed + (reduces[order[-1]] if order else 0.0)


def predict(work: StepWork, device: DeviceProfile) -> StepTime:
    """The step's time on ``device`` and its split."""
    fwd, bwd = _pass_times(work, device, FORWARD), _pass_times(work, device, BACKWARD)
    gathers = [collective_s(u.gather, device) for u in work.units]
    regathers = [g if u.regather else 0.0 for g, u in zip(gathers, work.units, strict=True)]
    reduces = [sum(collective_s(c, device) for c in u.reduce) for u in work.units]
    inner = [sum(collective_s(c, device) for c in u.inner) for u in work.units]
    no_reduce = [0.0] * len(reduces)
    last = [  # the last micro-batch's backward copies the gradients for their reduction
        b + compute_s(u.reduce_copies, device, work.dtype, BACKWARD)
        for b, u in zip(bwd, work.units, strict=True)
    ]
    m = work.micro_batches
    exposed_fsdp = m * _exposed_forward(fwd, gathers, device.overlap) + (
        (m - 1) * _exposed_backward(bwd, regathers, no_reduce, device.overlap)
        + _exposed_backward(last, regathers, reduces, device.overlap)
    )
    exposed_inner = m * sum(inner)
    compute = m * sum(fwd) + (m - 1) * sum(bwd) + sum(last)
    comm = m * (sum(gathers) + sum(regathers) + sum(inner)) + sum(reduces)
    # kernels slowed by the collectives running under them (SMs and memory shared)
    hidden = max(0.0, comm - exposed_fsdp - exposed_inner)
    # waiting for the slowest rank at each collective after a unit's compute
    synced = any(u.gather or u.reduce or u.inner for u in work.units)
    exposed_fsdp += device.straggle * compute if synced else 0.0
    compute += device.overlap_slowdown * hidden
    state_rate = device.host_memory_bytes_per_s if work.optimizer_on_host else None
    moved = work.optimizer_params * OPTIMIZER_BYTES_PER_PARAM
    kernels = moved / (state_rate or device.memory_bytes_per_s)
    issue = work.optimizer_tensors * device.tensor_step_s + device.optimizer_step_s
    optimizer = max(kernels, issue) if device.overlap else kernels + issue
    learned = device.learned or {}
    compute *= learned.get("compute_scale", 1.0)
    optimizer *= learned.get("compute_scale", 1.0)
    exposed_fsdp *= learned.get("comm_scale", 1.0)
    exposed_inner *= learned.get("comm_scale", 1.0)
    host = learned.get("host_s", 0.0) + device.step_host_s
    other = work.offload_bytes / device.host_link.bytes_per_s + host
    p2p, bubble = _pipeline_s(work, device, compute + exposed_fsdp + exposed_inner)
    exposed_inner, other = exposed_inner + p2p, other + bubble
    step = compute + exposed_fsdp + exposed_inner + optimizer + other
    tokens = work.tokens * m / step if step > 0 else 0.0
    peak = device.compute.get(peak_key(work.dtype))
    mfu = tokens * work.model_flops_per_token / peak if peak and device.kind == "gpu" else None
    return StepTime(
        step_s=step,
        compute_s=compute,
        exposed_comm_s=exposed_fsdp + exposed_inner,
        optimizer_s=optimizer,
        other_s=other,
        comm_s=comm,
        tokens_per_s=tokens,
        mfu=mfu,
        device=device.name,
        exposed_by_kind={"fsdp": exposed_fsdp, "inner": exposed_inner},
        bubble_s=bubble,
        p2p_s=p2p,
    )
