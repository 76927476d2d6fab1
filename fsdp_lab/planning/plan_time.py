"""A planned run's step as the time model's work (``time_model.StepWork``): each FSDP unit's
operators, counted by tracing one micro-batch of the model on the meta device
(``plan_trace``), and its collectives, read off the strategy's mesh; then priced on a device
(``predict_step``).

What the trace leaves to arithmetic here, per micro-batch of ``b x T`` rows on one rank
(``t = b x T / context`` local tokens):

* attention (one fused kernel a call): causal, half the T x T scores, 4 x t x T/2 x q_dim/tp
  FLOPs forward (keys within a sliding window at most), ``ATTENTION_BACKWARD`` times that
  backward; a context-parallel rank's chunks against the keys before them;
* a checkpointed unit runs its forward again in backward; float8 linears run at float8's
  rate with torchao's casts around them; QLoRA's NF4 weights are dequantised each pass;
* FSDP2's copies around each collective, its hooks around each unit, TP's DTensor dispatch.
"""

from __future__ import annotations

import dataclasses

from fsdp_lab.config import (
    ActivationCheckpointingMode,
    Config,
    ExpertsImplementation,
    HardwareKind,
    ShardingStrategy,
)
from fsdp_lab.config.hardware_kinds import hardware_row
from fsdp_lab.config.hardware_profiles import DeviceProfile
from fsdp_lab.config.low_precision import NF4_BITS
from fsdp_lab.config.model import task_row
from fsdp_lab.config.precisions import dtype_row
from fsdp_lab.config.sharding import offloaded
from fsdp_lab.config.topology import Topology
from fsdp_lab.planning import memory, op_count, plan_comm, plan_trace
from fsdp_lab.planning.plan_model import ModelShape
from fsdp_lab.planning.plan_result import StrategyPlan
from fsdp_lab.planning.time_model import (
    BACKWARD,
    FORWARD,
    PassWork,
    StepTime,
    StepWork,
    UnitWork,
    predict,
)

ATTENTION_BACKWARD = 2.5  # flash attention's backward FLOPs over its forward's
COPY_OPS = 2  # FSDP2's copy-in and copy-out around a collective (one foreach op each)
SOURCES = {
    "ATTENTION_BACKWARD": "count: FlashAttention-2's backward runs five GEMMs the size of its "
    "forward's two (Dao 2023, Algorithm 2)",
    "COPY_OPS": "count: FSDP2's foreach_all_gather copy-in and split_with_sizes_copy "
    "copy-out (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py)",
}


def _unit_params(facts: ModelShape) -> dict[int, list[memory.ParamShape]]:
    out: dict[int, list[memory.ParamShape]] = {}
    for p in facts.params:
        out.setdefault(p.group, []).append(p)
    return out


def _grouped(cfg: Config) -> bool:
    """The experts run as grouped GEMMs (transformers' choice picks grouped_mm where torch
    has it); eager loops and batched_mm are priced as dense matmuls, a call an expert."""
    impl = cfg.model.experts_implementation
    return impl in (ExpertsImplementation.auto, ExpertsImplementation.grouped_mm)


def _attention_flops(cfg: Config, layer, device: HardwareKind) -> float:
    """Forward FLOPs of one layer's attention on the busiest rank: QK^T and AV over the keys
    each query sees (causal: half the sequence on average, a window at most; a masked LM's
    encoder: every key, the kernel run without a causal mask). Under context
    parallelism a rank holds chunks r and 2C-1-r of 2C and attends each against the keys
    before it; the first chunk is a square causal block, later ones run with a mask (every
    key computed) except where the GPU applies the lower-right causal bias in place."""
    b, seq, cp = cfg.trainer.micro_batch_size, cfg.trainer.seq_len, cfg.parallel.context
    q_dim = layer.q_dim / cfg.parallel.tensor
    window = layer.sliding_window
    if not task_row(cfg.model.task).causal:  # context parallelism refuses it
        return 4 * b * seq * seq * q_dim
    if cp == 1:
        keys = seq / 2 if window is None else min(seq / 2, window)
        return 4 * b * seq * keys * q_dim
    chunk = seq / (2 * cp)
    in_place = hardware_row(device).flash_attention and dtype_row(cfg.precision.param_dtype).half

    def pairs(rank: int) -> float:
        total = 0.0
        for index in (rank, 2 * cp - 1 - rank):
            before = index * chunk  # keys wholly before the chunk
            if window is not None:
                before = min(before, window)
            if index == 0:
                total += chunk * chunk / 2
            else:
                total += chunk * (before + (chunk / 2 if in_place else chunk))
        return total

    return 4 * b * max(pairs(r) for r in range(cp)) * q_dim


def _copies(nbytes: float) -> tuple[tuple[int, float, float], ...]:
    """FSDP2's copies of ``nbytes`` as the operators that make them."""
    if nbytes <= 0:
        return ()
    return ((op_count.size_bucket(nbytes / COPY_OPS), COPY_OPS, nbytes),)


def _traced(p: op_count.PassTrace, *, compiled: bool, grouped: bool) -> PassWork:
    """A traced pass as the time model's work: eager, each operator by its size class;
    compiled, Inductor's fused regions (views then cost nothing: they are in the graph)."""
    if compiled:
        kernels, nbytes = p.fused_kernels, p.fused_bytes
        op_bytes = ((op_count.size_bucket(nbytes / kernels), kernels, nbytes),) if kernels else ()
        views = 0.0
    else:
        op_bytes = tuple((k, float(p.ops[k]), float(p.op_bytes[k])) for k in sorted(p.ops))
        views = float(p.views)
    flops, calls = p.matmul_flops(), float(sum(p.matmuls.values()))
    grouped_flops = p.grouped_flops()
    if not grouped:  # an eager loop (or batched_mm): dense matmuls, one call an expert
        flops += grouped_flops
        calls += sum(e * c for (e, *_), c in p.grouped.items())
        grouped_flops = 0.0
    return PassWork(
        matmul_flops=flops,
        matmul_calls=calls,
        grouped_flops=grouped_flops,
        op_bytes=op_bytes,
        views=views,
    )


def _with(w: PassWork, **more) -> PassWork:
    """``w`` with more work added: fields summed, ``op_bytes`` entries appended."""
    extra = more.pop("op_bytes", ())
    kept = ("head_dim", "attention_tokens")
    fields = {f: (v if f in kept else getattr(w, f) + v) for f, v in more.items()}
    return PassWork(**{**w.__dict__, **fields, "op_bytes": w.op_bytes + tuple(extra)})


def _low_precision(
    cfg: Config, params: list, t: float, b: int, shard: int
) -> tuple[PassWork, PassWork]:
    """What float8 or NF4 adds to a block's forward and backward, in bytes. A float8 linear
    (torchao's tensorwise recipe) casts each high-precision operand to float8 by its amax: a
    read for the amax, a read and a one-byte write for the cast (2b + 1 bytes an element):
    forward its input and weight (the weight's shard, before the all-gather, with float8
    all-gathers), backward its output gradient; backward also transposes the float8 input and
    weight (a one-byte read and write each). An NF4 weight is dequantised on each pass."""
    fwd = bwd = 0.0
    cast = 2 * b + 1
    gathered_fp8 = cfg.precision.float8_all_gather
    for p in params:
        if p.lookup or p.row <= 1 or p.expert_dim1:
            continue
        inputs, outputs = t * (p.numel // p.row), t * p.row
        if p.storage == "nf4":
            fwd += p.numel * (NF4_BITS / 8 + b)
            bwd += p.numel * (NF4_BITS / 8 + b)
        elif cfg.precision.float8_recipe is not None and p.trainable:
            weight = p.numel / shard if gathered_fp8 else p.numel
            fwd += cast * (inputs + weight)
            bwd += cast * outputs + 2 * (inputs + p.numel)
    entry = lambda n: ((op_count.size_bucket(n), 1.0, n),) if n else ()
    return PassWork(op_bytes=entry(fwd)), PassWork(op_bytes=entry(bwd))


def _units(cfg: Config, topo: Topology, facts: ModelShape, s: StrategyPlan) -> list[UnitWork]:
    """The root's collectives, each block unit, then the root's own compute (embeddings,
    final norm, head and loss): their work per micro-batch."""
    layer, lay = facts.layer, plan_comm.layout(cfg, topo, facts, s)
    tp, cp = cfg.parallel.tensor, cfg.parallel.context
    t = cfg.trainer.micro_batch_size * cfg.trainer.seq_len / cp
    trace = plan_trace.trace_step(
        cfg,
        batch=cfg.trainer.micro_batch_size,
        seq_len=cfg.trainer.seq_len // cp,
        loss=facts.loss,
        vocab=layer.vocab,
        tp=tp,
    )
    by_unit = _unit_params(facts)
    blocks = sorted(g for g in by_unit if g >= 0)
    reshard = s.reshard_after_forward  # the strategy plan resolved it (its default, or the setting)
    attention = _attention_flops(cfg, layer, topo.device) * layer.num_layers
    per_block = attention / len(blocks) if blocks else 0.0
    grouped, compiled = _grouped(cfg), cfg.compile
    last = len(blocks) - 1  # FSDP2 keeps the last block gathered for backward
    regathers = [reshard is not False and i < last for i in range(len(blocks))]
    units = [
        _block(cfg, facts, lay, trace, by_unit[g], g, t, per_block, regather)
        for g, regather in zip(blocks, regathers, strict=True)
    ]
    attn = 0.0 if blocks else attention  # the root the only unit: the layers' are its
    root_f = _traced(trace.of(op_count.ROOT, FORWARD), compiled=compiled, grouped=grouped)
    root_b = _traced(trace.of(op_count.ROOT, BACKWARD), compiled=compiled, grouped=grouped)
    first = UnitWork(
        "root",
        PassWork(op_bytes=_copies(lay.gather_copies(-1))),
        PassWork(),
        lay.gather(-1),
        False,
        lay.reduce(-1),
        PassWork(op_bytes=_copies(lay.reduce_copies(-1))),
    )
    dim = layer.q_dim // max(1, layer.num_heads)
    head = UnitWork(
        "head",
        _with(
            root_f,
            attention_flops=attn,
            head_dim=dim,
            attention_tokens=cfg.trainer.seq_len,
        ),
        _with(
            root_b,
            attention_flops=ATTENTION_BACKWARD * attn,
            head_dim=dim,
            attention_tokens=cfg.trainer.seq_len,
        ),
        sharded=False,
    )
    return [first, *units, head]


# Many parameters: the unit, and what the step around it decided for it.
def _block(
    cfg: Config,
    facts: ModelShape,
    lay: plan_comm.Layout,
    trace: plan_trace.StepTrace,
    params: list,
    group: int,
    t: float,
    attn: float,
    regather: bool,
) -> UnitWork:
    """One block unit's work per micro-batch (``attn``: its attention's forward FLOPs)."""
    grouped, compiled = _grouped(cfg), cfg.compile
    fwd = _traced(trace.of(group, FORWARD), compiled=compiled, grouped=grouped)
    bwd = _traced(trace.of(group, BACKWARD), compiled=compiled, grouped=grouped)
    linears = float(sum(1 for p in params if p.tp_linear))
    fp8 = cfg.precision.float8_recipe is not None
    dim = facts.layer.q_dim // max(1, facts.layer.num_heads)
    keys = cfg.trainer.seq_len
    fwd = _with(fwd, attention_flops=attn, tp_linears=linears,
                fp8_flops=fwd.matmul_flops if fp8 else 0.0, head_dim=dim,
                attention_tokens=keys)  # fmt: skip
    bwd = _with(bwd, attention_flops=ATTENTION_BACKWARD * attn,
                tp_linears=2 * linears, fp8_flops=bwd.matmul_flops if fp8 else 0.0,
                head_dim=dim, attention_tokens=keys)  # fmt: skip
    low_f, low_b = _low_precision(cfg, params, t, lay.b, lay.shard)
    fwd, bwd = fwd.plus(low_f), bwd.plus(low_b)
    if group in facts.checkpointed_units:  # recomputed in backward
        bwd = bwd.plus(_recomputed(cfg, fwd, trace.of(group, FORWARD)))
    copies_f = lay.gather_copies(group)
    return UnitWork(
        name=f"unit {group}",
        forward=_with(fwd, op_bytes=_copies(copies_f)),
        backward=_with(bwd, op_bytes=_copies(copies_f if regather else 0.0)),
        gather=lay.gather(group),
        regather=regather,
        reduce=lay.reduce(group),
        reduce_copies=PassWork(op_bytes=_copies(lay.reduce_copies(group))),
        inner=plan_comm.inner_collectives(cfg, facts.layer, t, lay.b, lay.per_node, linears),
    )


def _recomputed(cfg: Config, fwd: PassWork, traced: op_count.PassTrace) -> PassWork:
    """What a checkpointed unit runs again in backward: its forward, or with
    activation_checkpointing=op all but attention and every second matmul (their outputs
    are kept; a mixture of experts' grouped GEMMs run again)."""
    if cfg.activation_checkpointing.mode is not ActivationCheckpointingMode.op:
        return fwd
    # The experts run again whole as grouped GEMMs (the policy keeps none); an eager loop's
    # matmuls join the alternation: every second one runs again.
    eager = 0.0 if _grouped(cfg) else 0.5
    experts = eager * traced.grouped_flops()
    expert_calls = eager * sum(e * c for (e, *_), c in traced.grouped.items())
    return dataclasses.replace(
        fwd,
        matmul_flops=traced.second_flops + experts,
        matmul_calls=traced.second_matmuls + expert_calls,
        fp8_flops=traced.second_flops if fwd.fp8_flops else 0.0,
        attention_flops=0.0,
        tp_linears=fwd.tp_linears / 2,
    )


def step_work(
    cfg: Config, topo: Topology, facts: ModelShape, s: StrategyPlan, strategy: ShardingStrategy
) -> StepWork:
    """The work of one optimizer step on rank 0 of ``strategy``'s plan ``s``."""
    units = _units(cfg, topo, facts, s)
    t, tp, cp = cfg.trainer, cfg.parallel.tensor, cfg.parallel.context
    trainable = s.rank0.grads // memory.FP32
    tensors = sum(1 for q in facts.params if q.trainable)
    offload = offloaded(cfg.offload) and not hardware_row(topo.device).host
    shards = s.rank0.params  # fp32 shards: copied to the device for each gather
    gathers_per_step = t.grad_accum_steps * (1 + (s.reshard_after_forward is not False))
    return StepWork(
        units=tuple(units),
        micro_batches=t.grad_accum_steps,
        tokens=t.micro_batch_size * t.seq_len / cp / tp / cfg.parallel.pipeline,
        dtype=cfg.precision.param_dtype.name,
        optimizer_params=trainable,
        offload_bytes=(shards * gathers_per_step + s.rank0.grads) if offload else 0.0,
        optimizer_on_host=offload,
        model_flops_per_token=facts.flops_per_token,
        optimizer_tensors=tensors,
        pipeline_bubble=facts.pipeline.bubble if facts.pipeline else 0.0,
        pipeline_bytes=facts.pipeline.step_bytes(cfg) if facts.pipeline else 0.0,
    )


def predict_step(
    cfg: Config,
    topo: Topology,
    facts: ModelShape,
    s: StrategyPlan,
    strategy: ShardingStrategy,
    device: DeviceProfile,
) -> StepTime:
    return predict(step_work(cfg, topo, facts, s, strategy), device)
