"""What `fsdp-lab tune` searches: the candidates (sharding x activation checkpointing x offload x
micro-batch x TP degree x EP degree x CP degree x PP degree) the topology can run, each with
the plan's peak and its predicted step (``plan_time``), by which they are probed. Nothing here
runs a rank.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from fsdp_lab.config import (
    ActivationCheckpointingConfig,
    ActivationCheckpointingMode,
    ConfigError,
    HardwareKind,
    ShardingStrategy,
    compose,
)
from fsdp_lab.config.hardware_kinds import hardware_row
from fsdp_lab.config.hardware_profiles import DeviceProfile
from fsdp_lab.config.pipeline import layout, schedule_of
from fsdp_lab.config.precisions import FLOAT8_RECIPES, TUNED_RECIPE
from fsdp_lab.config.rules import validate
from fsdp_lab.config.sharding import offload_config, offloaded
from fsdp_lab.config.topology import dp_size, stage_topology
from fsdp_lab.planning import plan, plan_pipeline
from fsdp_lab.planning.plan_result import StrategyPlan

AC = ActivationCheckpointingMode
# The grid's checkpointing modes, least recomputation first.
AC_MODES = (AC.none, AC.op, AC.selective, AC.full)
# Sequences from this long on are offered context parallelism (CP degrees 2, 4, 8 beside 1):
# at 4k tokens a 1B Llama's activations of one sequence (about 7 GiB in bf16, the plan says)
# pass its sharded state on 8 ranks; shorter ones fit by checkpointing and micro-batch alone.
LONG_SEQUENCE = 4096


@dataclass
class Candidate:
    strategy: ShardingStrategy
    ac: ActivationCheckpointingMode
    offload: bool
    micro_batch: int
    tensor: int = 1  # parallel.tensor
    expert: int = 1  # parallel.expert
    context: int = 1  # parallel.context
    pipeline: int = 1  # parallel.pipeline
    grad_accum: int | None = None  # trainer.grad_accum_steps, set under --keep-global-batch
    float8: bool = False  # float8 linears on bf16 (proposed on a GPU where torchao is installed)
    planned_bytes: int = 0  # predicted peak per rank on the budget's basis, margin included
    plan_peak_bytes: int = 0  # the plan's tensors alone
    prior: float = 0.0  # predicted seconds per token of the global batch (the time model)
    predicted_step_s: float | None = None  # the time model's step on the tune's device
    predicted_tokens_per_s: float | None = None  # every rank's together, as a run reports it
    measured_bytes: int | None = None
    tokens_per_s: float | None = None
    verdict: str = "not probed"
    run_dir: str | None = None

    def overrides(self) -> list[str]:
        """The config groups' options (``conf/<group>/<option>.yaml``, named as the enums'
        members) and settings that make this candidate."""
        offload = offload_config(self.offload).device
        return [
            f"sharding={self.strategy.name}",
            f"activation_checkpointing={self.ac.name}",
            f"offload={offload.name}",
            f"trainer.micro_batch_size={self.micro_batch}",
            *([f"parallel.tensor={self.tensor}"] if self.tensor > 1 else []),
            *([f"parallel.expert={self.expert}"] if self.expert > 1 else []),
            *([f"parallel.context={self.context}"] if self.context > 1 else []),
            *([f"parallel.pipeline={self.pipeline}"] if self.pipeline > 1 else []),
            *([f"trainer.grad_accum_steps={self.grad_accum}"] if self.grad_accum else []),
            *(["precision.float8_recipe=tensorwise"] if self.float8 else []),
        ]

    @property
    def name(self) -> str:
        return " ".join(self.overrides())


@dataclass
class Grid:
    """Axes restricted by the command line (--sharding, --checkpointing, --micro-batches,
    --tensor; None: every value), and --keep-global-batch: every candidate trains on the
    overrides' sequences per optimizer step (micro-batch x grad_accum_steps x data-parallel
    ranks), its grad_accum_steps set to make up its micro-batch."""

    strategies: list[ShardingStrategy] | None = None
    checkpointing: list[ActivationCheckpointingMode] | None = None
    micro_batches: list[int] | None = None
    tensor: list[int] | None = None
    keep_global_batch: bool = False
    expert: list[int] | None = None  # --expert: EP degrees (MoE models; else 1 only)
    context: list[int] | None = None  # --context: CP degrees (default: by the sequence length)
    pipeline: list[int] | None = None  # --pipeline: PP degrees (default: across nodes)

    @classmethod
    def parse(
        cls,
        sharding: str | None,
        checkpointing: str | None,
        micro: str | None,
        tensor: str | None = None,
        keep_global_batch: bool = False,
        expert: str | None = None,
        context: str | None = None,
        pipeline: str | None = None,
    ) -> Grid:
        return cls(
            strategies=_members(sharding, "--sharding", list(ShardingStrategy)),
            checkpointing=_members(checkpointing, "--checkpointing", list(AC_MODES)),
            micro_batches=_sizes(micro, "--micro-batches"),
            tensor=_sizes(tensor, "--tensor"),
            keep_global_batch=keep_global_batch,
            expert=_sizes(expert, "--expert"),
            context=_sizes(context, "--context"),
            pipeline=_sizes(pipeline, "--pipeline"),
        )


def _members(text: str | None, flag: str, allowed: list) -> list | None:
    """A comma list of the enum members' names, as those members; None for no flag."""
    if text is None:
        return None
    by_name = {member.name: member for member in allowed}
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or any(v not in by_name for v in values):
        raise ConfigError(f"{flag} {text}: use a comma list of {', '.join(by_name)}")
    return [by_name[v] for v in values]


def _sizes(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} {text}: use a comma list of sizes >= 1")
    return values


def override_key(override: str) -> str:
    """``+trainer.seq_len=64`` -> ``trainer.seq_len``."""
    return override.split("=", 1)[0].lstrip("+~")


def _held(overrides: list[str], *keys: str) -> bool:
    return any(override_key(o) in keys for o in overrides)


def _axes(cfg, topo, overrides: list[str], grid: Grid, max_micro_batch: int) -> tuple:
    """(strategies, checkpointing modes, offloads, micro-batches, TP degrees, EP degrees,
    float8, CP degrees) to enumerate: the grid's, or every value; an axis the overrides set is
    held at its value."""
    strategies = grid.strategies or list(ShardingStrategy)
    if _held(overrides, "sharding"):
        strategies = [cfg.sharding.strategy]
    acs = grid.checkpointing or list(AC_MODES)
    if _held(overrides, "activation_checkpointing"):
        acs = [cfg.activation_checkpointing.mode]
    offloads = [offloaded(cfg.offload)]
    if not _held(overrides, "offload") and not hardware_row(topo.device).host:
        offloads = [False, True]
    batches = grid.micro_batches or [
        2**i for i in range(max_micro_batch.bit_length()) if 2**i <= max_micro_batch
    ]
    if _held(overrides, "trainer.micro_batch_size"):
        batches = [cfg.trainer.micro_batch_size]
    tensors = grid.tensor or [t for t in (1, 2, 4, 8) if topo.nproc_per_node % t == 0]
    if _held(overrides, "parallel.tensor"):
        tensors = [cfg.parallel.tensor]
    experts = grid.expert or [1, 2, 4, 8]  # those the model and ranks refuse are dropped
    if _held(overrides, "parallel.expert"):
        experts = [cfg.parallel.expert]
    # CP for long sequences (those the rules refuse, e.g. a length 2N does not divide, dropped)
    contexts = grid.context or ([1, 2, 4, 8] if cfg.trainer.seq_len >= LONG_SEQUENCE else [1])
    if _held(overrides, "parallel.context"):
        contexts = [cfg.parallel.context]
    float8s = _float8_axis(cfg, topo, overrides)
    # PP across nodes: each stage's FSDP gathers then stay inside its node(s)
    pipelines = grid.pipeline or [1, *(n for n in (2, 4, 8) if topo.num_nodes % n == 0)]
    if _held(overrides, "parallel.pipeline"):
        pipelines = [cfg.parallel.pipeline]
    return strategies, acs, offloads, batches, tensors, experts, float8s, contexts, pipelines


def _float8_axis(cfg, topo, overrides: list[str]) -> list[bool]:
    """float8 is tried beside a bf16 run's own precision on a GPU (float8 matmuls need one: on
    a CPU they are emulated, slower), unless the overrides chose it themselves. What the rules
    refuse with it (no torchao, an NF4 base, TP, offload) ``_model_axes`` and the plan drop."""
    p = cfg.precision
    if (
        not hardware_row(topo.device).host
        and not _held(overrides, "precision.float8_recipe", "precision.float8_all_gather")
        and p.param_dtype is FLOAT8_RECIPES[TUNED_RECIPE].compute
        and p.float8_recipe is None
    ):
        return [False, True]
    return [False]  # as the overrides say (float8 too, where they chose it)


def enumerate_candidates(
    overrides: list[str],
    max_micro_batch: int,
    grid: Grid | None = None,
    device: str | None = None,
) -> tuple[list[Candidate], HardwareKind, int]:
    """Every candidate the topology can run, with the plan's peak and its predicted step on
    ``device`` (``plan.time_device``): (candidates, device kind, world size). ``grid``
    restricts the axes. Raises ConfigError for overrides the plan refuses."""
    grid = grid or Grid()
    cfg = compose(overrides)
    topo, _ = plan.topology(cfg)
    validate(cfg, topo)
    profile, _ = plan.time_device(device, topo, cfg)
    *axes, pipelines = _axes(cfg, topo, overrides, grid, max_micro_batch)
    strategies, acs, offloads, batches, tensors, experts, float8s, contexts = axes
    rows = global_batch(cfg, topo) if grid.keep_global_batch else None
    out, indivisible = [], set()
    layouts = itertools.product(acs, tensors, experts, float8s, contexts, pipelines)
    for ac, tp, ep, f8, cp, pp in layouts:
        model_axes = _model_axes(
            cfg, topo, ac=ac, tensor=tp, expert=ep, context=cp, float8=f8, pipeline=pp
        )
        if model_axes is None:
            continue
        base, facts = model_axes
        for strategy, offload, mb in itertools.product(strategies, offloads, batches):
            accum = base.trainer.grad_accum_steps
            if rows is not None:
                # sequences per micro-step, all ranks (a pipeline's stages read the same)
                share = mb * dp_size(stage_topology(topo, pp), tp, context=cp)
                if rows % share:
                    indivisible.add((mb, tp, cp))  # it cannot make up the global batch
                    continue
                accum = rows // share
            c = Candidate(strategy, ac, offload, mb, tensor=tp, expert=ep, float8=f8, context=cp)
            c.pipeline = pp
            c.grad_accum = accum if rows is not None else None
            if _plan_peak(c, base, topo, facts, accum=accum, profile=profile):
                out.append(c)
    if not out and indivisible:
        raise ConfigError(_indivisible(batches, rows, dp_size(topo)))
    return out, topo.device, topo.world_size


def _plan_peak(
    c: Candidate, base, topo, facts: list[plan.ModelShape], *, accum: int, profile: DeviceProfile
) -> bool:
    """Set the candidate's plan peak and predicted step (``facts``: each pipeline rank's, one
    without a pipeline); False where the plan refuses it or finds it cannot run."""
    variant = dataclasses.replace(
        base,
        offload=offload_config(c.offload),
        trainer=dataclasses.replace(
            base.trainer, micro_batch_size=c.micro_batch, grad_accum_steps=accum
        ),
    )
    try:
        if c.pipeline > 1:  # the microbatches must divide the micro-batch
            layout(variant.parallel, facts[0].pipeline.of_layers, c.micro_batch)
        s = plan_pipeline.combined(
            [plan.timed(variant, topo, f, c.strategy, profile) for f in facts]
        )
    except ConfigError:
        return False
    if not isinstance(s, StrategyPlan):
        return False
    c.plan_peak_bytes = s.peak
    step = s.time
    c.predicted_step_s = step.step_s
    c.predicted_tokens_per_s = step.tokens_per_s * topo.world_size
    c.prior = 1 / c.predicted_tokens_per_s if c.predicted_tokens_per_s else float("inf")
    return True


# Many parameters: one per axis of the grid that changes the model's layout.
def _model_axes(
    cfg,
    topo,
    *,
    ac: ActivationCheckpointingMode,
    tensor: int,
    expert: int,
    context: int = 1,
    float8: bool = False,
    pipeline: int = 1,
):
    """(the config with these checkpointing, TP, EP, CP, float8 and PP settings, the plan's
    model facts, one per pipeline rank), or None where the rules or the model refuse them: a
    TP degree the heads do not divide, EP on a dense model or with experts the degree does not
    divide, float8 with either, CP on a model whose attention it does not reproduce or a
    sequence its 2N chunks do not divide, PP on a family it does not cut."""
    if float8 and cfg.precision.float8_recipe is None:
        cfg = dataclasses.replace(
            cfg, precision=dataclasses.replace(cfg.precision, float8_recipe=TUNED_RECIPE)
        )
    base = dataclasses.replace(
        cfg,
        activation_checkpointing=ActivationCheckpointingConfig(
            mode=ac, every=cfg.activation_checkpointing.every
        ),
        parallel=dataclasses.replace(
            cfg.parallel, tensor=tensor, expert=expert, context=context, pipeline=pipeline
        ),
    )
    if pipeline > 1:  # a micro-batch its microbatches divide (each candidate sets its own)
        row = schedule_of(base.parallel.pipeline_schedule)
        per_rank = base.parallel.stages_per_rank or row.default_stages_per_rank
        m = base.parallel.pipeline_microbatches or pipeline * per_rank
        base = dataclasses.replace(
            base, trainer=dataclasses.replace(base.trainer, micro_batch_size=m)
        )
    try:
        validate(base, topo)
        whole = plan.inspect_model(base, topo.device)
        facts = plan_pipeline.stage_facts(base, topo.device, whole)
    except ConfigError:
        return None
    if expert > 1 and (not whole.layer.experts or whole.layer.experts % expert):
        return None
    return base, facts


def _indivisible(batches: list[int], rows: int, dp: int) -> str:
    return (
        f"--keep-global-batch: no micro-batch tried ({', '.join(map(str, batches))}) makes up "
        f"the global batch of {rows} sequences per step: {rows // dp} per data-parallel rank "
        f"(more under TP or CP, whose groups read the same rows); try --micro-batches that "
        f"divide {rows // dp}"
    )


def global_batch(cfg, topo) -> int:
    """Sequences per optimizer step: micro-batch x grad_accum_steps x data-parallel ranks."""
    t = cfg.trainer
    return (
        t.micro_batch_size
        * t.grad_accum_steps
        * dp_size(
            stage_topology(topo, cfg.parallel.pipeline),
            cfg.parallel.tensor,
            context=cfg.parallel.context,
        )
    )


def probe_order(candidates: list[Candidate]) -> list[Candidate]:
    """Fastest predicted first (the smaller peak first among equals)."""
    return sorted(candidates, key=lambda c: (c.prior, c.planned_bytes))
