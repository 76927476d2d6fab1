"""What `fsdp-lab plan` computes, as types: `build_plan` returns a `Plan`, which `format_plan`
prints, `tune` ranks by its peaks, and `--json` writes (`Plan.to_json`). Figures are bytes per
rank. Read by attribute, so a renamed figure fails at the reader, not as a missing key."""

from __future__ import annotations

import dataclasses
import textwrap
from dataclasses import dataclass

from fsdp_lab.planning import memory
from fsdp_lab.planning.time_model import TIME_HEADER, StepTime


@dataclass(frozen=True)
class Unavailable:
    """A strategy this topology cannot run (hybrid on 2 ranks), and the rule it breaks."""

    reason: str

    def to_json(self) -> dict:
        return {"available": False, "reason": self.reason}


@dataclass(frozen=True)
class ZeroPaper:
    """The ZeRO paper's model state per rank for the strategy's stage, beside FSDP2's."""

    stage: int
    dp_size: int  # N: the ranks the state is sharded over
    state: memory.StateBytes

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "dp_size": self.dp_size,
            **dataclasses.asdict(self.state),
            "total": self.state.total,
        }


@dataclass(frozen=True)
class StrategyPlan:
    """One strategy's figures on this topology."""

    mesh: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    fsdp_mesh: tuple[int, ...]  # the mesh FSDP shards on: no TP axis, a CP axis folded in
    reshard_after_forward: bool | int
    state_location: str  # where params, grads and optimizer state live: host or device
    per_rank: list[memory.StateBytes]  # every rank's state at rest
    activations: int  # saved for backward per micro-batch
    transient: memory.Transient
    peak: int  # rank 0's, the largest (`memory.peak`)
    zero_paper: ZeroPaper
    time: StepTime | None = None  # the step's predicted time on the plan's device
    # A pipeline: each pipeline rank's own plan, in rank order (``planning.plan_pipeline``)
    parts: tuple[StrategyPlan, ...] = ()
    counted: int = 0  # the rank whose state the figures show: the counted part's first

    @property
    def rank0(self) -> memory.StateBytes:
        """The counted rank's state (rank 0's: chunk 0 is never smaller than another rank's;
        under a pipeline, the first rank of the stage with the highest peak)."""
        return self.per_rank[self.counted]

    @property
    def sum(self) -> int:
        """Everything added up, as if it all peaked at once: an upper bound beside `peak`."""
        return self.rank0.total + self.activations + self.transient.total

    def peak_over_start(self, rank: int) -> int:
        """``rank``'s peak less what it holds before the first step (its parameters): what a
        run measures as its peak memory less its memory before training."""
        if self.parts:  # a pipeline: the plan of the rank's stage
            ranks = len(self.parts[0].per_rank)
            return self.parts[rank // ranks].peak_over_start(rank % ranks)
        mine = self.per_rank[rank]
        peak = memory.peak(
            mine,
            activations=self.activations,
            transient_bytes=self.transient.total,
            end_of_backward=self.transient.end_of_backward,
        )
        return peak - mine.params - (mine.padding - mine.grad_padding)

    def to_json(self) -> dict:
        return {
            "available": True,
            "mesh": list(self.mesh),
            "mesh_axes": list(self.mesh_axes),
            "fsdp_mesh": list(self.fsdp_mesh),
            "reshard_after_forward": self.reshard_after_forward,
            "state_location": self.state_location,
            "per_rank": [dataclasses.asdict(r) for r in self.per_rank],
            "rank0": dataclasses.asdict(self.rank0),
            "activations": self.activations,
            "transient": {**dataclasses.asdict(self.transient), "total": self.transient.total},
            "peak": self.peak,
            "sum": self.sum,
            "zero_paper": self.zero_paper.to_json(),
            "time": self.time.to_json() if self.time is not None else None,
            "pipeline_peaks": [part.peak for part in self.parts],
            "counted_rank": self.counted,
        }


@dataclass(frozen=True)
class Units:
    description: str  # wrap.summarize_units' line
    count: int  # FSDP units, the root included
    classes: dict[str, int]  # units per module class


@dataclass(frozen=True)
class Dtypes:
    """Compute and gradient-reduction dtypes; shards, grads and AdamW state are always fp32."""

    compute: str
    reduce: str


@dataclass(frozen=True)
class Batch:
    micro_batch_size: int
    seq_len: int
    grad_accum_steps: int
    context: int = 1  # parallel.context: each rank holds seq_len / context of every row


@dataclass(frozen=True)
class Checkpointing:
    mode: str
    checkpointed_layers: int
    every: int | None  # selective checkpointing's period; None in the other modes


@dataclass(frozen=True)
class LossPlan:
    kind: str  # the resolved loss.kind
    chunk_tokens: int | None  # a fused loss's tokens per chunk; None: the model's own loss


@dataclass(frozen=True)
class HostPlan:
    """Host RAM per rank, in bytes, of the chosen strategy, the process's own memory left out:
    to load (model.loading's route; rank 0's whole-model route beside it), to export
    (checkpoint.export_hf: rank 0 writes, the others take part in each gather), and to hold
    the model state where it lives on the host (hardware=cpu, or offload=cpu)."""

    loading: str  # model.loading
    load: int  # per rank: its shards on the host (if they live there) + one tensor's read (a
    # pretrained model) or one unit's draw (a random init)
    load_rank0: int  # rank 0 on model.loading=rank0: the whole model in fp32, then its shards
    export_writer: int  # rank 0 while exporting: one tensor group whole, twice (gathered, written)
    export_other: int  # another rank: one tensor whole where the gather lands on the host
    state: int  # params + grads + optimizer state on the host (0 where they are on a device)
    nproc_per_node: int

    @property
    def load_peak(self) -> int:
        return self.load if self.loading == "per_rank" else self.load_rank0

    @property
    def per_node(self) -> int:
        """A node's ranks together at their largest: rank 0's route and state, and the rest."""
        first = max(self.load_peak, self.export_writer, self.state)
        other = max(self.load, self.export_other, self.state)
        return first + (self.nproc_per_node - 1) * other


@dataclass(frozen=True)
class Plan:
    """A run's plan: its ranks and model, and every strategy's figures side by side."""

    world_size: int
    num_nodes: int
    nproc_per_node: int
    device: str
    model_class: str
    num_params: int
    trainable_params: int
    finetune: str
    vocab_size: int
    vocab_source: str
    units: Units
    dtypes: Dtypes
    loss: LossPlan
    batch: Batch
    activation_checkpointing: Checkpointing
    activations_by_checkpointing: dict[str, int]  # "none" and "full"
    offload: str
    compile: bool
    chosen: str  # the configured strategy's name
    strategies: dict[str, StrategyPlan | Unavailable]  # every strategy, by name
    assumptions: list[str]
    not_counted: list[str]
    host: HostPlan | None = None
    time_device: str | None = None  # the device the step times are predicted on

    @property
    def chosen_plan(self) -> StrategyPlan:
        """The configured strategy's figures (always available: planning it fails otherwise)."""
        chosen = self.strategies[self.chosen]
        if not isinstance(chosen, StrategyPlan):
            raise RuntimeError(f"the chosen strategy {self.chosen} has no plan")
        return chosen

    def to_json(self) -> dict:
        """Plain data, as `fsdp-lab plan --json` prints it."""
        plain = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("units", "loss", "batch", "activation_checkpointing"):
            plain[name] = dataclasses.asdict(plain[name])
        plain["dtypes"] = {
            "params": "fp32",
            "grads": "fp32",
            "optimizer": "fp32",
            **dataclasses.asdict(self.dtypes),
        }
        plain["strategies"] = {k: s.to_json() for k, s in self.strategies.items()}
        if self.host is not None:
            plain["host"] = {
                **dataclasses.asdict(self.host),
                "load_peak": self.host.load_peak,
                "per_node": self.host.per_node,
            }
        return plain


def _size(nbytes: int, unit: int) -> str:
    return f"{nbytes / unit:.2f}" if unit == 2**30 else f"{nbytes / unit:.1f}"


def format_plan(plan: Plan) -> str:
    """The plan for a reader: a header, one row per strategy (rank 0, the largest), notes."""
    rows = [s for s in plan.strategies.values() if isinstance(s, StrategyPlan)]
    biggest = max(max(s.peak, s.zero_paper.state.total) for s in rows)
    unit, unit_name = (2**30, "GiB") if biggest >= 10 * 2**30 else (2**20, "MiB")
    lines = _header_lines(plan, unit, unit_name) + _strategy_lines(plan, unit, unit_name)
    if plan.host is not None:
        lines += ["", *_host_lines(plan.host, unit, unit_name)]
    if plan.time_device is not None:
        lines += ["", *time_lines(plan)]
    return "\n".join(lines + _note_lines(plan))


def time_lines(plan: Plan) -> list[str]:
    """The predicted step of each strategy on the plan's device, split into compute, exposed
    communication, optimizer and other (shares of the step)."""
    lines = [
        f"step time on {plan.time_device} (predicted: fsdp_lab.planning.time_model)",
        f"  {'strategy':<13} {TIME_HEADER}",
    ]
    for name, s in plan.strategies.items():
        if isinstance(s, StrategyPlan) and s.time is not None:
            mark = "*" if name == plan.chosen else " "
            lines.append(f"{mark} {name:<13} {s.time.cells()}")
    return lines


def _header_lines(plan: Plan, unit: int, unit_name: str) -> list[str]:
    """What runs: the model, ranks, mesh, units, dtypes, batch, loss, checkpointing."""
    chosen = plan.chosen_plan
    d, bt, ac = plan.dtypes, plan.batch, plan.activation_checkpointing
    acts = plan.activations_by_checkpointing
    return [
        f"{plan.model_class}: {plan.num_params:,} parameters, vocabulary "
        f"{plan.vocab_size:,} (from {plan.vocab_source})",
        *(
            [
                f"finetune   {plan.finetune}: {plan.trainable_params:,} trainable "
                f"({100 * plan.trainable_params / plan.num_params:.2f}%); frozen "
                "parameters hold no gradient and no optimizer state"
            ]
            if plan.trainable_params != plan.num_params
            else []
        ),
        f"ranks      {plan.world_size} = {plan.num_nodes} node(s) x "
        f"{plan.nproc_per_node} ({plan.device})",
        f"mesh       {_mesh(chosen.mesh)} {chosen.mesh_axes}, reshard_after_forward="
        f"{chosen.reshard_after_forward} (sharding={plan.chosen})",
        f"units      {plan.units.description} ({plan.units.count} FSDP units)",
        f"dtypes     sharded params, grads, AdamW state: fp32; compute {d.compute}, "
        f"gradient reduction {d.reduce}",
        f"batch      {bt.micro_batch_size} x {bt.seq_len} tokens per micro-batch per "
        f"rank, {bt.grad_accum_steps} micro-batch(es) per step"
        + (
            f"; context parallel: each rank holds {bt.seq_len // bt.context} tokens of a "
            f"row and gathers each layer's keys and values over {bt.context} ranks"
            if bt.context > 1
            else ""
        ),
        f"loss       {plan.loss.kind}"
        + (
            f" ({min(plan.loss.chunk_tokens, bt.micro_batch_size * bt.seq_len):,} "
            "tokens per chunk: no B x T x V logits)"
            if plan.loss.chunk_tokens
            else " (B x T x V logits, upcast to fp32)"
        ),
        f"checkpoint activation_checkpointing={ac.mode} ({ac.checkpointed_layers} layers); "
        f"activations {_size(acts['none'], unit)} {unit_name} without, "
        f"{_size(acts['full'], unit)} {unit_name} with full checkpointing",
    ]


def _strategy_lines(plan: Plan, unit: int, unit_name: str) -> list[str]:
    """The table: one row per strategy, the chosen one marked."""
    chosen, counted = plan.strategies.get(plan.chosen), "rank 0"
    if isinstance(chosen, StrategyPlan) and chosen.parts:  # a pipeline: its heaviest stage
        counted = f"rank {chosen.counted}: the pipeline stage with the highest peak"
    lines = [
        "",
        f"per rank, {unit_name} ({counted}; others hold the same or less)",
        f"  {'strategy':<13} {'mesh':<9} {'params':>8} {'grads':>8} {'optim':>8} {'activ':>8} "
        f"{'transient':>9} {'peak':>8}   ZeRO paper",
    ]
    for name, s in plan.strategies.items():
        mark = "*" if name == plan.chosen else " "
        if isinstance(s, Unavailable):
            lines.append(f"{mark} {name:<13} n/a: {s.reason}")
            continue
        r, z = s.rank0, s.zero_paper
        cells = [
            r.params + r.padding // 2,
            r.grads + r.padding // 2,
            r.optimizer,
            s.activations,
            s.transient.total,
            s.peak,
        ]
        lines.append(
            f"{mark} {name:<13} {_mesh(s.mesh):<9} "
            + " ".join(f"{_size(c, unit):>{9 if i == 4 else 8}}" for i, c in enumerate(cells))
            + f"   {_size(z.state.total, unit):>7} (stage {z.stage}, N={z.dp_size})"
        )
    return lines


def _note_lines(plan: Plan) -> list[str]:
    """What the columns mean, where the state lives, the ZeRO paper's figures, assumptions,
    and what is not counted."""
    chosen = plan.chosen_plan
    notes = [
        "params/grads: fp32 shards (FSDP2 pads each to chunk 0's size; counted here); optim: "
        "AdamW exp_avg + exp_avg_sq + step; activ: saved for backward per micro-batch; "
        "transient: gathered params and gradient buffers of the working units, autograd's "
        "working memory in backward; peak = params + optim + max(activ + transient, the root's "
        "gradients and reduce-scatter at the end of backward, grads).",
        f"Model state lives on: {chosen.state_location}"
        + (
            "; the peak is the device's: activations and transient."
            if plan.offload == "cpu"
            else "."
        ),
        "ZeRO paper: mixed-precision Adam, 2+2+12 bytes per parameter, divided by the shard group "
        "N per stage. FSDP2 keeps 4+4+8 (fp32 shards are the master weights), the same 16 bytes. "
        "Its grad_op differs from the paper's stage 2: at rest it holds full's sharded state; "
        "the unsharded params (compute dtype) stay alive from forward to backward instead, "
        "counted as transient (no_shard too keeps a gathered copy from forward to backward).",
        *[f"Assumed: {a}" for a in plan.assumptions],
    ]
    lines = [""] + [textwrap.fill(n, 100, subsequent_indent="  ") for n in notes]
    return (
        lines
        + ["not counted:"]
        + [
            textwrap.fill(n, 100, initial_indent="  - ", subsequent_indent="    ")
            for n in plan.not_counted
        ]
    )


def _mesh(shape: tuple[int, ...]) -> str:
    return "(" + ",".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _host_lines(h: HostPlan, unit: int, unit_name: str) -> list[str]:
    """The host RAM lines (the process's own memory besides)."""

    def size(n: int) -> str:
        return f"{_size(n, unit)} {unit_name}"

    route = (
        f"load {size(h.load)} (its shards and one tensor's read or one unit's draw; "
        f"model.loading=rank0: rank 0 "
        f"{size(h.load_rank0)}, the whole model in fp32)"
        if h.loading == "per_rank"
        else f"load {size(h.load_rank0)} on rank 0 (model.loading=rank0: the whole model in "
        f"fp32), {size(h.load)} a rank on per_rank"
    )
    rows = [
        route,
        f"export {size(h.export_writer)} on rank 0 (one tensor group whole), "
        f"{size(h.export_other)} on the others; model state on the host {size(h.state)}",
        f"per node ({h.nproc_per_node} ranks): {size(h.per_node)}",
    ]
    return ["host RAM per rank, besides the process's own"] + [
        textwrap.fill(r, 100, initial_indent="  ", subsequent_indent="    ") for r in rows
    ]
