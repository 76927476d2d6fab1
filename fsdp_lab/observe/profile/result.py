"""What a profile's analysis finds, per rank and per step: the dataclasses other modules read
(the run's reporter, ``fsdp-lab profile``, the timeline picture, the sweep report through
run.json), and their JSON form (run.json's ``profile`` section).

All times are seconds. For one step: ``compute_s + exposed_comm_s + idle_s == step_s`` (the
step's span split into compute, communication that compute did not cover, and neither).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

# The per-step numbers, in the order tables print them.
TIMES = (
    "step_s",
    "compute_s",
    "comm_s",
    "exposed_comm_s",
    "idle_s",
    "idle_host_s",
    "idle_data_s",
    "idle_optimizer_s",
)
ROOT_UNIT = "root"  # the model's root FSDP unit (embeddings, final norm, head where unwrapped)
OTHER_UNIT = "other"  # a collective outside FSDP's units (the gradient norm's all-reduce...)


@dataclass
class UnitComm:
    """One FSDP unit's collectives of one kind in a step (or the mean over steps)."""

    unit: str  # the module's name (model.layers.3), ROOT_UNIT or OTHER_UNIT
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | context_all_gather
    # | context_reduce_scatter (context parallelism's) | pipeline_p2p (a pipeline's sends and
    # receives between stages; a receive spans its wait: the bubble) | other
    count: float  # collectives
    time_s: float  # their busy time (the union of their intervals)
    exposed_s: float  # of it, not covered by compute: what the step waited for


@dataclass
class StepBreakdown:
    """One step of one rank (or a mean of several)."""

    step: int  # the optimizer step (1-based, as metrics.jsonl counts); -1 for a mean
    step_s: float  # the step's span on the device's clock
    compute_s: float  # the union of compute intervals
    comm_s: float  # the union of collective intervals
    exposed_comm_s: float  # comm not covered by compute: comm - |comm ∩ compute|
    idle_s: float  # neither compute nor comm: step - |compute ∪ comm|
    idle_host_s: float  # of idle, while the host was elsewhere (Python, launches, hooks)
    idle_data_s: float  # of idle, while the host prepared the next batch
    idle_optimizer_s: float  # of idle, while the host ran the optimizer step
    units: list[UnitComm] = field(default_factory=list)
    # gpu: the busy time of each kind of compute kernel (matmul, attention, fused, optimizer,
    # loss, copy, other: timeline.kernel_kind), the union of its kernels in the step; the kinds
    # together are compute_s where kernels of two kinds never run at once. Empty on cpu.
    kernels: dict[str, float] = field(default_factory=dict)

    def share(self, name: str) -> float:
        """A time as a share of the step (0 for an empty step)."""
        return getattr(self, name) / self.step_s if self.step_s > 0 else 0.0


@dataclass
class Span:
    """An interval of the timeline picture, seconds from the step's start."""

    start_s: float
    end_s: float
    kind: str  # compute (or a gpu kernel kind: matmul, attention...) | all_gather | reduce_scatter
    # | all_reduce | all_to_all | other
    unit: str = ""  # a collective's FSDP unit


@dataclass
class StepPicture:
    """One step of one rank as ``profile/timeline.png`` draws it: compute and collectives on
    their lanes, and the exposed parts of the collectives."""

    rank: int
    step: int
    step_s: float
    compute: list[Span]
    comm: list[Span]
    exposed: list[Span]  # comm minus compute (kind and unit of the collective they belong to)


@dataclass
class RankProfile:
    """One rank's profiled window."""

    rank: int
    device: str  # cpu: gloo's threads vs the main thread; gpu: NCCL kernels vs other kernels
    trace: str  # the trace file, relative to the run dir
    steps: list[StepBreakdown]
    picture: StepPicture | None = None  # the window's median-time step

    def mean(self) -> StepBreakdown:
        return mean_breakdown(self.steps)


@dataclass
class ProfileResult:
    """Every profiled rank's window, and how long the analysis took."""

    ranks: list[RankProfile]
    analysis_s: float = 0.0

    @property
    def steps(self) -> list[int]:
        return sorted({s.step for r in self.ranks for s in r.steps})

    def mean(self) -> StepBreakdown:
        """The mean over ranks of each rank's mean over the window's steps."""
        return mean_breakdown([r.mean() for r in self.ranks])

    def as_dict(self) -> dict:
        """run.json's ``profile`` section (besides the settings the reporter adds)."""
        mean = self.mean()
        return {
            "device": self.ranks[0].device if self.ranks else None,
            "steps": self.steps,
            "ranks": [r.rank for r in self.ranks],
            "analysis_s": self.analysis_s,
            "summary": summary_dict(mean),
            "units": [dataclasses.asdict(u) for u in mean.units],
            "per_rank": [
                {
                    "rank": r.rank,
                    "device": r.device,
                    "trace": r.trace,
                    "summary": summary_dict(r.mean()),
                    "steps": [dataclasses.asdict(s) for s in r.steps],
                }
                for r in self.ranks
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> ProfileResult:
        """Back from run.json (pictures are not kept there)."""
        ranks = [
            RankProfile(
                rank=r["rank"],
                device=r["device"],
                trace=r["trace"],
                steps=[_breakdown(s) for s in r["steps"]],
            )
            for r in data.get("per_rank", [])
        ]
        return cls(ranks=ranks, analysis_s=data.get("analysis_s", 0.0))


def summary_dict(b: StepBreakdown) -> dict:
    """The times and their shares of the step (compute_share, exposed_comm_share...), and on
    gpu each kernel kind's time and share of compute (kernel_matmul_s, kernel_matmul_share):
    flat numbers, as metrics.jsonl and the trackers take them."""
    out = {name: getattr(b, name) for name in TIMES}
    out.update({name[:-2] + "_share": b.share(name) for name in TIMES[1:]})
    for kind, seconds in b.kernels.items():
        out[f"kernel_{kind}_s"] = seconds
        out[f"kernel_{kind}_share"] = seconds / b.compute_s if b.compute_s > 0 else 0.0
    return out


def _breakdown(data: dict) -> StepBreakdown:
    units = [UnitComm(**u) for u in data.get("units", [])]
    return StepBreakdown(**{**{k: v for k, v in data.items() if k != "units"}, "units": units})


def mean_breakdown(steps: list[StepBreakdown]) -> StepBreakdown:
    """The mean of each time over ``steps`` (step -1), units matched by (unit, kind) in the
    order they first appear; a unit absent from a step counts 0 there."""
    n = max(len(steps), 1)
    times = {name: sum(getattr(s, name) for s in steps) / n for name in TIMES}
    kernels: dict[str, float] = {}
    for s in steps:
        for kind, seconds in s.kernels.items():
            kernels[kind] = kernels.get(kind, 0.0) + seconds / n
    units: dict[tuple[str, str], UnitComm] = {}
    for s in steps:
        for u in s.units:
            acc = units.setdefault((u.unit, u.kind), UnitComm(u.unit, u.kind, 0.0, 0.0, 0.0))
            acc.count += u.count / n
            acc.time_s += u.time_s / n
            acc.exposed_s += u.exposed_s / n
    return StepBreakdown(step=-1, **times, units=list(units.values()), kernels=kernels)
