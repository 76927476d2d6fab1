"""Per-token activation memory of a Hugging Face decoder (or BERT), from its config alone: what
autograd saves for backward in each layer, the head and the loss, and what activation
checkpointing keeps of it. The other half of ``fsdp-lab plan``'s arithmetic (``memory`` holds
the model state and FSDP2's working set). Pure: imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config import ModelTask, families
from fsdp_lab.config.model import task_row

FP32 = 4

# Activations: what autograd saves for backward, per token, read off HF's eager code (sdpa
# attention) and checked against torch.autograd.graph.saved_tensors_hooks (tests/test_plan.py);
# which layer model a model type takes is its row's `activations` (config.families).
INT_INPUT_BYTES = 16  # input ids and labels (int64) saved by the embedding and the loss


@dataclass(frozen=True)
class LayerShape:
    """The sizes a layer's saved activations depend on, read from the HF config."""

    family: str  # a families.Activations value: llama (RMSNorm, rotary, SwiGLU), gpt2, neox, bert
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
    experts: int = 0  # a mixture of experts: experts per layer (0: a dense MLP)
    top_k: int = 0  # experts each token is routed to
    expert_intermediate: int = 0  # an expert's width
    qk_norm: str = ""  # RMSNorm on q and k: "head" (per head: Qwen3), "full" (OLMoE), "" none
    sliding_window: int | None = None  # the window of its sliding-attention layers, if any


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
            # exactly on a fake group (tests/unit/planning/test_plan.py).
            mlp = b * 4 * i if not s.experts else _experts_bytes_per_token(s, b)
            split = _split(b * (2 * s.q_dim + 2 * s.kv_dim) + mlp + lse, tensor) + _qk_norm(s, b)
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
            # Measured with saved_tensors_hooks (tests/unit/planning/test_plan.py).
            serial = 0 if s.parallel_residual else b * h
            return b * (10 * h + 2 * i + 4) + lse + serial
        case "bert":
            # Input (for q, k, v), q, k, v, attention output, two post-LayerNorms (input,
            # mean, rstd; one output), the intermediate and its GELU.
            return b * (8 * h + 2 * i + 4) + lse
        case _:
            raise ValueError(f"unknown layer family {s.family}")


def op_kept_bytes_per_token(s: LayerShape, b: int, *, tensor: int = 1) -> int:
    """What a layer keeps under activation_checkpointing=op (``engine.activations``'s policy),
    per token: its input, attention's output and logsumexp, and the outputs of its odd
    matrix multiplies in forward order (the even ones recomputed). Llama: q, v, the MLP's gate
    and down projections (a mixture of experts' grouped GEMMs are not matmuls: its router's
    logits instead); GPT-2 and NeoX: the fused qkv and the MLP's first projection; BERT: q, v
    and the intermediate."""
    h, i, q, kv = s.hidden, s.intermediate, s.q_dim, s.kv_dim
    attention = _split(b * q + FP32 * s.num_heads, tensor)
    match s.family:
        case "llama":
            mlp = b * s.experts if s.experts else _split(b * i, tensor) + b * h
            return b * h + _split(b * (q + kv), tensor) + attention + mlp
        case "gpt2" | "neox":
            return b * h + _split(b * (3 * h + i), tensor) + attention
        case "bert":
            return b * h + _split(b * (2 * h + i), tensor) + attention
        case _:
            raise ValueError(f"unknown layer family {s.family}")


def _experts_bytes_per_token(s: LayerShape, b: int) -> int:
    """A routed experts block (transformers' grouped_mm kernel; eager and batched_mm keep more):
    the router's fp32 probabilities and one more fp32 a token; per routed copy of a token its
    input and output rows, the gate/up projection, SiLU and product, and 40 bytes of routing
    (indices, weights). Measured with saved_tensors_hooks for Qwen3-MoE, Mixtral and OLMoE."""
    return FP32 * (s.experts + 1) + s.top_k * (b * (2 * s.hidden + 4 * s.expert_intermediate) + 40)


def _qk_norm(s: LayerShape, b: int) -> int:
    """RMSNorm on q and k (Qwen3 per head, OLMoE over the whole projection): each keeps its
    fp32 input and 1/rms, and its scaled output."""
    match s.qk_norm:
        case "head":
            kv_heads = s.kv_dim // (s.q_dim // s.num_heads)
            rms = s.num_heads + kv_heads
        case "full":
            rms = 2
        case _:
            return 0
    return FP32 * (s.q_dim + s.kv_dim + rms) + b * (s.q_dim + s.kv_dim)


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
    row = families.family_of(hf_config.model_type)
    family = (row.activations if row else families.Activations.llama).value
    if row is None:
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
        loss_upcast=task_row(task).upcasts_logits,
        tied=bool(getattr(hf_config, "tie_word_embeddings", False)),
        parallel_residual=bool(getattr(hf_config, "use_parallel_residual", True)),
        attention_dropout=_dropout_on(hf_config, ATTENTION_DROPOUTS),
        # after attention and after the MLP, as GPT-2, NeoX and BERT place them
        hidden_dropouts=2 * _dropout_on(hf_config, HIDDEN_DROPOUTS),
        embedding_dropout=_dropout_on(hf_config, EMBEDDING_DROPOUTS),
        sliding_window=_sliding_window(hf_config),
        **_experts_shape(hf_config, notes),
    ), notes


def _sliding_window(hf_config) -> int | None:
    """The window of the layers that attend within one (transformers' ``layer_types``; a
    config without them, Mistral's, slides in every layer where it sets a window)."""
    window = getattr(hf_config, "sliding_window", None)
    types = getattr(hf_config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return window


def _experts_shape(hf_config, notes: list[str]) -> dict:
    """A mixture of experts' sizes (none for a dense model), and q/k normalisation."""
    experts = getattr(hf_config, "num_experts", None) or getattr(
        hf_config, "num_local_experts", None
    )
    row = families.family_of(hf_config.model_type)
    shape = {"qk_norm": row.qk_norm.value if row else ""}
    if not experts:
        return shape
    if getattr(hf_config, "mlp_only_layers", None) or getattr(
        hf_config, "decoder_sparse_step", 1
    ) not in (None, 1):
        notes.append("activations: every layer counted as a mixture of experts (some are dense)")
    width = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    return {
        **shape,
        "experts": experts,
        "top_k": hf_config.num_experts_per_tok,
        "expert_intermediate": width,
    }


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


@dataclass(frozen=True)
class RankBatch:
    """One rank's micro-batch and how it is computed: what every activation figure scales
    with (``planning.plan.rank_batch`` makes a run's)."""

    batch: int
    seq_len: int
    b: int  # bytes per element of the compute dtype
    tensor: int = 1  # one rank of a TP group (``layer_bytes_per_token``)
    sequence_parallel: bool = False
    cpu_kernels: bool = False  # the ops run on CPU, whose dropouts keep more
    context: ContextLayout | None = None  # one rank of a CP group


def activations(
    s: LayerShape,
    r: RankBatch,
    *,
    num_checkpointed: int,
    last_checkpointed: bool = False,
    loss_chunk: int | None = None,
    op: bool = False,
) -> Activations:
    """A checkpointed layer keeps only its input (the hidden states; fsdp_lab trains without
    a KV cache, see model.build_hf_config) and recomputes the rest in backward, one layer at a
    time. The recomputation adds to the peak only where nothing was freed before it: at the last
    layer (backward's first); an earlier one follows the freeing of the layers after it.

    ``loss_chunk``: the tokens per chunk of a fused loss (None: the model's own loss). It
    computes its gradients in forward: it saves the head weight's gradient (V x H) and, while it
    runs, holds one chunk's fp32 logits and log-softmax (8 bytes per logit).

    ``r``: one rank's micro-batch (``RankBatch``): under TP a checkpointed layer's input is
    1/tensor of the rows with sequence parallelism; under CP each rank keeps seq_len/N of each
    row's tokens, each layer's gathered keys and values and the forward's masks
    (``ContextLayout``). ``op``: a checkpointed layer keeps some operators' outputs too
    (activation_checkpointing=op, ``op_kept_bytes_per_token``)."""
    batch, seq_len, b, tensor, context = r.batch, r.seq_len, r.b, r.tensor, r.context
    sequence_parallel, cpu_kernels = r.sequence_parallel, r.cpu_kernels
    cp = context.size if context is not None else 1
    tokens = batch * seq_len // cp
    fused = loss_chunk is not None
    sp = sequence_parallel and tensor > 1
    layer = layer_bytes_per_token(s, b, tensor=tensor, sequence_parallel=sp)
    layer += dropout_bytes_per_token(s, b, seq_len=seq_len, cpu_kernels=cpu_kernels, tensor=tensor)
    embedding = s.hidden * (b if cpu_kernels else 1) if s.embedding_dropout else 0
    kept = _split(b * s.hidden, tensor) if sp else b * s.hidden
    kept = op_kept_bytes_per_token(s, b, tensor=tensor) if op else kept
    head = head_bytes_per_token(s, b, fused_loss=fused)
    per_token = (s.num_layers - num_checkpointed) * layer + num_checkpointed * kept + head
    per_token += embedding
    # The rotary tables, [1, T, head_dim] each; a CP split passes every row's positions: [B, ...]
    rows = batch if context is not None else 1
    rotary = 2 * rows * tokens // batch * (s.q_dim // s.num_heads) * b
    rotary = rotary if s.family == "llama" else 0
    split, masks, kv_grads = context.bytes(s, b, batch, seq_len, tensor) if context else (0, 0, 0)
    loss_grad, weight_grad = _loss_bytes(s, b, tokens=tokens, loss_chunk=loss_chunk)
    # The widest backward step holds two gradients of the MLP's width (measured: SwiGLU's mul),
    # or under CP the gathered keys' and values'.
    layer_grads = max(2 * tokens * b * max(_split(s.intermediate, tensor), s.hidden), kv_grads)
    layers = s.num_layers - num_checkpointed
    return Activations(
        saved=tokens * per_token + rotary + weight_grad + layers * split + masks,
        loss_grad=loss_grad,
        recompute=tokens * layer + split if last_checkpointed else 0,
        layer_grads=layer_grads,
        head=tokens * head + weight_grad,
    )


def _loss_bytes(s: LayerShape, b: int, *, tokens: int, loss_chunk: int | None) -> tuple[int, int]:
    """(the transient around the loss, the head weight's gradient a fused loss saves)."""
    if loss_chunk is not None:
        return min(loss_chunk, tokens) * s.vocab * 2 * FP32, s.vocab * s.hidden * b
    loss_b = FP32 if s.loss_upcast else b
    # nll_loss's and log_softmax's gradients over the logits, and their cast back to b.
    return tokens * s.vocab * (2 * loss_b + (b if loss_b != b else 0)), 0


@dataclass(frozen=True)
class ContextLayout:
    """One rank of a CP group as the plan counts it (``engine.context_parallel``): what its
    attention saves beyond the same layer over seq_len/N whole-sequence tokens, measured with
    saved_tensors_hooks on a fake group (tests/unit/planning/test_plan.py)."""

    size: int  # parallel.context
    dense_masks: bool
    """The forward's masks are tensors in memory (built once, shared by the layers): packed
    documents (one a row), a sliding window shorter than the sequence, or a plain causal mask
    that SDPA materialises (CPU; CUDA without its flash kernel, as in fp32). False: torch's
    lower-right causal bias, applied in place."""
    rows_masked: bool = False  # one mask per row (packed documents), else one for all rows

    def bytes(self, s: LayerShape, b: int, batch: int, seq_len: int, tensor: int) -> tuple:
        """(per layer, once per forward, backward's widest attention step) in bytes."""
        return (
            self.layer_bytes(s, b, batch=batch, seq_len=seq_len, tensor=tensor),
            self.mask_bytes(b, batch=batch, seq_len=seq_len),
            self.kv_grad_bytes(s, b, batch * seq_len, tensor),
        )

    def layer_bytes(self, s: LayerShape, b: int, *, batch: int, seq_len: int, tensor: int) -> int:
        """Per layer: the whole sequence's gathered keys and values in place of the rank's own,
        and each query chunk's output (SDPA's, besides the copy the output projection keeps)."""
        local, kv = batch * seq_len // self.size, _split(s.kv_dim, tensor)
        gathered = 2 * kv * b * batch * (seq_len - seq_len // self.size)
        return gathered + _split(s.q_dim, tensor) * b * local

    def mask_bytes(self, b: int, *, batch: int, seq_len: int) -> int:
        """Once per forward: a rank's two query chunks read 2N+1 chunks of keys, masked in the
        compute dtype (an additive mask)."""
        if not self.dense_masks:
            return 0
        chunk = seq_len // (2 * self.size)
        return (batch if self.rows_masked else 1) * chunk * chunk * (2 * self.size + 1) * b

    def kv_grad_bytes(self, s: LayerShape, b: int, tokens: int, tensor: int) -> int:
        """Backward's widest step in a layer's attention: the gathered keys' and values'
        gradients (in order, gathered, and the reduce-scatter's input)."""
        return 3 * tokens * 2 * _split(s.kv_dim, tensor) * b
