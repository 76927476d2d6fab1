"""Context parallelism (``parallel.context=N``): every sequence split over the N ranks of a CP
group, the attention exact over the whole sequence.

The design is the Llama 3 paper's and torchtitan's, built from plain collectives (torch's own
``context_parallel`` maps only CUDA's SDPA kernels, and flex attention has no backward on CPU):

1. The loader gives each rank of a CP group the same rows and keeps 2 of their 2N chunks
   (``data.context``: head-tail, chunks r and 2N-1-r), labels shifted first, positions the
   row's own.
2. At every attention layer the rank all-gathers the group's keys and values: one collective
   for both (stacked; two autograd all-gathers in a row were measured to pair up wrongly in
   backward), of the KV heads only (grouped-query attention shares them over the query heads
   inside SDPA). The gathered chunks are put back in sequence order.
3. Each of the rank's two query chunks attends to the keys up to its own end, with the causal
   mask of their positions in the row (and, for packed rows, only to its own document; for a
   sliding-window layer, only within the window). Chunk c reads c+1 of the 2N chunks of keys,
   so every rank reads 2N+1: the head-tail split balances the work.
4. Backward is autograd's: the gathered keys' and values' gradients come back as a
   reduce-scatter (the all-gather's own backward, ``_GatherKeysValues``).

It reaches transformers through its extension point: the attention is registered in
``AttentionInterface`` under a name of its own and set as the model's implementation, with no
mask function, so transformers builds no mask for the split (local) sequence. A split forward
passes ``context_split=ContextSplit(...)``, which transformers hands every attention layer
with the rest of the model's keyword arguments. Generation and lm-eval's scoring run whole
sequences on every rank of the group: ``whole_sequences`` switches the model to SDPA for them,
and a forward of a split model without ``context_split`` fails instead of mixing sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right

from fsdp_lab.config import ConfigError, families
from fsdp_lab.config.profiling import CONTEXT_ALL_GATHER_REGION, CONTEXT_REDUCE_SCATTER_REGION
from fsdp_lab.config.topology import context_chunks
from fsdp_lab.engine import attention
from fsdp_lab.engine.hardware import devices, process_group
from fsdp_lab.internals import transformers_private

ATTENTION_PREFIX = "fsdp_lab_context"  # + the CP group's name: the registered implementation
WHOLE_SEQUENCES = "sdpa"  # what generation and scoring run, on every rank of the group


class _Masks:
    """A forward's masks by their shape and place. A plain object, not a dict: FSDP2 maps each
    unit's inputs (rebuilding dataclasses and dicts as it casts their tensors), and a dict would
    reach every layer as a copy of its own, each layer then building its own masks (measured:
    3x the masks' bytes more per rank at 16k tokens, 4 layers)."""

    def __init__(self) -> None:
        self.by_key: dict = {}


@dataclass(frozen=True)
class ContextSplit:
    """What a forward over split sequences tells the attention besides the tensors: the
    packed rows' documents, each position's in the whole row [B, T] (the loader's
    ``context_documents``); None: one sequence a row.

    It also keeps the forward's masks (``mask``): every layer attends with the same ones, so
    each is built once per forward, and what SDPA saves for backward is one tensor, shared by
    the layers, not a copy per layer."""

    documents: torch.Tensor | None = None
    _masks: _Masks = field(default_factory=lambda: _Masks(), compare=False, repr=False)

    def mask(
        self,
        chunk: int,
        size: int,
        *,
        keys: tuple[int, int],
        window: int | None,
        like: torch.Tensor,
    ):
        """The mask of query chunk ``chunk`` (``size`` positions from chunk * size) over the
        keys at row positions ``keys`` = [start, end): causal, within the window, within the
        document. None where SDPA's own ``is_causal`` is it (a square causal block); torch's
        lower-right causal bias where the device applies it in place (``hardware``); else an
        additive mask in ``like``'s dtype, [B or 1, 1, size, end - start], built once."""
        start, end = keys
        plain = self.documents is None and window is None and start == 0
        if plain and chunk == 0:
            return None
        if plain and devices.sdpa_applies_causal_bias(like.device, like.dtype):
            return causal_lower_right(size, end)
        key = (chunk, size, start, end, window, like.dtype, like.device)
        built = self._masks.by_key
        if key not in built:
            built[key] = _additive_mask(chunk, size, keys, self.documents, window, like)
        return built[key]


def _additive_mask(chunk, size, keys, documents, window, like) -> torch.Tensor:
    """0 where a query may attend, -inf elsewhere (every query sees at least itself)."""
    start, end = keys
    q = torch.arange(chunk * size, (chunk + 1) * size, device=like.device)
    k = torch.arange(start, end, device=like.device)
    allowed = q[:, None] >= k[None, :]
    if window is not None:  # transformers' sliding window: a key within the last `window`
        allowed = allowed & (q[:, None] - k[None, :] < window)
    if documents is not None:
        allowed = (allowed & (documents[:, q, None] == documents[:, None, k]))[:, None]
    mask = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device)
    return mask.masked_fill_(~allowed, float("-inf"))


class _GatherKeysValues(torch.autograd.Function):
    """All-gather on dim 0 over the CP group; backward: reduce-scatter (sum) of the gradient,
    each rank getting its own part's. Both annotated for the profiler."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        with torch.profiler.record_function(CONTEXT_ALL_GATHER_REGION):
            process_group.all_gather_single(out, local.contiguous(), group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty((grad.shape[0] // ctx.size, *grad.shape[1:]))
        with torch.profiler.record_function(CONTEXT_REDUCE_SCATTER_REGION):
            process_group.reduce_scatter_single(out, grad.contiguous(), ctx.group)
        return out, None, None


def gather_in_order(
    key: torch.Tensor, value: torch.Tensor, *, group: dist.ProcessGroup, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's keys and values ([B, H, 2S, D] each: its two chunks) as the whole
    sequence's, in order ([B, H, 2N*S, D]), from one all-gather."""
    batch, heads, local, dim = key.shape
    chunk = local // 2
    gathered = _GatherKeysValues.apply(torch.stack([key, value]), group, size)
    # [k/v, B, H, rank, slot, S, D] (a view): rank r holds chunk r in slot 0, chunk 2N-1-r in
    # slot 1; chunks 0..N-1 then N..2N-1 in order, in one copy.
    parts = gathered.view(size, 2, batch, heads, 2, chunk, dim).permute(1, 2, 3, 0, 4, 5, 6)
    ordered = torch.cat([parts[..., 0, :, :], parts.flip(3)[..., 1, :, :]], dim=3)
    whole = ordered.view(2, batch, heads, 2 * size * chunk, dim)
    return whole[0], whole[1]


class ContextAttention:
    """The attention of a model split over one CP group (transformers' attention signature)."""

    def __init__(self, group: dist.ProcessGroup, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    # Many parameters: transformers' attention signature, and the split's one keyword.
    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        sliding_window: int | None = None,
        context_split: ContextSplit | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        """``query`` [B, H, 2S, D], ``key`` and ``value`` [B, Hkv, 2S, D]: this rank's two
        chunks. Returns the attention output [B, 2S, H, D] (transformers' layout) and no
        weights."""
        if context_split is None:
            raise RuntimeError(
                "context-parallel attention without context_split: this model's sequences are "
                "split over its CP group; run whole sequences inside "
                "engine.context_parallel.whole_sequences(model)"
            )
        if attention_mask is not None or kwargs.get("softcap") is not None:
            raise RuntimeError(
                f"{type(module).__name__}: context-parallel attention got an attention mask or "
                "soft-capping, which it does not reproduce (config.families' context_parallel)"
            )
        keys, values = gather_in_order(key, value, group=self.group, size=self.size)
        chunk = query.shape[2] // 2
        gqa = query.shape[1] != key.shape[1]
        outs = []
        for slot, index in enumerate(context_chunks(self.size, self.rank)):
            end = (index + 1) * chunk
            # A window as long as the keys read is no window (Mistral's 4096 at 4k tokens);
            # keys before every query's window are masked whole: not read at all.
            window = sliding_window if sliding_window is not None and sliding_window < end else None
            start = 0 if window is None else max(0, index * chunk - window + 1)
            mask = context_split.mask(index, chunk, keys=(start, end), window=window, like=query)
            outs.append(
                F.scaled_dot_product_attention(
                    query[:, :, slot * chunk : (slot + 1) * chunk],
                    keys[:, :, start:end],
                    values[:, :, start:end],
                    attn_mask=mask,
                    dropout_p=dropout,
                    is_causal=mask is None,
                    scale=scaling,
                    enable_gqa=gqa,
                )
            )
        # [B, 2S, H, D], transformers' layout, in one copy
        return torch.cat([out.transpose(1, 2) for out in outs], dim=1), None


def check(hf_config, context: int) -> None:
    """A model whose attention CP reproduces (its family's row), refused in one line if not."""
    if context == 1:
        return
    model_type = getattr(hf_config, "model_type", "?")
    row = families.family_of(model_type)
    if row is None or not row.context_parallel:
        runs = ", ".join(families.context_parallel_types())
        raise ConfigError(
            f"parallel.context={context}: context parallelism does not reproduce the attention "
            f"of model_type={model_type} (it runs {runs}); set parallel.context=1"
        )


def apply(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split the model's attention over ``mesh`` (the CP sub-mesh): register its attention
    under a name of this group and make it the model's implementation."""
    from transformers import AttentionInterface

    group = mesh.get_group()
    attention = ContextAttention(group, mesh.size(), mesh.get_local_rank())
    name = f"{ATTENTION_PREFIX}_{group.group_name}"
    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)


def is_split(model: nn.Module) -> bool:
    """Whether ``model``'s attention is context-parallel."""
    impl = transformers_private.implementation(getattr(model, "config", None), "attn")
    return impl is not None and impl.startswith(ATTENTION_PREFIX)


def whole_sequences(model: nn.Module):
    """A block in which a context-parallel model attends as SDPA does, over the whole sequences
    every rank of its group holds (generation, scoring); outside, over the split."""
    return attention.implementation(model, WHOLE_SEQUENCES if is_split(model) else None)
