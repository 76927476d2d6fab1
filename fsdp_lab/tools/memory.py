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
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config import ModelTask

FP32 = 4
ADAM_STEP_BYTES = 4  # torch.optim.AdamW keeps `step` as a 0-dim fp32 tensor (not fused/capturable)
ZERO_K = 12  # the paper's optimizer bytes per parameter: fp32 master copy + momentum + variance


@dataclass(frozen=True)
class ParamShape:
    """One (deduplicated: tied counts once) parameter, as FSDP2 shards it."""

    numel: int
    dim0: int  # the size of the dim FSDP2 shards (Shard(0)); 1 for a 0-dim parameter
    group: int  # the FSDP unit that owns it, in wrap order; -1 for the root
    trainable: bool = True  # frozen (finetune): no gradient, no optimizer state

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


def rank_state(params: list[ParamShape], *, shard_size: int, shard_rank: int) -> StateBytes:
    """Exact bytes one rank holds when each parameter is sharded over ``shard_size`` ranks;
    only trainable parameters have gradients and optimizer state."""
    local = padded = local_t = padded_t = 0
    for p in params:
        mine, first = (
            chunk_rows(p.dim0, shard_size, shard_rank) * p.row,
            chunk_rows(p.dim0, shard_size, 0) * p.row,
        )
        local, padded = local + mine, padded + first
        if p.trainable:
            local_t, padded_t = local_t + mine, padded_t + first
    grad_padding = FP32 * (padded_t - local_t)
    return StateBytes(
        params=FP32 * local,
        grads=FP32 * local_t,
        optimizer=2 * FP32 * local_t + ADAM_STEP_BYTES * sum(p.trainable for p in params),
        padding=FP32 * (padded - local) + grad_padding,
        grad_padding=grad_padding,
    )


def per_rank_state(params: list[ParamShape], mesh: tuple[int, ...]) -> list[StateBytes]:
    """Every rank's state. Ranks are laid out replicate-major (rank = r * shard + s), so a
    rank's shard index is rank % shard size and replicas repeat the same figures."""
    shard = mesh[-1]
    by_shard = [rank_state(params, shard_size=shard, shard_rank=s) for s in range(shard)]
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
    params: list[ParamShape], shard_size: int, *, trainable_only: bool = False
) -> dict[int, int]:
    """Elements each FSDP unit all-gathers (its unsharded params, padded to shard_size chunks);
    ``trainable_only``: those it reduce-scatters gradients of."""
    out: dict[int, int] = {}
    for p in params:
        if trainable_only and not p.trainable:
            continue
        out[p.group] = out.get(p.group, 0) + chunk_rows(p.dim0, shard_size, 0) * shard_size * p.row
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


def reduce_scatter_bytes(
    numel: int, *, param_bytes: int, reduce_bytes: int, shard_size: int, gloo: bool, held: int = 0
) -> int:
    """A reduce-scatter's peak (FSDP2's foreach_reduce) of ``numel`` unsharded elements: the
    unsharded grads while they are copied into its input, then the input and the sharded output
    (and ``held``: grads someone else still references, so the copy-in did not free them).
    Gloo has no reduce-scatter: it clones the whole input and all-reduces the clone
    (ProcessGroupGloo::reduce_scatter_tensor_coalesced), one more unsharded copy at the call;
    over one rank (no_shard) FSDP2 copies instead and all-reduces the output in place."""
    copies = 2 if gloo and shard_size > 1 else 1
    scatter = (copies * numel + -(-numel // shard_size)) * reduce_bytes + held
    return max(numel * (param_bytes + reduce_bytes), scatter)


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


# Many parameters: each is one measured term of the memory model (keyword-only).
# Long: FSDP2's working set in two phases, each a few lines with the measurement behind it.
def transient(
    groups: dict[int, int],
    *,
    reshard: bool | int,
    param_bytes: int,
    reduce_bytes: int,
    grad_accum_steps: int,
    backward: int,
    grad_groups: dict[int, int] | None = None,
    shard_size: int = 1,
    tied_grads: int = 0,
    held_grads: int = 0,
    gloo: bool = False,
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
    to the first, the ``held_grads`` elements (``last_grad_numel``) to the second. ``gloo``: a
    CPU process group, whose reduce-scatter copies its input."""
    grad_groups = groups if grad_groups is None else grad_groups
    units = {g: n for g, n in groups.items() if g >= 0}
    root = groups.get(-1, 0)
    unit_grads = {g: n for g, n in grad_groups.items() if g >= 0}
    root_grads = grad_groups.get(-1, 0) if units else 0
    if not units:  # the root is the only unit and follows the strategy
        units, root, unit_grads = {-1: root}, 0, dict(grad_groups)
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
    rb = dict(param_bytes=param_bytes, reduce_bytes=reduce_bytes, shard_size=shard_size, gloo=gloo)
    biggest = max(unit_grads.values(), default=0)
    # FSDP2 accumulates unreduced grads in reduce_dtype (to_accumulated_grad_if_needed).
    accumulation = sum(grad_groups.values()) * reduce_bytes if grad_accum_steps > 1 else 0
    end = reduced = 0
    if root_grads:
        first = unit_grads[min(unit_grads)] if unit_grads else 0  # the last one reduced
        in_backward = (root + root_grads) * param_bytes + tied_grads + first * reduce_bytes
        reduced = FP32 * sum(-(-n // shard_size) for n in unit_grads.values())
        held = held_grads * param_bytes if shard_size > 1 else 0
        scatter = reduce_scatter_bytes(root_grads, **rb, held=held)
        end = max(in_backward, scatter) + reduced + accumulation
    return Transient(
        kept_params=kept * param_bytes,
        gathered=gathered * param_bytes,
        grad_buffers=reduce_scatter_bytes(biggest, **rb),
        accumulation=accumulation,
        backward=backward,
        end_of_backward=end,
        reduced_grads=reduced,
    )


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


# Activations: what autograd saves for backward, per token, read off HF's eager code (sdpa
# attention) and checked against torch.autograd.graph.saved_tensors_hooks (tests/test_plan.py).
FAMILIES = {
    "llama": "llama",
    "qwen2": "llama",
    "mistral": "llama",  # mistral: llama's code
    "gpt2": "gpt2",
    "gpt_neox": "neox",
    "bert": "bert",
    "roberta": "bert",
}
INT_INPUT_BYTES = 16  # input ids and labels (int64) saved by the embedding and the loss


@dataclass(frozen=True)
class LayerShape:
    """The sizes a layer's saved activations depend on, read from the HF config."""

    family: str  # a value of FAMILIES: llama (RMSNorm, rotary, SwiGLU), gpt2, neox, bert (post-LN)
    hidden: int
    intermediate: int
    num_heads: int
    q_dim: int  # num_heads * head_dim
    kv_dim: int  # num_kv_heads * head_dim
    num_layers: int
    vocab: int
    loss_upcast: bool  # HF's causal-LM loss casts the logits to fp32; BERT's masked LM does not
    tied: bool = False  # the head's weight is the input embedding's (tie_word_embeddings)
    parallel_residual: bool = True  # neox: attention and MLP both read the layer's input
    attention_dropout: bool = False  # dropout on the attention probabilities
    hidden_dropouts: int = 0  # dropouts of the hidden size per layer (after attention, MLP)
    embedding_dropout: bool = False  # a dropout on the embeddings' output


def _split(nbytes: int, ways: int) -> int:
    return -(-nbytes // ways)


def layer_bytes_per_token(
    s: LayerShape, b: int, *, tensor: int = 1, sequence_parallel: bool = False
) -> int:
    """Bytes one layer saves per token, its input included, computing in ``b``-byte dtype, on
    one rank of a ``tensor``-way TP group (TP plans exist for the Llama family only)."""
    h, i = s.hidden, s.intermediate
    lse = FP32 * s.num_heads  # sdpa's logsumexp, fp32 whatever the compute dtype
    match s.family:
        case "llama":
            # Two RMSNorms, each: its input upcast to fp32, 1/rms (fp32), the normalised and the
            # scaled output; attention: rotated q and k, v, output; SwiGLU: gate, up, silu, product.
            # TP splits attention (by heads) and the MLP (by width); the norms stay whole, or
            # with sequence parallelism run on 1/tensor of the rows, and the linear layers after
            # them save the all-gathered input instead of the norm's scaled output. Measured
            # exactly on a fake group (tests/unit/tools/test_plan.py).
            split = _split(b * (2 * s.q_dim + 2 * s.kv_dim + 4 * i) + lse, tensor)
            if sequence_parallel and tensor > 1:
                norms = 2 * (_split(FP32 * h + FP32 + b * h, tensor) + b * h)
            else:
                norms = 2 * (FP32 * h + FP32 + 2 * b * h)
            return norms + split
        case "gpt2":
            # ln_1/ln_2: input, mean, rstd, output each; the fused qkv (3h: q, k and v are views
            # of it) and attention's output; MLP: c_fc out and gelu-tanh's four saves.
            return b * (8 * h + 5 * i + 4) + lse
        case "neox":
            # One LayerNorm input (the layer's, read by both norms under the parallel residual;
            # else the attention's sum too), two means, rstds and outputs; the fused qkv, the
            # rotated q and k (partial rotary rebuilds them whole), attention's output and
            # dense's input; MLP: dense_h_to_4h's output (exact GELU's input) and GELU's output.
            # Measured with saved_tensors_hooks (tests/unit/tools/test_plan.py).
            serial = 0 if s.parallel_residual else b * h
            return b * (10 * h + 2 * i + 4) + lse + serial
        case "bert":
            # Input (for q, k, v), q, k, v, attention output, two post-LayerNorms (input,
            # mean, rstd; one output), the intermediate and its GELU.
            return b * (8 * h + 2 * i + 4) + lse
        case _:
            raise ValueError(f"unknown layer family {s.family}")


def dropout_bytes_per_token(
    s: LayerShape, b: int, *, seq_len: int, cpu_kernels: bool, tensor: int = 1
) -> int:
    """Bytes one layer's dropouts add per token, measured with saved_tensors_hooks. Each
    dropout keeps its mask: on CPU ``at::dropout`` multiplies by a noise tensor of the input's
    dtype (b bytes an element), CUDA's fused kernel keeps a bool mask. Attention dropout on CPU
    has no fused sdpa kernel: the math path, in fp32 whatever the compute dtype, keeps q, k and
    v (k and v repeated to every head), the probabilities, their noise and the dropped
    probabilities (heads x seq each per token) in place of the fused path's q/k/v storages and
    logsumexp; CUDA's flash and memory-efficient kernels keep only their RNG state (CUDA's
    figures are read from torch's source, not measured: no GPU in the tests)."""
    hidden = s.hidden_dropouts * (b if cpu_kernels else 1) * s.hidden
    if not (s.attention_dropout and cpu_kernels):
        return hidden
    # What the fused path keeps of q, k and v: NeoX's rotated q and k, its fused qkv and
    # sdpa's output (dense reads a copy of it); the others' q, k, v (GPT-2's fused qkv).
    fused = b * (6 * s.hidden if s.family == "neox" else s.q_dim + 2 * s.kv_dim)
    math = FP32 * (3 * s.q_dim + 3 * s.num_heads * seq_len)
    return hidden + _split(math - fused - FP32 * s.num_heads, tensor)


def head_bytes_per_token(s: LayerShape, b: int, *, fused_loss: bool = False) -> int:
    """Bytes saved outside the layers per token: the final norm (and BERT's embedding norm and
    prediction transform), the log-softmax over the vocabulary, the int inputs. A fused loss
    (``train.loss``) saves no log-softmax and no labels: the gradient over the hidden states
    it keeps instead is the size of the head's input, which it no longer saves."""
    loss = 0 if fused_loss else (FP32 if s.loss_upcast else b) * s.vocab
    ints = INT_INPUT_BYTES // 2 if fused_loss else INT_INPUT_BYTES
    h = s.hidden
    match s.family:
        case "llama":
            return FP32 * h + FP32 + 2 * b * h + loss + ints
        case "gpt2" | "neox":
            return b * (2 * h + 2) + loss + ints
        case "bert":
            return b * (5 * h + 4) + loss + ints
        case _:
            raise ValueError(f"unknown layer family {s.family}")


# Dropout probabilities by where they apply, as transformers' configs name them: GPT-2, the
# Llama family, NeoX, BERT, and OPT-style `dropout`.
ATTENTION_DROPOUTS = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")
HIDDEN_DROPOUTS = ("resid_pdrop", "hidden_dropout", "hidden_dropout_prob", "dropout")
EMBEDDING_DROPOUTS = ("embd_pdrop", "hidden_dropout", "hidden_dropout_prob", "dropout")


def _dropout_on(hf_config, fields: tuple[str, ...]) -> bool:
    return any(float(getattr(hf_config, f, None) or 0) > 0 for f in fields)


def layer_shape(hf_config, task: ModelTask) -> tuple[LayerShape, list[str]]:
    """A transformers config's sizes (any family's attribute names), and what was assumed."""
    notes = []
    family = FAMILIES.get(hf_config.model_type)
    if family is None:
        family = "llama"
        notes.append(
            f"activations: no layer model for model_type={hf_config.model_type}; "
            "estimated as a Llama-style layer (RMSNorm, rotary, SwiGLU)"
        )
    h, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or h // heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    inter = (
        getattr(hf_config, "intermediate_size", None)
        or getattr(hf_config, "n_inner", None)
        or 4 * h
    )
    return LayerShape(
        family=family,
        hidden=h,
        intermediate=inter,
        num_heads=heads,
        q_dim=heads * head_dim,
        kv_dim=kv_heads * head_dim,
        num_layers=hf_config.num_hidden_layers,
        vocab=hf_config.vocab_size,
        loss_upcast=task is ModelTask.causal_lm,
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        parallel_residual=bool(getattr(hf_config, "use_parallel_residual", True)),
        attention_dropout=_dropout_on(hf_config, ATTENTION_DROPOUTS),
        # after attention and after the MLP, as GPT-2, NeoX and BERT place them
        hidden_dropouts=2 * _dropout_on(hf_config, HIDDEN_DROPOUTS),
        embedding_dropout=_dropout_on(hf_config, EMBEDDING_DROPOUTS),
    ), notes


@dataclass(frozen=True)
class Activations:
    saved: int  # bytes saved for backward at the end of forward (one micro-batch)
    loss_grad: int  # transient around the loss: the logits' gradients at the start of backward
    # (the model's loss), or a chunk's logits at the end of forward (a fused loss)
    recompute: int  # transient in backward: the last layer recomputed, if it is checkpointed
    layer_grads: int  # transient in backward: a layer's in-flight activation gradients
    head: int  # the part of `saved` that the head's backward frees before any layer's

    @property
    def backward(self) -> int:
        """Autograd's working memory beyond the saved activations, at its largest: the logits'
        gradients at its start, or the last layer's (recomputed) backward after the head's."""
        return max(self.loss_grad, self.recompute + self.layer_grads - self.head)


# Many parameters: the layer's shape and each setting that changes what it saves (keyword-only).
def activations(
    s: LayerShape,
    *,
    batch: int,
    seq_len: int,
    b: int,
    num_checkpointed: int,
    last_checkpointed: bool = False,
    loss_chunk: int | None = None,
    tensor: int = 1,
    sequence_parallel: bool = False,
    cpu_kernels: bool = False,
) -> Activations:
    """A checkpointed layer keeps only its input (the hidden states; fsdp_lab trains without
    a KV cache, see model.build_hf_config) and recomputes the rest in backward, one layer at a
    time. The recomputation adds to the peak only where nothing was freed before it: at the last
    layer (backward's first); an earlier one follows the freeing of the layers after it.

    ``loss_chunk``: the tokens per chunk of a fused loss (None: the model's own loss). It
    computes its gradients in forward: it saves the head weight's gradient (V x H) and, while it
    runs, holds one chunk's fp32 logits and log-softmax (8 bytes per logit).

    ``tensor``, ``sequence_parallel``: one rank of a TP group (``layer_bytes_per_token``); a
    checkpointed layer's input is then 1/tensor of the rows with sequence parallelism.

    ``cpu_kernels``: the ops run on CPU, whose dropouts keep more (``dropout_bytes_per_token``)."""
    tokens = batch * seq_len
    fused = loss_chunk is not None
    sp = sequence_parallel and tensor > 1
    layer = layer_bytes_per_token(s, b, tensor=tensor, sequence_parallel=sp)
    layer += dropout_bytes_per_token(s, b, seq_len=seq_len, cpu_kernels=cpu_kernels, tensor=tensor)
    embedding = s.hidden * (b if cpu_kernels else 1) if s.embedding_dropout else 0
    kept = _split(b * s.hidden, tensor) if sp else b * s.hidden
    head = head_bytes_per_token(s, b, fused_loss=fused)
    per_token = (s.num_layers - num_checkpointed) * layer + num_checkpointed * kept + head
    per_token += embedding
    rotary = 2 * seq_len * (s.q_dim // s.num_heads) * b if s.family == "llama" else 0
    if fused:
        loss_grad = min(loss_chunk, tokens) * s.vocab * 2 * FP32
        weight_grad = s.vocab * s.hidden * b
    else:
        loss_b = FP32 if s.loss_upcast else b
        # nll_loss's and log_softmax's gradients over the logits, and their cast back to b.
        loss_grad = tokens * s.vocab * (2 * loss_b + (b if loss_b != b else 0))
        weight_grad = 0
    # The widest backward step holds two gradients of the MLP's width (measured: SwiGLU's mul).
    layer_grads = 2 * tokens * b * max(_split(s.intermediate, tensor), s.hidden)
    return Activations(
        saved=tokens * per_token + rotary + weight_grad,
        loss_grad=loss_grad,
        recompute=tokens * layer if last_checkpointed else 0,
        layer_grads=layer_grads,
        head=tokens * head + weight_grad,
    )
