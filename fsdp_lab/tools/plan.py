"""`fsdp-lab plan`: what a run will do and what it will cost per rank, before it runs.

    fsdp-lab plan                                           # the defaults: 2 CPU ranks, full
    fsdp-lab plan sharding=hybrid hardware.nproc_per_node=4 precision=bf16
    fsdp-lab plan hardware=gpu hardware.num_nodes=16 hardware.nproc_per_node=8 model=local ...
    fsdp-lab plan --json ...                                # the same figures, in bytes

The config is composed and validated as train.py does it, the model is built on the meta device
(no weights, no device, no process group), and the mesh, the FSDP units and the per-rank memory
of the chosen strategy and of all five side by side are computed from its shapes by
``fsdp_lab.tools.memory``, next to the ZeRO paper's figures.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_lab.config import (
    ActivationCheckpointingMode,
    Config,
    ConfigError,
    HardwareKind,
    OffloadDevice,
    ShardingStrategy,
    register_schema,
    to_typed,
)
from fsdp_lab.config.losses import loss_of
from fsdp_lab.config.rules import validate
from fsdp_lab.config.strategies import reshard_after_forward, strategy_of
from fsdp_lab.config.topology import Topology, mesh_axes, mesh_shape
from fsdp_lab.tools import activation_memory, memory
from fsdp_lab.tools.plan_result import (
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


def compose(overrides: list[str]) -> Config:
    """The typed config train.py would run (single-field rules checked); no run dir is made."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_schema()
    conf = Path(__file__).resolve().parents[2] / "conf"  # fsdp_lab/tools/plan.py
    try:
        with initialize_config_dir(config_dir=str(conf), version_base="1.3", job_name="plan"):
            composed = hydra_compose(config_name="config", overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(str(e).strip().splitlines()[0]) from e
    return to_typed(composed)


def topology(cfg: Config) -> tuple[Topology, list[str]]:
    """The ranks the overrides describe, on any machine: num_nodes x nproc_per_node."""
    from fsdp_lab.engine import hardware

    h, notes = cfg.hardware, []
    if h.kind is HardwareKind.tpu:
        raise ConfigError(
            "fsdp-lab plan models FSDP2 on cpu/gpu; on hardware=tpu the XLA "
            "compiler lays out buffers: plan the same run with hardware=gpu"
        )
    kind = HardwareKind.cpu if h.kind is HardwareKind.cpu else HardwareKind.gpu
    if h.kind is HardwareKind.auto:
        kind = hardware.resolve_kind(h)
        notes.append(
            f"hardware=auto is {kind.name} on this machine (CUDA "
            f"{'available' if kind is HardwareKind.gpu else 'not available'}); "
            "plan another with hardware=gpu or hardware=cpu"
        )
    nproc = h.nproc_per_node
    if nproc is None:
        nproc = hardware.default_nproc_per_node(kind)
        if kind is HardwareKind.gpu and nproc == 0:  # no GPU visible here
            nproc = ASSUMED_GPUS_PER_NODE
            notes.append(
                f"hardware.nproc_per_node=null: no GPU visible here, assumed "
                f"{nproc} per node; set it to plan another count"
            )
    return Topology(
        world_size=h.num_nodes * nproc, nproc_per_node=nproc, num_nodes=h.num_nodes, device=kind
    ), notes


@dataclass
class ModelShape:
    """What the plan needs from the model, read off its meta-device build."""

    model_class: str
    units: str  # wrap.summarize_units's line
    num_units: int  # the root included
    unit_classes: dict[str, int]
    params: list[memory.ParamShape]  # as a rank holds them before FSDP (TP-split ones: its part)
    total_params: int  # the model's, whole
    trainable_params: int  # total_params unless finetune freezes some or adds adapters
    layer: activation_memory.LayerShape
    num_checkpointed: int  # decoder layers under activation checkpointing
    last_checkpointed: bool  # the last layer among them (its recomputation adds to the peak)
    vocab_source: str
    loss: str  # the resolved loss.kind
    loss_chunk: int | None  # tokens per chunk of a fused loss; None: the model's own loss
    largest_converted: int = 0  # elements of the largest tensor transformers builds from several
    notes: list[str] = field(default_factory=list)


def _tensor_parallel_shapes(model, parallel) -> dict[int, tuple[int, int]]:
    """What a rank keeps of each TP-split parameter before FSDP shards it on the data-parallel
    ranks: (elements, rows). A colwise layer keeps 1/tensor of its rows (weight and bias), a
    rowwise one 1/tensor of its columns (its bias stays whole)."""
    if parallel.tensor == 1:
        return {}
    from fsdp_lab.engine import tensor_parallel

    tp, out = parallel.tensor, {}
    for split in tensor_parallel.splits(model, tensor_parallel.check(model, parallel)):
        w, bias = split.module.weight, split.module.bias
        if split.splits_output:
            out[id(w)] = (w.numel() // tp, w.shape[0] // tp)
            if bias is not None:
                out[id(bias)] = (bias.numel() // tp, bias.shape[0] // tp)
        else:
            out[id(w)] = (w.numel() // tp, w.shape[0])
    return out


def _expert_dim1s(model) -> dict[int, tuple[int, ...]]:
    """id(expert parameter) -> the dim-1 sizes of its experts module's parameters (the MoE
    layers' fused experts, which parallel.expert splits)."""
    from fsdp_lab.engine.moe import moe_blocks

    out = {}
    for block in moe_blocks(model):
        dims = tuple(q.shape[1] for q in block.experts.parameters())
        out.update({id(q): dims for q in block.experts.parameters()})
    return out


# Long: every fact the plan reads off the meta model, gathered in one pass.
def inspect_model(cfg: Config, device: HardwareKind) -> ModelShape:
    """Vocabulary, meta model, FSDP units, the owner unit of every parameter, and the loss."""
    from fsdp_lab.data import corpus
    from fsdp_lab.engine import activations, finetune, wrap
    from fsdp_lab.engine import model as model_lib
    from fsdp_lab.train import loss as loss_lib

    tokenizer = corpus.load_tokenizer(cfg)
    model_cfg = model_lib.resolve_vocab_size(cfg.model, tokenizer)
    vocab_source = (
        "model.vocab_size"
        if cfg.model.vocab_size is not None
        else "the model's config"
        if cfg.model.arch is None
        else f"the tokenizer ({type(tokenizer).__name__})"
        if tokenizer is not None
        else "synthetic data (256)"
    )
    hf_config = model_lib.build_hf_config(model_cfg)
    model_lib.check_task(hf_config, cfg.model.task)
    model_lib.check_seq_len(hf_config, cfg.trainer.seq_len)
    model = model_lib.model_on_meta(hf_config, cfg.model.task, cfg.finetune)
    loss = loss_lib.resolve_loss(cfg.loss, hf_config, cfg.model.task, device, compiled=cfg.compile)
    units = wrap.select_units(model, cfg.wrap)
    owner: dict[int, int] = {}
    for index in reversed(range(len(units))):  # bottom-up, as fsdp.apply_fsdp shards them
        for p in units[index].parameters():
            owner.setdefault(id(p), index)
    split = _tensor_parallel_shapes(model, cfg.parallel)  # id(param) -> (numel, dim0) on tp
    tp_note = (
        [
            f"parallel.tensor={cfg.parallel.tensor}: model state is exact per rank; a layer's "
            "saved activations are split as TP splits them (attention and MLP; the norms too "
            "with sequence parallelism), the head's and the transients are counted whole"
        ]
        if split
        else []
    )
    experts = _expert_dim1s(model)
    params = [
        memory.ParamShape(
            numel=split.get(id(p), (p.numel(), 0))[0],
            dim0=split.get(id(p), (0, p.shape[0] if p.ndim else 1))[1],
            group=owner.get(id(p), -1),
            trainable=p.requires_grad,
            expert_dim1=p.shape[1] if id(p) in experts else 0,
            module_dim1s=experts.get(id(p), ()),
        )
        for p in model.parameters()
    ]
    layer, notes = activation_memory.layer_shape(hf_config, cfg.model.task)
    if any(not q.trainable for q in params):
        notes.append(
            f"finetune={cfg.finetune.method.name}: activations are counted as for full "
            "training, an upper bound (a frozen linear layer saves no input for backward; LoRA "
            "adds its adapters' small inputs)"
        )
    loss_row = loss_of(loss)
    if loss_row.memory_as is not None:
        notes.append(
            f"loss={loss.name}: its working memory is estimated as loss={loss_row.memory_as.name}'s"
        )
    layers = finetune.blocks(model)
    layer_ids = {id(m) for m in layers}
    chosen = activations.checkpointed_indices(cfg.activation_checkpointing, len(units))
    if any(id(units[i]) not in layer_ids for i in chosen):
        notes.append(
            "activation checkpointing of units that are not decoder layers is not "
            "modelled (use wrap=transformer for an estimate)"
        )
    classes: dict[str, int] = {}
    for u in units:
        classes[type(u).__name__] = classes.get(type(u).__name__, 0) + 1
    last = layers[-1] if layers else None
    return ModelShape(
        model_class=type(model).__name__,
        units=wrap.summarize_units(model, units),
        num_units=len(units) + 1,
        unit_classes=classes,
        params=params,
        total_params=sum(p.numel() for p in model.parameters()),
        trainable_params=finetune.counts(model)[0],
        layer=layer,
        num_checkpointed=sum(id(units[i]) in layer_ids for i in chosen),
        last_checkpointed=any(units[i] is last for i in chosen),
        vocab_source=vocab_source,
        loss=loss.name,
        loss_chunk=loss_lib.tokens_per_chunk(cfg.loss, layer.vocab) if loss_row.fused else None,
        largest_converted=_largest_converted(model),
        notes=notes + tp_note,
    )


def _largest_converted(model) -> int:
    """Elements of the largest model tensor its checkpoint holds in other tensors (a Mixtral's
    fused experts, one file tensor per expert): read whole on every rank, then sliced."""
    from fsdp_lab.engine import conversion

    plain = conversion.plain_meta(model)
    sd = plain.state_dict()
    largest = 0
    for keys, save in conversion.plan_saving(plain, sd):
        if list(save({k: sd[k] for k in keys})) != keys:
            largest = max(largest, *(sd[k].numel() for k in keys))
    return largest


def host_plan(cfg: Config, topo: Topology, facts: ModelShape, chosen: StrategyPlan) -> HostPlan:
    """Host RAM per rank to load, export and hold the state (``HostPlan``), of the chosen
    strategy's rank 0 (never smaller than another's)."""
    fp32 = 4
    on_host = topo.device is HardwareKind.cpu or cfg.offload.device is OffloadDevice.cpu
    r = chosen.rank0
    shards = r.params + r.padding // 2 if on_host else 0
    shard_ways = max(1, chosen.mesh[-1] if cfg.parallel.tensor == 1 else chosen.mesh[-2])
    largest = max((q.numel for q in facts.params), default=0)
    if cfg.model.pretrained:  # one tensor's slice (a converted one whole), as stored and in fp32
        read = 2 * fp32 * max(-(-largest // shard_ways), facts.largest_converted)
    else:  # a random init draws one unit's tensors whole (a block, or the root's)
        units: dict[int, int] = {}
        for q in facts.params:
            units[q.group] = units.get(q.group, 0) + q.numel
        read = fp32 * max(units.values(), default=0)
    whole = facts.total_params * fp32
    gathered_on_host = topo.device is HardwareKind.cpu  # on a GPU the gather lands on it
    return HostPlan(
        loading=cfg.model.loading.name,
        load=shards + read,
        load_rank0=whole + fp32 * largest + shards,
        export_writer=shards + 2 * fp32 * largest,
        export_other=shards + (2 * fp32 * largest if gathered_on_host else 0),
        state=r.total if on_host else 0,
        nproc_per_node=topo.nproc_per_node,
    )


# Long: one strategy's figures, each a few lines of memory's arithmetic.
def strategy_plan(
    cfg: Config, topo: Topology, facts: ModelShape, strategy: ShardingStrategy
) -> StrategyPlan | Unavailable:
    """One strategy's figures in bytes per rank, or why this topology cannot run it."""
    from fsdp_lab.engine.hardware import TORCH_DTYPES

    s = cfg.sharding
    chosen = strategy is s.strategy
    row = strategy_of(strategy)
    hybrid = row.has_replica_groups
    variant = dataclasses.replace(
        s,
        strategy=strategy,
        replicate_size=s.replicate_size if hybrid else None,
        reshard_after_forward=s.reshard_after_forward if chosen else None,
    )
    try:
        validate(dataclasses.replace(cfg, sharding=variant), topo)
    except ConfigError as e:
        if chosen:
            raise
        return Unavailable(reason=str(e))
    tp = cfg.parallel.tensor
    mesh = mesh_shape(variant, topo, tp)
    dp_mesh = mesh[:-1] if tp > 1 else mesh  # FSDP shards over these; a TP group repeats
    reshard = reshard_after_forward(variant)
    p = cfg.precision
    b, rb = TORCH_DTYPES[p.param_dtype].itemsize, TORCH_DTYPES[p.reduce_dtype].itemsize
    ep = cfg.parallel.expert
    by_dp_rank = memory.per_rank_state(facts.params, dp_mesh, ep=ep)
    per_rank = [by_dp_rank[r // tp] for r in range(topo.world_size)]  # TP innermost
    t = cfg.trainer
    act = activation_memory.activations(
        facts.layer,
        batch=t.micro_batch_size,
        seq_len=t.seq_len,
        b=b,
        num_checkpointed=facts.num_checkpointed,
        last_checkpointed=facts.last_checkpointed,
        loss_chunk=facts.loss_chunk,
        tensor=cfg.parallel.tensor,
        sequence_parallel=cfg.parallel.sequence_parallel,
        cpu_kernels=topo.device is HardwareKind.cpu,
    )
    trans = memory.transient(
        memory.group_numels(facts.params, dp_mesh[-1], ep=ep),
        grad_groups=memory.group_numels(facts.params, dp_mesh[-1], trainable_only=True, ep=ep),
        reshard=reshard,
        param_bytes=b,
        reduce_bytes=rb,
        grad_accum_steps=t.grad_accum_steps,
        backward=act.backward,
        shard_size=dp_mesh[-1],
        tied_grads=memory.tied_grad_bytes(facts.layer, b, fused_loss=facts.loss_chunk is not None),
        held_grads=memory.last_grad_numel(facts.params, -1),
        gloo=topo.device is HardwareKind.cpu,
    )
    offload = cfg.offload.device is OffloadDevice.cpu
    on_device = not (offload and topo.device is HardwareKind.gpu)
    top = per_rank[0]  # chunk 0 is never smaller than another rank's
    paper = memory.zero_paper(
        sum(q.numel for q in facts.params),
        stage=row.zero_stage,
        dp_size=dp_mesh[-1],
        trainable=sum(q.numel for q in facts.params if q.trainable),
    )
    return StrategyPlan(
        mesh=tuple(mesh),
        mesh_axes=tuple(mesh_axes(variant, tp)),
        reshard_after_forward=reshard,
        state_location=(
            "host (offload=cpu)"
            if offload
            else "host"
            if topo.device is HardwareKind.cpu
            else "device"
        ),
        per_rank=per_rank,
        activations=act.saved,
        transient=trans,
        peak=memory.peak(
            top,
            activations=act.saved,
            transient_bytes=trans.total,
            end_of_backward=trans.end_of_backward,
            reduced_grads=trans.reduced_grads,
            state_on_device=on_device,
        ),
        zero_paper=ZeroPaper(stage=row.zero_stage, dp_size=dp_mesh[-1], state=paper),
    )


def _activations_by_checkpointing(cfg: Config, topo: Topology, facts: ModelShape) -> dict:
    """Saved activations per micro-batch without and with full activation checkpointing."""
    from fsdp_lab.engine.hardware import TORCH_DTYPES

    t = cfg.trainer
    return {
        name: activation_memory.activations(
            facts.layer,
            batch=t.micro_batch_size,
            seq_len=t.seq_len,
            b=TORCH_DTYPES[cfg.precision.param_dtype].itemsize,
            num_checkpointed=n,
            loss_chunk=facts.loss_chunk,
            tensor=cfg.parallel.tensor,
            sequence_parallel=cfg.parallel.sequence_parallel,
            cpu_kernels=topo.device is HardwareKind.cpu,
        ).saved
        for name, n in (("none", 0), ("full", facts.layer.num_layers))
    }


def build_plan(overrides: list[str]) -> Plan:
    """Every figure of the plan (bytes per rank)."""
    cfg = compose(overrides)
    topo, notes = topology(cfg)
    validate(cfg, topo)
    facts = inspect_model(cfg, topo.device)
    t, p, layer = cfg.trainer, cfg.precision, facts.layer
    strategies = {s.name: strategy_plan(cfg, topo, facts, s) for s in ShardingStrategy}
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
    )


def print_plan(overrides: list[str], *, as_json: bool = False) -> None:
    plan = build_plan(overrides)
    print(json.dumps(plan.to_json(), indent=2) if as_json else format_plan(plan))
