"""Pipeline parallelism's schedules, one row each, and how a model's layers split into stages.
Imports no torch.

``parallel.pipeline=N`` cuts the model into stages, ``N x parallel.stages_per_rank`` of them,
placed on the outermost axis of the mesh (a stage's ranks shard it with the run's strategy).
What each of torch's schedules (``torch.distributed.pipelining``) needs of the stages and the
microbatches is its row here: the rules check a config by it, the engine builds the schedule it
names, and the plan and the time model price its bubble from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from fsdp_lab.config.checkpoint_formats import format_row
from fsdp_lab.config.errors import ConfigError, positive
from fsdp_lab.config.losses import loss_is_fused
from fsdp_lab.config.model import WeightLoading, task_row
from fsdp_lab.config.schema import Config
from fsdp_lab.config.strategies import reshard_after_forward
from fsdp_lab.config.topology import Topology, stage_topology

PIPELINE_AXIS = "pp"


class Placement(Enum):
    loop = "loop"  # stage s on rank s % N (interleaved: rank r holds r, r + N, ...)
    v = "v"  # two stages a rank, r and 2N - 1 - r: the first and the last share rank 0


@dataclass(frozen=True)
class ScheduleRow:
    """What a schedule needs and what it costs."""

    name: str  # torch's (``get_schedule_class``'s)
    multi: bool  # several stages a rank (torch's PipelineScheduleMulti); else exactly one
    placement: Placement
    default_stages_per_rank: int
    # The microbatch count's condition (microbatches, total stages, pipeline ranks) -> the
    # problem in words, or None.
    microbatches_problem: Callable[[int, int, int], str | None]
    # Backward split into its input and weight halves, run apart to fill the bubble.
    splits_backward: bool = False

    def bubble(self, microbatches: int, pipeline: int, stages_per_rank: int) -> float:
        """The idle share of a step on a rank, for stages of equal cost and forward:backward
        1:2: (N - 1) / (V m + N - 1) for N ranks, V stages a rank, m microbatches (GPipe and
        1F1B: V = 1; an interleaved schedule divides the ramp by V). Zero-bubble schedules fill
        the ramp with weight gradients: a third of it stays (their input-gradient half)."""
        n, v, m = pipeline, stages_per_rank, microbatches
        if n == 1:
            return 0.0
        ramp = (n - 1) / (v * m + n - 1)
        return ramp / 3 if self.splits_backward else ramp


def _none(m: int, stages: int, n: int) -> str | None:
    return None


def _at_least_stages(m: int, stages: int, n: int) -> str | None:
    return None if m >= stages else f"at least the {stages} stages"


def _rounds(m: int, stages: int, n: int) -> str | None:
    rounds = max(1, m // n)
    return None if m % rounds == 0 else f"a multiple of its {rounds} rounds (max(1, m // {n}))"


SCHEDULES: dict[str, ScheduleRow] = {
    row.name.lower(): row
    for row in (
        ScheduleRow("GPipe", False, Placement.loop, 1, _none),
        ScheduleRow("1F1B", False, Placement.loop, 1, _at_least_stages),
        ScheduleRow("Interleaved1F1B", True, Placement.loop, 2, _rounds),
        ScheduleRow("LoopedBFS", True, Placement.loop, 2, _none),
        ScheduleRow("InterleavedZeroBubble", True, Placement.loop, 2, _rounds, True),
        ScheduleRow("ZBVZeroBubble", True, Placement.v, 2, _none, True),
        ScheduleRow("DualPipeV", True, Placement.v, 2, _at_least_stages, True),
    )
}


def schedule_of(name: str) -> ScheduleRow:
    row = SCHEDULES.get(name.lower())
    if row is None:
        raise ConfigError(
            f"parallel.pipeline_schedule={name} is not a schedule; use one of "
            f"{', '.join(r.name for r in SCHEDULES.values())}"
        )
    return row


@dataclass(frozen=True)
class PipelineLayout:
    """A pipeline's stages: which decoder layers each holds (the first also the embedding, the
    last the final norm and the head) and which pipeline rank runs it."""

    pipeline: int  # ranks on the pipeline axis
    schedule: ScheduleRow
    layers: tuple[tuple[int, ...], ...]  # per stage, in order
    microbatches: int

    @property
    def stages(self) -> int:
        return len(self.layers)

    @property
    def stages_per_rank(self) -> int:
        return self.stages // self.pipeline

    def rank_of(self, stage: int) -> int:
        n = self.pipeline
        if self.schedule.placement is Placement.v:
            return stage if stage < n else 2 * n - 1 - stage
        return stage % n

    def stages_of(self, rank: int) -> list[int]:
        """The stages pipeline rank ``rank`` runs, in order."""
        return [s for s in range(self.stages) if self.rank_of(s) == rank]

    def bubble(self) -> float:
        return self.schedule.bubble(self.microbatches, self.pipeline, self.stages_per_rank)

    def in_flight(self, rank: int) -> float:
        """The share of a micro-batch's activations (of this rank's layers) alive at once:
        GPipe runs every microbatch's forward before any backward (all of them); 1F1B keeps
        those its warm-up started, N - rank of them, at most all; an interleaved schedule
        about N x V (its rounds' depth) on rank 0."""
        m, n = self.microbatches, self.pipeline
        if self.schedule.name == "GPipe" or self.schedule.name == "LoopedBFS":
            held = m
        elif self.schedule.multi:
            held = min(m, n * self.stages_per_rank)
        else:
            held = min(m, n - rank)
        return held / m


def split_layers(num_layers: int, stages: int) -> tuple[tuple[int, ...], ...]:
    """Decoder layers per stage, as torchtitan splits them: the embedding and the head counted
    as a layer each, so the first and the last stage hold one decoder layer fewer; the
    remainder goes to the middle stages."""
    units = num_layers + 2
    base, extra = divmod(units, stages)
    sizes = [base] * stages
    middle = list(range(1, stages - 1)) or list(range(stages))
    for i in range(extra):
        sizes[middle[i % len(middle)]] += 1
    sizes[0] -= 1
    sizes[-1] -= 1
    return given_split(sizes)


def given_split(sizes: list[int]) -> tuple[tuple[int, ...], ...]:
    out, start = [], 0
    for size in sizes:
        out.append(tuple(range(start, start + size)))
        start += size
    return tuple(out)


def layout(parallel, num_layers: int, micro_batch_size: int) -> PipelineLayout:
    """The run's stages from ``parallel`` (``config.sharding.ParallelConfig``), checked: a
    ConfigError names the setting and the fix."""
    n = parallel.pipeline
    row = schedule_of(parallel.pipeline_schedule)
    per_rank = parallel.stages_per_rank or row.default_stages_per_rank
    where = f"parallel.pipeline_schedule={row.name}"
    if not row.multi and per_rank != 1:
        raise ConfigError(
            f"{where} runs one stage a rank (parallel.stages_per_rank={per_rank}); set "
            "parallel.stages_per_rank=1, or an interleaved schedule (Interleaved1F1B)"
        )
    if row.placement is Placement.v and per_rank != 2:
        raise ConfigError(
            f"{where} runs exactly 2 stages a rank (parallel.stages_per_rank={per_rank}); set "
            "parallel.stages_per_rank=2"
        )
    stages = n * per_rank
    if stages > num_layers:
        raise ConfigError(
            f"parallel.pipeline={n} x parallel.stages_per_rank={per_rank} = {stages} stages, "
            f"more than the model's {num_layers} layers; use fewer stages"
        )
    if parallel.pipeline_layers:
        sizes = list(parallel.pipeline_layers)
        if len(sizes) != stages or sum(sizes) != num_layers or min(sizes) < 0:
            raise ConfigError(
                f"parallel.pipeline_layers={sizes} must give each of the {stages} stages its "
                f"decoder layers, {num_layers} in all; fix the list or remove it"
            )
        layers = given_split(sizes)
    else:
        layers = split_layers(num_layers, stages)
    m = parallel.pipeline_microbatches or stages
    if micro_batch_size % m:
        raise ConfigError(
            f"parallel.pipeline_microbatches={m} does not divide trainer.micro_batch_size="
            f"{micro_batch_size} (each microbatch is rows of it); set trainer.micro_batch_size "
            f"to a multiple of {m}, or parallel.pipeline_microbatches to a divisor"
        )
    problem = row.microbatches_problem(m, stages, n)
    if problem is not None:
        raise ConfigError(
            f"{where} cannot run {m} microbatches: it needs {problem}; set "
            "parallel.pipeline_microbatches (and trainer.micro_batch_size, a multiple of it)"
        )
    return PipelineLayout(n, row, layers, m)


def splits_backward(parallel) -> bool:
    """Whether the run's schedule runs a backward in two halves (input, then weight), which
    the model's own loss must compute (``train.loss.resolve_loss``: auto takes it)."""
    return parallel.pipeline > 1 and schedule_of(parallel.pipeline_schedule).splits_backward


def _check_split_backward(cfg: Config) -> None:
    """A zero-bubble schedule computes a microbatch's weight gradients after other
    microbatches' forwards, from the graph its input backward kept: the weights it saved must
    stay gathered (a regather writes them in place; a resharded module offers its shards, not
    the gathered weights the graph used), and every operation's backward must run in halves
    (a fused loss's own backward computes both at once)."""
    p, s = cfg.parallel, cfg.sharding
    where = f"parallel.pipeline_schedule={schedule_of(p.pipeline_schedule).name}"
    if reshard_after_forward(s) is not False:
        raise ConfigError(
            f"{where} computes weight gradients after later forwards, from weights kept "
            f"gathered; sharding={s.strategy.name} reshards them after forward: use "
            "sharding=grad_op (or sharding.reshard_after_forward=false), or 1F1B"
        )
    if cfg.compile:
        raise ConfigError(
            f"{where} splits every backward into its input and weight halves, which torch "
            "does not compile; set compile=false, or use 1F1B (or Interleaved1F1B)"
        )
    if loss_is_fused(cfg.loss.kind):
        raise ConfigError(
            f"{where} splits every backward into its input and weight halves; loss="
            f"{cfg.loss.kind.name}'s backward computes both at once: use loss=hf (or auto)"
        )


def check_pipeline(cfg: Config, topo: Topology) -> Topology:
    """parallel.pipeline: a divisor of the ranks, its schedule a row of
    ``config.pipeline.SCHEDULES``, and what it does not run with yet refused; returns the
    topology of one stage, which every data-parallel rule then applies to. The model's side
    (a family it cuts, the stages its layers make) is checked on its config (launch.prepare)."""
    p = cfg.parallel
    positive(p.pipeline, "parallel.pipeline")
    schedule_of(p.pipeline_schedule)
    if p.pipeline == 1:
        extra = [
            name
            for name in ("stages_per_rank", "pipeline_microbatches", "pipeline_layers")
            if getattr(p, name) is not None
        ]
        if extra:
            raise ConfigError(
                f"parallel.{extra[0]} applies only with parallel.pipeline > 1; remove it or "
                "set parallel.pipeline"
            )
        return topo
    if topo.world_size % p.pipeline:
        raise ConfigError(
            f"parallel.pipeline={p.pipeline} does not divide the {topo.world_size} ranks; set "
            "hardware.nproc_per_node (x hardware.num_nodes) to a multiple of it"
        )
    nodes = topo.num_nodes
    if nodes > 1 and nodes % p.pipeline and p.pipeline % nodes:
        raise ConfigError(
            f"parallel.pipeline={p.pipeline} on {nodes} nodes: a stage must be whole nodes or "
            "a share of one; set parallel.pipeline to a divisor or a multiple of "
            "hardware.num_nodes"
        )
    refusals = (
        (p.sequence_parallel, "parallel.sequence_parallel=true"),
        (
            cfg.precision.output_dtype is not None,
            "precision.output_dtype (a stage's output is the hidden states it sends)",
        ),
        (
            p.expert > 1 or cfg.model.num_experts,
            "a mixture of experts (its load-balancing loss spans the stages)",
        ),
        (not task_row(cfg.model.task).causal, f"model.task={cfg.model.task.value}"),
        (cfg.model.loading is WeightLoading.rank0, "model.loading=rank0 (use per_rank)"),
        (
            format_row(cfg.checkpoint.format).whole_files,
            f"checkpoint.format={cfg.checkpoint.format.name} (use sharded: DCP)",
        ),
    )
    for refused, what in refusals:
        if refused:
            raise ConfigError(
                f"parallel.pipeline={p.pipeline} is not verified with {what} yet; set "
                "parallel.pipeline=1 or drop that setting"
            )
    if splits_backward(p):
        _check_split_backward(cfg)
    return stage_topology(topo, p.pipeline)
