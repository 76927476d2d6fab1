"""`fsdp-lab plan`: what a run will do and what it will cost per rank, before it runs.

    fsdp-lab plan                                           # the defaults: 2 CPU ranks, full
    fsdp-lab plan sharding=hybrid hardware.nproc_per_node=4 precision=bf16
    fsdp-lab plan hardware=gpu hardware.num_nodes=16 hardware.nproc_per_node=8 model=local ...
    fsdp-lab plan --json ...                                # the same figures, in bytes

The config is composed and validated as train.py does it, the model is built on the meta device
(no weights, no device, no process group), and the mesh, the FSDP units and the per-rank memory
of the chosen strategy and of all five side by side are computed from its shapes by
``fsdp_lab.planning.memory``, next to the ZeRO paper's figures.
"""

from __future__ import annotations

import dataclasses
import json

from fsdp_lab.config import (
    ActivationCheckpointingMode,
    Config,
    ConfigError,
    HardwareConfig,
    Packing,
    ShardingStrategy,
)
from fsdp_lab.config.data_kinds import Rows, kind_row
from fsdp_lab.config.device_rows import device_profile, named_devices, setting
from fsdp_lab.config.hardware_kinds import HARDWARE, hardware_row, plannable
from fsdp_lab.config.hardware_profiles import DeviceProfile
from fsdp_lab.config.load import compose
from fsdp_lab.config.pipeline import PIPELINE_AXIS
from fsdp_lab.config.precisions import dtype_row
from fsdp_lab.config.rules import validate
from fsdp_lab.config.sharding import offloaded
from fsdp_lab.config.strategies import reshard_after_forward, strategy_of
from fsdp_lab.config.topology import (
    Topology,
    fsdp_mesh_shape,
    mesh_axes,
    mesh_shape,
    stage_topology,
)
from fsdp_lab.engine.hardware import devices
from fsdp_lab.planning import activation_memory, machine, memory, plan_pipeline, plan_time
from fsdp_lab.planning.plan_model import ModelShape, inspect_model
from fsdp_lab.planning.plan_result import (
    Batch,
    Checkpointing,
    Dtypes,
    HostPlan,
    LossPlan,
    Plan,
    StrategyPlan,
    Unavailable,
    Units,
    ZeroPaper,
    format_plan,
)

ASSUMED_GPUS_PER_NODE = 8
NOT_COUNTED = [
    "the process itself: the CUDA context and NCCL communicators on a GPU (often 0.5-2 GiB), the "
    "interpreter and imports on a CPU rank (measured: ~355 MiB of RSS before the first step "
    "besides the model's shards, and 8-25 MiB more over the steps that is not tensors)",
    "allocator caching and fragmentation (the CUDA caching allocator reserves more than it "
    "allocates; glibc keeps freed heap pages)",
    "temporaries inside operations: AdamW's and clip_grad_norm_'s intermediates, FSDP2's "
    "all-gather input copies, gloo's all-gather staging copy (a unit's unsharded size while it "
    "runs), matmul workspaces",
    "attention other than sdpa/flash: eager attention also saves the seq x seq scores (sdpa's "
    "math path, which attention dropout takes on CPU, is counted)",
    "torch.compile (compile=true): compiled units save less than this eager estimate (measured "
    "on an H100: the 160M recipe peaked at 10.5 GiB, 0.76x this plan's 13.8)",
    "evaluation (no_grad forwards), checkpoint saving (DCP staging, async_save's host copy), the "
    "data loader, and small buffers (rotary inv_freq, position ids)",
]


def topology(cfg: Config) -> tuple[Topology, list[str]]:
    """The ranks the overrides describe, on any machine: num_nodes x nproc_per_node."""

    h, notes = cfg.hardware, []
    kind = h.kind if h.kind in HARDWARE else devices.resolve_kind(h)  # auto: this machine's
    row = hardware_row(kind)
    if row.plan_device is None:
        raise ConfigError(
            f"fsdp-lab plan models FSDP2 on {'/'.join(plannable())}; on hardware={kind.name} "
            f"the {row.engine.name} engine's compiler lays out buffers: plan the same run with "
            f"{' or '.join(f'hardware={k}' for k in plannable())}"
        )
    if kind is not h.kind:  # auto
        notes.append(
            f"hardware={h.kind.name} is {kind.name} on this machine (CUDA "
            f"{'not available' if row.host else 'available'}); "
            f"plan another with hardware={' or hardware='.join(plannable())}"
        )
    nproc = h.nproc_per_node
    if nproc is None:
        nproc = devices.default_nproc_per_node(kind)
        if nproc == 0:  # no device of the kind visible here
            nproc = ASSUMED_GPUS_PER_NODE
            notes.append(
                f"hardware.nproc_per_node=null: no GPU visible here, assumed "
                f"{nproc} per node; set it to plan another count"
            )
    return Topology.nodes(nproc, h.num_nodes, kind), notes


def host_plan(cfg: Config, topo: Topology, facts: ModelShape, chosen: StrategyPlan) -> HostPlan:
    """Host RAM per rank to load, export and hold the state (``HostPlan``), of the chosen
    strategy's rank 0 (never smaller than another's)."""
    fp32 = 4
    host = hardware_row(topo.device).host
    on_host = host or offloaded(cfg.offload)
    r = chosen.rank0
    shards = r.params + r.padding // 2 if on_host else 0
    shard_ways = max(1, chosen.fsdp_mesh[-1])
    largest = max((q.numel for q in facts.params), default=0)
    if cfg.model.pretrained:  # one tensor's slice (a converted one whole), as stored and in fp32
        read = 2 * fp32 * max(-(-largest // shard_ways), facts.largest_converted)
    else:  # a random init draws one unit's tensors whole (a block, or the root's)
        units: dict[int, int] = {}
        for q in facts.params:
            units[q.group] = units.get(q.group, 0) + q.numel
        read = fp32 * max(units.values(), default=0)
    whole = facts.total_params * fp32
    gathered_on_host = host  # on a device the gather lands on it
    return HostPlan(
        loading=cfg.model.loading.name,
        load=shards + read,
        load_rank0=whole + fp32 * largest + shards,
        export_writer=shards + 2 * fp32 * largest,
        export_other=shards + (2 * fp32 * largest if gathered_on_host else 0),
        state=r.total if on_host else 0,
        nproc_per_node=topo.nproc_per_node,
    )


def strategy_plan(
    cfg: Config, topo: Topology, facts: ModelShape, strategy: ShardingStrategy
) -> StrategyPlan | Unavailable:
    """One strategy's figures in bytes per rank, or why this topology cannot run it."""
    s = cfg.sharding
    chosen = strategy is s.strategy
    row = strategy_of(strategy)
    variant = dataclasses.replace(
        s,
        strategy=strategy,
        replicate_size=s.replicate_size if row.has_replica_groups else None,
        reshard_after_forward=s.reshard_after_forward if chosen else None,
    )
    try:
        validate(dataclasses.replace(cfg, sharding=variant), topo)
    except ConfigError as e:
        if chosen:
            raise
        return Unavailable(reason=str(e))
    tp, cp, pp = cfg.parallel.tensor, cfg.parallel.context, cfg.parallel.pipeline
    topo = stage_topology(topo, pp)  # a pipeline's stage: the strategy runs within it
    mesh = mesh_shape(variant, topo, tp, context=cp)
    # FSDP shards over these (a CP group too); a TP group repeats, innermost
    dp_mesh = fsdp_mesh_shape(variant, topo, tp, context=cp)
    by_dp_rank = memory.per_rank_state(facts.params, dp_mesh, ep=cfg.parallel.expert)
    per_rank = [by_dp_rank[r // tp] for r in range(topo.world_size)]
    reshard = reshard_after_forward(variant)
    act, trans = _working_set(cfg, topo, facts, dp_mesh[-1], reshard)
    offload = offloaded(cfg.offload)
    host = hardware_row(topo.device).host
    paper = memory.zero_paper(
        sum(q.numel for q in facts.params),
        stage=row.zero_stage,
        dp_size=dp_mesh[-1],
        trainable=sum(q.numel for q in facts.params if q.trainable),
    )
    axes = mesh_axes(variant, tp, context=cp)
    if pp > 1:
        mesh, axes = (pp, *mesh), (PIPELINE_AXIS, *axes)
    return StrategyPlan(
        mesh=tuple(mesh),
        mesh_axes=tuple(axes),
        fsdp_mesh=tuple(dp_mesh),
        reshard_after_forward=reshard,
        state_location="host (offload=cpu)" if offload else "host" if host else "device",
        per_rank=per_rank,
        activations=act.saved,
        transient=trans,
        peak=memory.peak(
            per_rank[0],  # chunk 0 is never smaller than another rank's
            activations=act.saved,
            transient_bytes=trans.total,
            end_of_backward=trans.end_of_backward,
            reduced_grads=trans.reduced_grads,
            state_on_device=not (offload and not host),
        ),
        zero_paper=ZeroPaper(stage=row.zero_stage, dp_size=dp_mesh[-1], state=paper),
    )


def timed(cfg: Config, topo: Topology, facts: ModelShape, strategy, profile: DeviceProfile):
    """``strategy``'s plan with its step time on ``profile`` (or why it is unavailable)."""
    row = strategy_plan(cfg, topo, facts, strategy)
    if isinstance(row, StrategyPlan):
        step = plan_time.predict_step(cfg, topo, facts, row, strategy, profile)
        row = dataclasses.replace(row, time=step)
    return row


def _working_set(cfg: Config, topo: Topology, facts: ModelShape, shard: int, reshard):
    """(activations, transients) of a step on one rank: what autograd saves, and FSDP2's
    gathered units and gradient buffers on a shard axis of ``shard`` ranks."""

    p, t, ep = cfg.precision, cfg.trainer, cfg.parallel.expert
    b, rb = dtype_row(p.param_dtype).bytes, dtype_row(p.reduce_dtype).bytes
    act = activation_memory.activations(
        facts.layer,
        rank_batch(cfg, topo, facts.layer),
        num_checkpointed=facts.num_checkpointed,
        last_checkpointed=facts.last_checkpointed,
        loss_chunk=facts.loss_chunk,
        op=cfg.activation_checkpointing.mode is ActivationCheckpointingMode.op,
    )
    if facts.pipeline is not None:
        act = plan_pipeline.activations(act, facts.pipeline)
    trans = memory.transient(
        memory.group_numels(facts.params, shard, ep=ep, param_bytes=b),
        memory.Reduction(b, rb, shard_size=shard, gloo=not hardware_row(topo.device).nccl),
        grad_groups=memory.group_numels(facts.params, shard, trainable_only=True, ep=ep),
        reshard=reshard,
        grad_accum_steps=t.grad_accum_steps,
        backward=act.backward,
        tied_grads=memory.tied_grad_bytes(facts.layer, b, fused_loss=facts.loss_chunk is not None),
        held_grads=memory.last_grad_numel(facts.params, -1),
    )
    return act, trans


def rank_batch(
    cfg: Config, topo: Topology, layer: activation_memory.LayerShape
) -> activation_memory.RankBatch:
    """One rank's micro-batch as the run computes it: its rows and length, the compute
    dtype's bytes, its TP and CP groups' shares, and whether the host's kernels run it."""
    t = cfg.trainer
    return activation_memory.RankBatch(
        batch=t.micro_batch_size,
        seq_len=t.seq_len,
        b=dtype_row(cfg.precision.param_dtype).bytes,
        tensor=cfg.parallel.tensor,
        sequence_parallel=cfg.parallel.sequence_parallel,
        cpu_kernels=hardware_row(topo.device).host,
        context=_context_layout(cfg, topo, layer),
    )


def _context_layout(
    cfg: Config, topo: Topology, layer: activation_memory.LayerShape
) -> activation_memory.ContextLayout | None:
    """A rank of the run's CP group, and whether its forward's masks are tensors in memory:
    rows of several documents (data=chat's packing), a window shorter than the sequence, or a
    causal mask SDPA materialises (CPU; CUDA without flash, i.e. in fp32)."""
    if cfg.parallel.context == 1:
        return None
    rows = kind_row(cfg.data.kind).rows
    packed = rows is Rows.conversations and cfg.data.packing is Packing.documents
    window = layer.sliding_window is not None and layer.sliding_window < cfg.trainer.seq_len
    flash = hardware_row(topo.device).flash_attention
    materialised = not flash or not dtype_row(cfg.precision.param_dtype).half
    return activation_memory.ContextLayout(
        size=cfg.parallel.context,
        dense_masks=packed or window or materialised,
        rows_masked=packed,
    )


def _activations_by_checkpointing(cfg: Config, topo: Topology, facts: ModelShape) -> dict:
    """Saved activations per micro-batch without and with full activation checkpointing."""
    return {
        name: activation_memory.activations(
            facts.layer,
            rank_batch(cfg, topo, facts.layer),
            num_checkpointed=n,
            loss_chunk=facts.loss_chunk,
        ).saved
        for name, n in (("none", 0), ("full", facts.layer.num_layers))
    }


def time_device(
    name: str | None, topo: Topology, cfg: Config | None = None, *, flag: str = "--device"
) -> tuple[DeviceProfile, list[str]]:
    """The device the step is priced on: ``name`` (a named device or a calibrated profile),
    else this machine's measured profile for these ranks where one is cached (``cfg``'s
    ``hardware.profile_cache``), else the cpu row on CPU ranks and an H100 on GPU ones, said
    to be unmeasured; and what that assumes."""

    notes = []
    device = device_profile(name, flag) if name else None
    if device is None and cfg is not None and on_this_machine(topo):
        device = machine.cached(cfg, topo)
    if device is None:
        device = device_profile(hardware_row(topo.device).plan_device)
        notes.append(
            f"unmeasured: step times are priced on the hardware table's {device.name} row, "
            f"not this machine: name the device with {flag.rstrip('=')} "
            f"({', '.join(named_devices())}), or measure this machine with fsdp-lab calibrate "
            "(a run measures it too, after its first run)"
        )
    if device.kind != topo.device.value:
        notes.append(
            f"{setting(flag, device.name)} is a {device.kind}; the run is hardware="
            f"{topo.device.name} (plan it with hardware={device.kind})"
        )
    measured = (device.measured or {}).get("ranks")
    if measured is not None and measured != topo.nproc_per_node:
        notes.append(
            f"the profile was measured with {measured} ranks per node, the plan has "
            f"{topo.nproc_per_node}: on shared cores or links the rates differ; calibrate with "
            f"hardware.nproc_per_node={topo.nproc_per_node}"
        )
    return device, notes


def on_this_machine(topo: Topology) -> bool:
    """Whether the plan is of this machine's own kind of device (a CPU plan here; a GPU plan
    where CUDA is): only then can this machine's profile price it."""
    if hardware_row(topo.device).host:
        return True

    return topo.device is devices.resolve_kind(HardwareConfig())


def build_plan(overrides: list[str], device: str | None = None) -> Plan:
    """Every figure of the plan (bytes per rank), and each strategy's step time on ``device``
    (see ``time_device``)."""
    cfg = compose(overrides)
    topo, notes = topology(cfg)
    validate(cfg, topo)
    facts = inspect_model(cfg, topo.device)
    t, p, layer = cfg.trainer, cfg.precision, facts.layer
    profile, time_notes = time_device(device, topo, cfg)
    notes += time_notes
    stages = plan_pipeline.stage_facts(cfg, topo.device, facts)  # a pipeline: each rank's
    strategies = {
        s.name: plan_pipeline.combined([timed(cfg, topo, f, s, profile) for f in stages])
        for s in ShardingStrategy
    }
    notes += plan_pipeline.notes(stages, strategies[cfg.sharding.strategy.name])
    mode = cfg.activation_checkpointing.mode
    return Plan(
        world_size=topo.world_size,
        num_nodes=topo.num_nodes,
        nproc_per_node=topo.nproc_per_node,
        device=topo.device.name,
        model_class=facts.model_class,
        num_params=facts.total_params,
        trainable_params=facts.trainable_params,
        finetune=cfg.finetune.method.name,
        vocab_size=layer.vocab,
        vocab_source=facts.vocab_source,
        units=Units(description=facts.units, count=facts.num_units, classes=facts.unit_classes),
        dtypes=Dtypes(compute=p.param_dtype.name, reduce=p.reduce_dtype.name),
        loss=LossPlan(kind=facts.loss, chunk_tokens=facts.loss_chunk),
        batch=Batch(
            micro_batch_size=t.micro_batch_size,
            seq_len=t.seq_len,
            grad_accum_steps=t.grad_accum_steps,
            context=cfg.parallel.context,
        ),
        activation_checkpointing=Checkpointing(
            mode=mode.name,
            checkpointed_layers=facts.num_checkpointed,
            every=cfg.activation_checkpointing.every
            if mode is ActivationCheckpointingMode.selective
            else None,
        ),
        activations_by_checkpointing=_activations_by_checkpointing(cfg, topo, facts),
        offload=cfg.offload.device.name,
        compile=cfg.compile,
        chosen=cfg.sharding.strategy.name,
        strategies=strategies,
        assumptions=notes + facts.notes,
        not_counted=NOT_COUNTED,
        host=host_plan(cfg, topo, facts, strategies[cfg.sharding.strategy.name]),
        time_device=profile.name,
    )


def print_plan(overrides: list[str], *, as_json: bool = False, device: str | None = None) -> None:
    plan = build_plan(overrides, device)
    print(json.dumps(plan.to_json(), indent=2) if as_json else format_plan(plan))
