"""Per-rank memory of an FSDP2 run, counted from shapes alone: the arithmetic of ``fsdp-lab plan``.

Pure: integers in, integers out; imports no torch, needs no process group. Two accountings:

* the ZeRO paper's (Rajbhandari et al., 2020, section 3 and figure 1): mixed-precision Adam holds
  2 bytes (fp16 params) + 2 (fp16 grads) + K=12 (fp32 master params, momentum, variance) per
  parameter, and each stage divides part of it by the N data-parallel ranks;
* what fsdp_lab's FSDP2 run holds, exactly: every parameter is split on dim 0 like
  ``torch.chunk(dim0, N)`` (rank r takes chunk r, possibly smaller or empty: FSDP2's
  ``_chunk_with_empty``); shards stay fp32 (the master weights) whatever ``param_dtype`` is, their
  gradients are fp32 too, and AdamW adds exp_avg and exp_avg_sq like the shard plus a 0-dim fp32
  ``step`` per parameter. FSDP2 pads every shard's storage to chunk 0's size (params, and the
  reduce-scatter output the sharded grads are views of): that padding is counted apart.

Activations (what autograd saves per token) are ``activation_memory``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config.low_precision import nf4_bytes, nf4_splits
from fsdp_lab.config.topology import expert_shard_dim
from fsdp_lab.planning.activation_memory import FP32, LayerShape

ADAM_STEP_BYTES = 4  # torch.optim.AdamW keeps `step` as a 0-dim fp32 tensor (not fused/capturable)
ZERO_K = 12  # the paper's optimizer bytes per parameter: fp32 master copy + momentum + variance


@dataclass(frozen=True)
class ParamShape:
    """One (deduplicated: tied counts once) parameter, as FSDP2 shards it."""

    numel: int
    dim0: int  # the size of the dim FSDP2 shards (Shard(0)); 1 for a 0-dim parameter
    group: int  # the FSDP unit that owns it, in wrap order; -1 for the root
    trainable: bool = True  # frozen (finetune): no gradient, no optimizer state
    # An expert parameter ([E, ...], parallel.expert splits it): its dim-1 size, and those of
    # its experts module's parameters, which decide the dim FSDP shards it on
    # (config.topology.expert_shard_dim). 0 and (): not an expert parameter.
    expert_dim1: int = 0
    module_dim1s: tuple[int, ...] = ()
    # How it is stored and gathered (engine.low_precision): fp32 (gathered in param_dtype);
    # float8 (an fp32 master, gathered in 1 byte); nf4 (frozen, 4.13 bits, gathered as such).
    storage: str = "fp32"
    lookup: bool = False  # an embedding's table, read by index: no matmul (a tied head's is one)
    tp_linear: bool = False  # a linear's weight parallel.tensor splits (DTensor dispatch a pass)

    @property
    def row(self) -> int:
        return self.numel // self.dim0 if self.dim0 else 0


@dataclass(frozen=True)
class StateBytes:
    """One rank's model state at rest, after the first optimizer step."""

    params: int  # the rank's fp32 shards (sum of p.to_local() bytes)
    grads: int  # its fp32 sharded gradients
    optimizer: int  # AdamW exp_avg + exp_avg_sq + step
    padding: int  # storage FSDP2 allocates past the shard (params and grads padded to chunk 0)
    grad_padding: int = 0  # the grads' part of padding (trainable parameters only)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.padding


def chunk_rows(dim0: int, num_chunks: int, index: int) -> int:
    """Rows of chunk ``index`` of ``torch.chunk(dim0 rows, num_chunks)`` padded with empty chunks,
    as FSDP2 splits a parameter: chunks of ceil(dim0/n) rows, the last ones short or empty."""
    size = -(-dim0 // num_chunks)
    return max(0, min(size, dim0 - index * size))


def _held_whole(p: ParamShape, shard_size: int) -> bool:
    """An NF4 parameter every rank holds whole, outside FSDP (``engine.low_precision``)."""
    return p.storage == "nf4" and not nf4_splits(p.dim0, p.row, shard_size)


def shard_elements(p: ParamShape, shard_size: int, shard_rank: int, ep: int = 1) -> tuple[int, int]:
    """(this rank's elements of ``p``, chunk 0's: what FSDP2 pads every shard's storage to).
    With expert parallelism (``ep`` > 1, innermost on the shard axis) an expert parameter's
    experts are split over ep first, and FSDP shards the rank's E/ep of them over the other
    shard_size/ep ranks, on the dim ``config.topology.expert_shard_dim`` says (as the engine
    does)."""
    if _held_whole(p, shard_size):
        return p.numel, p.numel
    if not p.expert_dim1 or ep == 1:
        dim, ways, index, numel = p.dim0, shard_size, shard_rank, p.numel
    else:
        experts, ways, index = p.dim0 // ep, shard_size // ep, shard_rank // ep
        numel = p.numel // ep
        whole = expert_shard_dim(experts, p.module_dim1s, ways) == 0
        dim = experts if whole else p.expert_dim1  # Shard(1): each expert's rows split
    row = numel // dim if dim else 0
    return chunk_rows(dim, ways, index) * row, chunk_rows(dim, ways, 0) * row


def rank_state(
    params: list[ParamShape], *, shard_size: int, shard_rank: int, ep: int = 1
) -> StateBytes:
    """Exact bytes one rank holds when each parameter is sharded over ``shard_size`` ranks
    (expert parameters: see ``shard_elements``); only trainable parameters have gradients and
    optimizer state."""
    local = padded = local_t = padded_t = nf4 = 0
    for p in params:
        mine, first = shard_elements(p, shard_size, shard_rank, ep)
        if p.storage == "nf4":  # frozen, evenly split or whole: no padding
            nf4 += nf4_bytes(mine)
            continue
        local, padded = local + mine, padded + first
        if p.trainable:
            local_t, padded_t = local_t + mine, padded_t + first
    grad_padding = FP32 * (padded_t - local_t)
    return StateBytes(
        params=FP32 * local + nf4,
        grads=FP32 * local_t,
        optimizer=2 * FP32 * local_t + ADAM_STEP_BYTES * sum(p.trainable for p in params),
        padding=FP32 * (padded - local) + grad_padding,
        grad_padding=grad_padding,
    )


def per_rank_state(
    params: list[ParamShape], mesh: tuple[int, ...], *, ep: int = 1
) -> list[StateBytes]:
    """Every rank's state. Ranks are laid out replicate-major (rank = r * shard + s), so a
    rank's shard index is rank % shard size and replicas repeat the same figures."""
    shard = mesh[-1]
    by_shard = [rank_state(params, shard_size=shard, shard_rank=s, ep=ep) for s in range(shard)]
    world = 1
    for n in mesh:
        world *= n
    return [by_shard[r % shard] for r in range(world)]


def zero_paper(
    num_params: int, *, stage: int, dp_size: int, k: int = ZERO_K, trainable: int | None = None
) -> StateBytes:
    """Model-state bytes per rank of ZeRO stage 0 (DDP), 1 (P_os), 2 (P_os+g), 3 (P_os+g+p) for
    Psi parameters over N ranks: (2+2+K)Psi, 4Psi+KPsi/N, 2Psi+(2+K)Psi/N, (2+2+K)Psi/N.
    Divisions round up (a rank holds whole elements). With ``trainable`` < Psi (a frozen
    base) gradients and the K bytes count only the trainable parameters."""
    tuned = num_params if trainable is None else trainable

    def split(nbytes: int, sharded: bool) -> int:
        return -(-nbytes // dp_size) if sharded else nbytes

    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} is not 0, 1, 2 or 3")
    return StateBytes(
        params=split(2 * num_params, stage >= 3),
        grads=split(2 * tuned, stage >= 2),
        optimizer=split(k * tuned, stage >= 1),
        padding=0,
    )


def group_numels(
    params: list[ParamShape],
    shard_size: int,
    *,
    trainable_only: bool = False,
    ep: int = 1,
    param_bytes: int = 0,
) -> dict[int, int]:
    """Elements each FSDP unit all-gathers (its unsharded params, padded to shard_size chunks);
    ``trainable_only``: those it reduce-scatters gradients of. With expert parallelism a rank
    gathers only its E/ep experts (their own unit, counted with the layer's). With
    ``param_bytes``, a float8 or NF4 parameter counts as the param_dtype elements its bytes
    make (an NF4 one every rank holds whole is not gathered)."""
    out: dict[int, int] = {}
    for p in params:
        if trainable_only and not p.trainable:
            continue
        ways = shard_size // ep if p.expert_dim1 and ep > 1 else shard_size
        numel = shard_elements(p, shard_size, 0, ep)[1] * ways
        if param_bytes and p.storage != "fp32":
            whole = _held_whole(p, shard_size)
            size = 0 if whole else nf4_bytes(numel) if p.storage == "nf4" else numel
            numel = -(-size // param_bytes)
        out[p.group] = out.get(p.group, 0) + numel
    return out


@dataclass(frozen=True)
class Transient:
    """Device bytes that exist only during forward and backward, on top of the state at rest."""

    kept_params: int  # unsharded params (param_dtype) alive from forward to backward
    gathered: int  # the unit being computed and the one prefetched (param_dtype)
    grad_buffers: int  # the largest block unit's reduce-scatter (`reduce_scatter_bytes`)
    accumulation: int  # grad_accum_steps > 1: unsharded grads kept between micro-batches
    backward: int  # autograd's own: the logits' gradients, or a layer's in-flight activation
    # gradients (and, under checkpointing, the recomputed layer), whichever is larger
    end_of_backward: int = 0  # the root's backward and reduce-scatter, activations freed: see
    # `transient`; the other units' sharded grads (`reduced_grads`) included
    reduced_grads: int = 0  # the part of end_of_backward that is sharded grads (fp32)

    @property
    def total(self) -> int:
        """At the forward/backward peak, on top of the saved activations: a unit's
        reduce-scatter follows its backward, once its activations are freed, so it does not add
        to autograd's working memory (measured)."""
        return (
            self.kept_params
            + self.gathered
            + self.accumulation
            + max(self.backward, self.grad_buffers)
        )


@dataclass(frozen=True)
class Reduction:
    """How a unit's gradients are reduced: the bytes of a gathered parameter and of a reduced
    gradient, the ranks of the shard axis, and whether the group is gloo's."""

    param_bytes: int
    reduce_bytes: int
    shard_size: int = 1
    gloo: bool = False


def reduce_scatter_bytes(numel: int, r: Reduction, *, held: int = 0) -> int:
    """A reduce-scatter's peak (FSDP2's foreach_reduce) of ``numel`` unsharded elements: the
    unsharded grads while they are copied into its input, then the input and the sharded output
    (and ``held``: grads someone else still references, so the copy-in did not free them).
    Gloo has no reduce-scatter: it clones the whole input and all-reduces the clone
    (ProcessGroupGloo::reduce_scatter_tensor_coalesced), one more unsharded copy at the call;
    over one rank (no_shard) FSDP2 copies instead and all-reduces the output in place."""
    copies = 2 if r.gloo and r.shard_size > 1 else 1
    scatter = (copies * numel + -(-numel // r.shard_size)) * r.reduce_bytes + held
    return max(numel * (r.param_bytes + r.reduce_bytes), scatter)


def tied_grad_bytes(s: LayerShape, b: int, *, fused_loss: bool) -> int:
    """The gradient bytes a tied input/output embedding holds beyond its own V x H in the
    input embedding's backward, measured on a fake group: the head's gradient waits there for
    the embedding's, and autograd sums the two out of place (three V x H tensors at once with
    the model's own loss; a fused loss's gradient, made in forward, takes the sum in place)."""
    if not s.tied:
        return 0
    return s.vocab * s.hidden * b * (1 if fused_loss else 2)


def last_grad_numel(params: list[ParamShape], group: int) -> int:
    """Elements of the last trainable parameter of FSDP unit ``group``: FSDP2's foreach_reduce
    keeps the last unsharded gradient alive through the reduce-scatter (its loop variable, over
    more than one rank), an untied head's V x H when it is the root's last."""
    mine = [p.numel for p in params if p.group == group and p.trainable]
    return mine[-1] if mine else 0


def transient(
    groups: dict[int, int],
    r: Reduction,
    *,
    reshard: bool | int,
    grad_accum_steps: int,
    backward: int,
    grad_groups: dict[int, int] | None = None,
    tied_grads: int = 0,
    held_grads: int = 0,
) -> Transient:
    """FSDP2's working set. The root (-1) is not resharded after forward when there are units
    (backward needs it at once), nor is the last unit (``sharding.apply_fsdp``); with
    ``reshard`` False every unit stays gathered until its backward (grad_op, hybrid_zero2,
    no_shard), with an int N each keeps a 1/N shard. ``grad_groups``: the elements of each
    unit that get gradients, where some are frozen (default: all of ``groups``).

    The root's gradients (embeddings, head) are reduced last, in FSDP2's final callback, after
    every activation is freed: they are not added to the forward/backward peak but make a phase
    of their own, ``end_of_backward``: the blocks' sharded grads over ``shard_size`` ranks,
    and the larger of the input embedding's backward (the root's gathered params, its unsharded
    grads, the last block's reduce-scatter input, which FSDP2 keeps until the next one) and the
    root's own reduce-scatter, once it is resharded. ``tied_grads`` (``tied_grad_bytes``) add
    to the first, the ``held_grads`` elements (``last_grad_numel``) to the second. ``r``: the
    reduction (a gloo group's reduce-scatter copies its input)."""
    param_bytes, reduce_bytes, shard_size = r.param_bytes, r.reduce_bytes, r.shard_size
    grad_groups = groups if grad_groups is None else grad_groups
    units = {g: n for g, n in groups.items() if g >= 0}
    root = groups.get(-1, 0)
    unit_grads = {g: n for g, n in grad_groups.items() if g >= 0}
    root_grads = grad_groups.get(-1, 0) if units else 0
    if not units:  # the root is the only unit and follows the strategy
        units, root, unit_grads = {-1: root}, 0, dict(grad_groups)
    kept, gathered = _gathered_in_forward(units, root, reshard, shard_size)
    biggest = max(unit_grads.values(), default=0)
    # FSDP2 accumulates unreduced grads in reduce_dtype (to_accumulated_grad_if_needed).
    accumulation = sum(grad_groups.values()) * reduce_bytes if grad_accum_steps > 1 else 0
    end = reduced = 0
    if root_grads:
        first = unit_grads[min(unit_grads)] if unit_grads else 0  # the last one reduced
        in_backward = (root + root_grads) * param_bytes + tied_grads + first * reduce_bytes
        reduced = FP32 * sum(-(-n // shard_size) for n in unit_grads.values())
        held = held_grads * param_bytes if shard_size > 1 else 0
        scatter = reduce_scatter_bytes(root_grads, r, held=held)
        end = max(in_backward, scatter) + reduced + accumulation
    return Transient(
        kept_params=kept * param_bytes,
        gathered=gathered * param_bytes,
        grad_buffers=reduce_scatter_bytes(biggest, r),
        accumulation=accumulation,
        backward=backward,
        end_of_backward=end,
        reduced_grads=reduced,
    )


def _gathered_in_forward(
    units: dict[int, int], root: int, reshard: bool | int, shard_size: int
) -> tuple[int, int]:
    """(elements kept gathered between forward and backward, elements gathered at once): the
    root and the last unit are kept when the strategy reshards (backward needs them at once);
    the current and the prefetched unit are gathered."""
    last = max(units) if -1 not in units else None  # None: the root is the only unit
    kept = root + (units[last] if last is not None and reshard is not False else 0)
    others = {g: n for g, n in units.items() if g != last}
    if reshard is False:
        kept += sum(units.values())
    elif reshard is not True:  # an int: resharded to groups of `reshard` ranks after forward
        kept += sum(-(-n // reshard) for n in others.values())
    largest = sorted(others.values(), reverse=True)
    gathered = sum(largest[:2])  # current + prefetched unit
    if reshard is False:  # all kept; FSDP2 frees an all-gather's output at the next one's wait,
        # so the last unit's stays (measured on a fake group)
        gathered = units[last] if last is not None and shard_size > 1 else 0
    return kept, gathered


def peak(
    state: StateBytes,
    *,
    activations: int,
    transient_bytes: int,
    end_of_backward: int = 0,
    reduced_grads: int = 0,
    state_on_device: bool = True,
) -> int:
    """Peak device bytes: the state at rest, plus the largest of the forward/backward working
    set (activations + transient; sharded grads are None then, zero_grad set them so), the
    root's at the end of backward (``Transient.end_of_backward``: activations freed, the other
    units' sharded grads made) and the optimizer step's (every sharded grad alive). Without the
    state on the device (offload=cpu on a GPU) only the working sets count, less the sharded
    grads (``reduced_grads``) that go to the host."""
    if not state_on_device:
        return max(activations + transient_bytes, end_of_backward - reduced_grads)
    return (
        state.params
        + state.optimizer
        + state.padding
        - state.grad_padding
        + max(activations + transient_bytes, end_of_backward, state.grads + state.grad_padding)
    )
