"""A planned step's collectives, per FSDP unit and micro-batch: how the strategy lays each
unit's parameters out on this rank's groups (its all-gather, its gradients' reduction, HSDP's
two levels) with FSDP2's copies around them, and the collectives inside a unit's compute
(TP's, CP's, EP's). ``plan_time`` puts them beside the units' compute."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config import Config
from fsdp_lab.config.precisions import dtype_row
from fsdp_lab.config.topology import Topology
from fsdp_lab.planning import memory
from fsdp_lab.planning.plan_model import ModelShape
from fsdp_lab.planning.plan_result import StrategyPlan
from fsdp_lab.planning.time_model import Collective


@dataclass(frozen=True)
class Layout:
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


def layout(cfg: Config, topo: Topology, facts: ModelShape, s: StrategyPlan) -> Layout:
    p, tp, ep = cfg.precision, cfg.parallel.tensor, cfg.parallel.expert
    b = dtype_row(p.param_dtype).bytes
    replicate, shard = (1, *s.fsdp_mesh)[-2:]
    per_node = topo.nproc_per_node
    return Layout(
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


def inner_collectives(cfg: Config, layer, t: float, b: int, per_node: int, linears: float) -> tuple:
    """A block's collectives inside its compute, per micro-batch: TP's all-reduce of the
    hidden state for each split linear (a rowwise one's output forward, a colwise one's
    input gradient backward: each colwise module takes its input on its own, so q, k and v
    reduce theirs apart; sequence parallelism's all-gather/reduce-scatter pairs move the
    same); CP's gather of the keys and values forward and the reduce-scatter of their
    gradients backward; EP's four all-to-alls of each token's top_k rows."""
    tp, cp, ep = cfg.parallel.tensor, cfg.parallel.context, cfg.parallel.expert
    out = []
    if tp > 1:
        hidden = t * layer.hidden * b
        out.append(Collective("all_reduce", hidden, tp, tp > per_node, count=linears))
    if cp > 1:
        kv = 2 * layer.kv_dim / tp * t * cp * b  # the gathered K and V, whole
        across = cp * tp > per_node
        out += [
            Collective("all_gather", kv, cp, across),
            Collective("reduce_scatter", kv, cp, across),
        ]
    if ep > 1 and layer.experts:
        # an all-to-all sends (ep-1)/ep of a rank's rows, as an all-gather of that much each
        rows = t * layer.top_k * layer.hidden * b
        out.append(Collective("all_gather", rows, ep, ep * tp > per_node, count=4))
    return tuple(out)
