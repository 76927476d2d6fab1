"""A training forward's attention masks, made by fsdp_lab from what the loader knows, through
transformers' extension points (nothing in transformers replaced).

transformers 5 builds each forward's mask itself. Given no mask, a decoder makes position ids and
asks ``masking_utils.find_packed_sequence_indices`` whether they restart within a row (sequences
packed with position resets), which reads a device tensor: a host sync on every forward. A
training step's rows need no such question: the loader knows on the host whether its rows are
packed, and which sequence each token belongs to (``sequence_index``).

- ``install(model)`` registers, in ``AttentionInterface``, ``fsdp_lab_<impl>``: transformers'
  own ``<impl>`` attention (SDPA's, flash's, flex's; a model's own eager function) under a name
  with no mask function. A model set to it builds no mask and reads nothing: it attends with
  the mask it is given, or causally where it is given none (SDPA's ``is_causal``, the kernel it
  runs on unpacked rows anyway).
- ``training_mask(model, ...)`` makes the masks transformers would make, with its own builders
  (``create_causal_mask``, ``create_sliding_window_causal_mask``) under ``<impl>``, with no
  position ids to check: None where the kernel's causal flag does it; a sliding window's where
  the rows are longer than it; packed rows' within their sequence (the builders'
  ``and_mask_function``). Bit for bit what transformers computes (``tests/unit/train``).
- ``transformers_masks(model)``: forwards that bring their own padding masks (generation,
  lm-eval's scoring) run the model's own implementation, its masks built by transformers.

An encoder (BERT) and XLA's models keep transformers' own path. Context parallelism registers
an attention of its own (``engine.context_parallel``), which takes the place of this one.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
from torch import nn

from fsdp_lab.internals import transformers_private

PREFIX = "fsdp_lab_"
FULL, SLIDING = "full_attention", "sliding_attention"
BUILDERS = {FULL: "create_causal_mask", SLIDING: "create_sliding_window_causal_mask"}
_INSTALLED: dict[str, str] = {}  # registered name -> the <impl> it runs


class _Attention:
    """transformers' own ``base`` attention (transformers' attention signature)."""

    def __init__(self, base: str) -> None:
        self.base = base

    def __call__(self, module: nn.Module, query, key, value, attention_mask, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if self.base in ALL_ATTENTION_FUNCTIONS:
            forward = ALL_ATTENTION_FUNCTIONS[self.base]
        else:  # eager: each model's own function, beside its attention module
            forward = sys.modules[type(module).__module__].eager_attention_forward
        return forward(module, query, key, value, attention_mask, **kwargs)


def install(model: nn.Module) -> None:
    """Make ``model`` attend through ``fsdp_lab_<impl>`` (its implementation now), which takes
    the masks ``training_mask`` makes; a model with no eager function of its own to fall back
    on keeps transformers' path."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = model.config
    base = transformers_private.implementation(config, "attn")
    known = base in ALL_ATTENTION_FUNCTIONS
    if not known and not hasattr(sys.modules[type(model).__module__], "eager_attention_forward"):
        return
    if any(kind not in BUILDERS for kind in layer_kinds(config)):
        return  # layers whose masks the builders here do not make (chunked, linear)
    name = f"{PREFIX}{base}"
    if name not in _INSTALLED:
        AttentionInterface.register(name, _Attention(base))
        _INSTALLED[name] = base
    model.set_attn_implementation(name)


def base_of(model: nn.Module) -> str | None:
    """The implementation ``install`` stood in for, or None where it did not."""
    name = transformers_private.implementation(getattr(model, "config", None), "attn")
    return _INSTALLED.get(name) if name is not None else None


def layer_kinds(config) -> list[str]:
    """The kinds of attention the model's layers run: ``config.layer_types``' where it has
    them, else one: sliding where the config sets a window (Mistral, Mixtral), else full."""
    types = getattr(config, "layer_types", None)
    if types:
        return sorted(set(types))
    return [SLIDING if getattr(config, "sliding_window", None) else FULL]


def training_mask(
    model: nn.Module,
    input_ids: torch.Tensor,
    *,
    sequence_index: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    dtype: torch.dtype,
):
    """The ``attention_mask`` of a training forward of ``input_ids`` (B x T) for a model
    ``install`` set up: None (causal), a mask in its implementation's form (SDPA: booleans;
    eager: ``dtype``'s additive mask; flex: a block mask), or a dict of them by layer type.
    Packed rows: ``sequence_index`` (the loader's), else found from ``position_ids`` on the
    device (their restarts' cumulative sum, as transformers finds them, without reading)."""
    from transformers import masking_utils

    # The builders read the implementation off the config: a copy of it under <impl>.
    base = _INSTALLED[transformers_private.implementation(model.config, "attn")]
    config = transformers_private.with_implementation(model.config, "attn", base)
    if sequence_index is None and position_ids is not None:
        restarts = torch.diff(position_ids, dim=-1, prepend=position_ids[..., :1] - 1) != 1
        sequence_index = restarts.cumsum(-1).expand(input_ids.shape)
    same = (
        None
        if sequence_index is None
        else masking_utils.packed_sequence_mask_function(sequence_index)
    )
    # The builders read the batch, length, dtype and device off the embeddings, nothing else.
    like = torch.empty(*input_ids.shape, 0, dtype=dtype, device=input_ids.device)
    kinds = layer_kinds(config)
    masks = {
        kind: getattr(masking_utils, BUILDERS[kind])(
            config, like, None, None, and_mask_function=same
        )
        for kind in kinds
    }
    return masks[kinds[0]] if len(kinds) == 1 else masks


@contextlib.contextmanager
def implementation(model: nn.Module, name: str | None) -> Iterator[None]:
    """Within the block ``model`` attends with the implementation ``name`` (None: its own),
    its own again after."""
    if name is None:
        yield
        return
    current = transformers_private.implementation(model.config, "attn")
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def transformers_masks(model: nn.Module):
    """A block in which the model runs its own implementation, transformers building its masks
    (forwards that pass their own padding masks: generation, scoring)."""
    return implementation(model, base_of(model))
