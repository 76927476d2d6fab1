"""A planned run's step as the time model's work (``time_model.StepWork``): each FSDP unit's
FLOPs, bytes, operators and collectives, read off the plan's model facts and the strategy's
mesh, then priced on a device (``predict_step``). Imports no torch.

What one rank does per micro-batch of ``b x T`` rows (``t = b x T / context`` local tokens):

* a block's matmuls: 2 FLOPs per weight per token forward; backward 4 (weight and input
  gradients), 2 for a frozen weight (finetune=lora's base, QLoRA's NF4 base); a mixture of
  experts runs top_k of its E experts; TP's weights are the rank's split already;
* attention (SDPA/flash, causal: half the T x T scores): 4 x t x T/2 x q_dim/tp forward (keys
  within a sliding window at most), 2.5x that backward (flash's five matmuls against two);
* a checkpointed block runs its forward again in backward;
* other operators move ``ELEMENTWISE_PASSES`` x the bytes the layer saves for backward
  (``activation_memory``: each written once and read again), twice that in backward (once,
  with fewer kernels, where ``compile=true`` fuses them);
* the root: the head (V x H per token), the loss's logits (fp32, read and written
  ``LOGIT_PASSES`` times) and the embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config import (
    Config,
    ExpertsImplementation,
    HardwareKind,
    OffloadDevice,
    ShardingStrategy,
)
from fsdp_lab.config.hardware_profiles import DeviceProfile
from fsdp_lab.config.precisions import dtype_row
from fsdp_lab.config.topology import Topology
from fsdp_lab.tools import activation_memory, memory
from fsdp_lab.tools.plan_model import ModelShape
from fsdp_lab.tools.plan_result import StrategyPlan
from fsdp_lab.tools.time_model import Collective, StepTime, StepWork, UnitWork, predict

ELEMENTWISE_PASSES = 2  # forward: each saved activation written and read once; backward 2x
# compile=true: Inductor fuses a layer's norms, activations and rotary into a few kernels that
# read their inputs and write their outputs once, and launches fewer of them
COMPILED_PASSES, COMPILED_OPS_PER_LAYER = 1, 20
LOGIT_PASSES = 4  # the logits: written, upcast, softmax read and written (forward; backward too)
ATTENTION_BACKWARD = 2.5  # flash attention's backward FLOPs over its forward's
# Operators a pass of one layer issues (forward, eager transformers; backward issues about
# twice as many autograd nodes' kernels), counted with torch's dispatcher on a Llama layer.
OPS_PER_LAYER = 60
OPS_ROOT = 25  # embedding, final norm, head, loss


def _unit_params(facts: ModelShape) -> dict[int, list[memory.ParamShape]]:
    out: dict[int, list[memory.ParamShape]] = {}
    for p in facts.params:
        out.setdefault(p.group, []).append(p)
    return out


def _matmul_flops(
    params: list[memory.ParamShape], layer, tokens: float
) -> tuple[float, float, float, float]:
    """(forward, backward) matmul FLOPs of these weights over ``tokens`` (experts: top_k of
    E), then the experts' share of each (their grouped GEMMs)."""
    fwd = bwd = expert_fwd = expert_bwd = 0.0
    for p in params:
        if p.lookup or p.row <= 1:  # an embedding table, a norm's or a bias's vector
            continue
        expert = bool(p.expert_dim1 and layer.experts)
        active = p.numel * (layer.top_k / layer.experts if expert else 1)
        f, b = 2 * active * tokens, (4 if p.trainable else 2) * active * tokens
        fwd, bwd = fwd + f, bwd + b
        if expert:
            expert_fwd, expert_bwd = expert_fwd + f, expert_bwd + b
    return fwd, bwd, expert_fwd, expert_bwd


def _grouped(cfg: Config) -> bool:
    """The experts run as grouped GEMMs (transformers' choice picks grouped_mm where torch
    has it); eager loops and batched_mm are priced as dense matmuls."""
    impl = cfg.model.experts_implementation
    return impl in (ExpertsImplementation.auto, ExpertsImplementation.grouped_mm)


def _attention_flops(cfg: Config, layer, tokens: float) -> float:
    """Forward FLOPs of one layer's attention over the rank's tokens: QK^T and AV over the
    keys a query sees (causal: half the sequence on average, a window at most)."""
    keys = cfg.trainer.seq_len / 2
    if layer.sliding_window is not None:
        keys = min(keys, layer.sliding_window)
    return 4 * tokens * keys * layer.q_dim / cfg.parallel.tensor


@dataclass(frozen=True)
class _Layout:
    """How a strategy lays the units' parameters out on this rank's groups, and what moving
    them costs: the collectives and FSDP2's copies around them."""

    shard: int  # ranks a unit is sharded over (shard x context)
    replicate: int  # replica groups (HSDP; DDP's every rank)
    shard_across: bool  # the shard group spans nodes
    replicate_across: bool
    b: int  # param_dtype bytes
    rb: int  # reduce_dtype bytes
    gathers: dict[int, int]  # elements each unit all-gathers (its gathered size)
    grads: dict[int, int]  # elements each unit reduces
    per_node: int  # ranks per node (TP, CP and EP groups within one are on its links)

    def gather(self, group: int) -> Collective | None:
        n = self.gathers.get(group, 0)
        if not n or self.shard == 1:
            return None
        return Collective("all_gather", n * self.b, self.shard, self.shard_across)

    def reduce(self, group: int) -> tuple[Collective, ...]:
        """A unit's gradient reduction: DDP's all-reduce (no_shard), a reduce-scatter over the
        shard group, then HSDP's all-reduce of the shard over the replicas."""
        numel = self.grads.get(group, 0)
        if not numel:
            return ()
        nbytes, replicas = numel * self.rb, (self.replicate, self.replicate_across)
        if self.shard == 1:
            return (Collective("all_reduce", nbytes, *replicas),)
        scatter = Collective("reduce_scatter", nbytes, self.shard, self.shard_across)
        if self.replicate == 1:
            return (scatter,)
        return scatter, Collective("all_reduce", nbytes / self.shard, *replicas)

    def gather_copies(self, group: int) -> float:
        """FSDP2's copies around a unit's all-gather: its fp32 shards cast into the gather's
        input, the gathered buffer split out into the parameters (over one rank too)."""
        n = self.gathers.get(group, 0)
        return n / self.shard * (4 + self.b) + 2 * n * self.b

    def reduce_copies(self, group: int) -> float:
        """...and around its reduce-scatter: the gradients copied into the flat input, the
        output cast to fp32 into the sharded gradient."""
        n = self.grads.get(group, 0)
        return 2 * n * self.rb + n / self.shard * (self.rb + 4)


def _layout(cfg: Config, topo: Topology, facts: ModelShape, s: StrategyPlan) -> _Layout:
    p, tp, ep = cfg.precision, cfg.parallel.tensor, cfg.parallel.expert
    b = dtype_row(p.param_dtype).bytes
    replicate, shard = (1, *s.fsdp_mesh)[-2:]
    per_node = topo.nproc_per_node
    return _Layout(
        shard=shard,
        replicate=replicate,
        shard_across=shard * tp > per_node,
        replicate_across=replicate > 1 and replicate * shard * tp > per_node,
        b=b,
        rb=dtype_row(p.reduce_dtype).bytes,
        gathers=memory.group_numels(facts.params, shard, ep=ep, param_bytes=b),
        grads=memory.group_numels(facts.params, shard, trainable_only=True, ep=ep),
        per_node=per_node,
    )


def _units(cfg: Config, topo: Topology, facts: ModelShape, s: StrategyPlan) -> list:
    """The root's embedding pass, each block unit, the head: their work per micro-batch."""
    layer, lay = facts.layer, _layout(cfg, topo, facts, s)
    t = cfg.trainer.micro_batch_size * cfg.trainer.seq_len / cfg.parallel.context
    by_unit = _unit_params(facts)
    blocks = sorted(g for g in by_unit if g >= 0)
    reshard = s.reshard_after_forward  # the strategy plan resolved it (its default, or the setting)
    # the layers' attention, spread over the block units (one each under wrap=transformer)
    attention = _attention_flops(cfg, layer, t) * layer.num_layers
    per_block = attention / len(blocks) if blocks else 0.0
    last = len(blocks) - 1  # FSDP2 keeps the last block gathered for backward
    units = [
        _block(cfg, facts, lay, by_unit[g], g, t, per_block, reshard is not False and i < last)
        for i, g in enumerate(blocks)
    ]
    head_fwd, head_bwd, *_ = _matmul_flops(by_unit.get(-1, []), layer, t)
    logits = LOGIT_PASSES * t * layer.vocab / cfg.parallel.tensor * 4
    embed = t * layer.hidden * lay.b
    attn = 0.0 if blocks else attention  # the root the only unit: the layers' are its
    first = UnitWork(
        "root", 0.0, 0.0, embed + lay.gather_copies(-1), embed + lay.reduce_copies(-1), 2, 2,
        lay.gather(-1), False, lay.reduce(-1),
    )  # fmt: skip
    head = UnitWork(
        "head", head_fwd + attn, head_bwd + ATTENTION_BACKWARD * attn, logits, logits,
        OPS_ROOT, 2 * OPS_ROOT, forward_attention=attn,
        backward_attention=ATTENTION_BACKWARD * attn,
    )  # fmt: skip
    return [first, *units, head]


# Many parameters: the unit, and what the step around it decided for it.
def _block(
    cfg: Config,
    facts: ModelShape,
    lay: _Layout,
    params: list,
    group: int,
    t: float,
    attn: float,
    regather: bool,
) -> UnitWork:
    """One block unit's work per micro-batch (``attn``: its attention's forward FLOPs)."""
    layer, b = facts.layer, lay.b
    passes, ops = (COMPILED_PASSES, COMPILED_OPS_PER_LAYER) if cfg.compile else (
        ELEMENTWISE_PASSES, OPS_PER_LAYER)  # fmt: skip
    saved = activation_memory.layer_bytes_per_token(
        layer, b, tensor=cfg.parallel.tensor, sequence_parallel=cfg.parallel.sequence_parallel
    )
    # a mixture of experts moves each token's top_k copies of the hidden state three times a
    # pass: gathered into expert order, scaled by its routing weight, added back
    routing = 6 * layer.top_k * layer.hidden * b * t if layer.experts else 0.0
    fwd, bwd, grouped_fwd, grouped_bwd = _matmul_flops(params, layer, t)
    if not _grouped(cfg):
        grouped_fwd = grouped_bwd = 0.0
    fwd, bwd = fwd + attn, bwd + ATTENTION_BACKWARD * attn
    recompute = group in facts.checkpointed_units
    nbytes = passes * saved * t + routing
    copy = lay.gather_copies(group)
    return UnitWork(
        name=f"unit {group}",
        forward_flops=fwd,
        backward_flops=bwd + (fwd if recompute else 0.0),
        forward_bytes=nbytes + copy,
        backward_bytes=(2 + recompute) * nbytes
        + (copy if regather else 0)
        + lay.reduce_copies(group),
        forward_ops=ops,
        backward_ops=(2 + recompute) * ops,
        gather=lay.gather(group),
        regather=regather,
        reduce=lay.reduce(group),
        inner=_inner_collectives(cfg, layer, t, b, lay.per_node),
        fp8_share=1.0 if cfg.precision.float8_recipe is not None else 0.0,
        forward_attention=attn,
        backward_attention=ATTENTION_BACKWARD * attn + (attn if recompute else 0.0),
        forward_grouped=grouped_fwd,
        backward_grouped=grouped_bwd + (grouped_fwd if recompute else 0.0),
    )


def _inner_collectives(cfg: Config, layer, t: float, b: int, per_node: int) -> tuple:
    """A block's collectives inside its compute, per micro-batch: TP's two all-reduces of the
    hidden state forward and two backward (sequence parallelism's all-gather/reduce-scatter
    pairs move the same); CP's gather of the keys and values forward and the reduce-scatter
    of their gradients backward; EP's four all-to-alls of each token's top_k rows."""
    tp, cp, ep = cfg.parallel.tensor, cfg.parallel.context, cfg.parallel.expert
    out = []
    if tp > 1:
        out.append(Collective("all_reduce", t * layer.hidden * b, tp, tp > per_node, count=4))
    if cp > 1:
        kv = 2 * layer.kv_dim / tp * t * cp * b  # the gathered K and V, whole
        across = cp * tp > per_node
        out += [
            Collective("all_gather", kv, cp, across),
            Collective("reduce_scatter", kv, cp, across),
        ]
    if ep > 1 and layer.experts:
        rows = t * layer.top_k * layer.hidden * b * ep  # the exchange's whole tensor
        out.append(Collective("all_gather", rows, ep, ep * tp > per_node, count=4))
    return tuple(out)


def step_work(
    cfg: Config, topo: Topology, facts: ModelShape, s: StrategyPlan, strategy: ShardingStrategy
) -> StepWork:
    """The work of one optimizer step on rank 0 of ``strategy``'s plan ``s``."""
    units = _units(cfg, topo, facts, s)
    t, tp, cp = cfg.trainer, cfg.parallel.tensor, cfg.parallel.context
    trainable = s.rank0.grads // memory.FP32
    tensors = sum(1 for q in facts.params if q.trainable)
    offload = cfg.offload.device is OffloadDevice.cpu and topo.device is HardwareKind.gpu
    shards = s.rank0.params  # fp32 shards: copied to the device for each gather
    gathers_per_step = t.grad_accum_steps * (1 + (s.reshard_after_forward is not False))
    return StepWork(
        units=tuple(units),
        micro_batches=t.grad_accum_steps,
        tokens=t.micro_batch_size * t.seq_len / cp / tp,
        dtype=cfg.precision.param_dtype.name,
        optimizer_params=trainable,
        offload_bytes=(shards * gathers_per_step + s.rank0.grads) if offload else 0.0,
        optimizer_on_host=offload,
        model_flops_per_token=facts.flops_per_token,
        optimizer_tensors=tensors,
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
