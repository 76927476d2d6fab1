"""Which file tensors make each model tensor, as transformers reads a checkpoint.

A checkpoint's keys are not always the model's: transformers 5 renames some at load and merges
others (a Mixtral's one tensor per expert, ``block_sparse_moe.experts.0.w1.weight``, into the
model's fused ``mlp.experts.gate_up_proj``), and writes them back at save. ``plan_loading``
asks transformers' own conversion mapping for the model (``conversion_mapping``,
``core_model_loading``) and returns, per model tensor, its source keys and the conversion that
builds it from them; ``plan_saving`` the reverse, one group at a time, for an export. Checked
here, before any rank reads a byte: every model tensor has its sources, every file tensor is
used, and every shape is the model's.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass, field

import torch
from torch import nn

from fsdp_lab.config import ConfigError
from fsdp_lab.engine.activations import clean_name
from fsdp_lab.internals import torch_private, transformers_private

_SHOWN = 3  # keys named in an error
LORA_BASE = ".base_layer"  # PEFT's wrapped layer: q_proj.base_layer.weight is q_proj.weight


class NotPerRank(Exception):
    """The checkpoint cannot be read per rank; says why (before anything was read)."""


def checkpoint_key(name: str) -> str:
    """A model parameter's name as the checkpoint holds it: without activation-checkpoint
    wrappers and PEFT's ``base_layer``."""
    return clean_name(name).replace(LORA_BASE + ".", ".")


def owned_tensors(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Every parameter and persistent buffer once (a tied one under its first name), by its
    clean name: (owning module, attribute, tensor)."""
    out: dict[str, tuple[nn.Module, str, torch.Tensor]] = {}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for attr, t in torch_private.own_tensors(module):
            if id(t) in seen:
                continue
            seen.add(id(t))
            out[clean_name(f"{mod_name}.{attr}" if mod_name else attr)] = (module, attr, t)
    return out


@dataclass(frozen=True)
class Source:
    """A model tensor's file tensors, and how to build it from them (None: it is the one)."""

    keys: list[str]
    convert: Callable[[list[torch.Tensor]], torch.Tensor] | None = None

    def read(self, files, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The model tensor from ``files`` (``weights.WeightFiles``), in the file's dtype, or
        only ``region`` of it: a plain one reads just those bytes; a converted one is built
        whole from its sources, then sliced."""
        if self.convert is None:
            return files.read(self.keys[0], region)
        whole = self.convert([files.read(k) for k in self.keys])
        return whole if region is None else whole[region]


@dataclass
class LoadPlan:
    sources: dict[str, Source] = field(default_factory=dict)  # by the run model's clean name


def _shown(keys: list[str]) -> str:
    return ", ".join(keys[:_SHOWN]) + (", ..." if len(keys) > _SHOWN else "")


def plan_loading(model: nn.Module, files, name_or_path: str) -> LoadPlan:
    """The file tensors of every tensor of ``model`` a checkpoint holds (LoRA adapters are not
    held: they are initialised). Raises ``ConfigError`` naming the first few keys for a model
    tensor the checkpoint lacks, a file tensor the model has no place for, or a shape that
    differs; ``NotPerRank`` for a conversion that cannot be planned per tensor."""
    setting = f"model.name_or_path={name_or_path}"
    shapes = files.shapes()
    plain = plain_meta(model)
    by_key, unused = _sources(plain, shapes)
    tied = getattr(plain, "all_tied_weights_keys", None) or {}  # alias -> the tensor it is
    for group in ([alias, target] for alias, target in tied.items()):
        # a tied tensor is read under whichever of its names the file holds
        found = next((by_key[k] for k in group if k in by_key), None)
        for k in group if found is not None else []:
            by_key.setdefault(k, found)
    owned = owned_tensors(model)
    wanted = {name: checkpoint_key(name) for name in owned if not is_adapter(name)}
    missing = sorted(key for key in wanted.values() if key not in by_key)
    if missing:
        raise ConfigError(
            f"{setting}: the checkpoint lacks {len(missing)} of the model's tensors "
            f"({_shown(missing)}); its config.json and weights come from different models"
        )
    ignore = [
        re.compile(p) for p in transformers_private.keys_to_ignore(plain, "on_load_unexpected")
    ]
    unused = sorted(k for k in unused if not any(p.search(k) for p in ignore))
    if unused:
        raise ConfigError(
            f"{setting}: {len(unused)} tensor(s) of the checkpoint have no place in "
            f"{type(plain).__name__} ({_shown(unused)}); the weights and config.json come "
            "from different models"
        )
    plan = LoadPlan({name: by_key[key] for name, key in wanted.items()})
    wrong = []
    for name, source in plan.sources.items():
        want, got = tuple(owned[name][2].shape), _built_shape(source, shapes)
        if got != want:
            wrong.append(f"{wanted[name]} is {list(got)} in the file, {list(want)} in the model")
    if wrong:
        raise ConfigError(
            f"{setting}: {len(wrong)} tensor(s) disagree with its config.json "
            f"({'; '.join(wrong[:_SHOWN])}); the weights and config.json come from different "
            "models"
        )
    return plan


def is_adapter(name: str) -> bool:
    """A LoRA adapter's tensor (``q_proj.lora_A.default.weight``): no checkpoint holds it."""
    return ".lora_" in name


def plain_meta(model: nn.Module) -> nn.Module:
    """The transformers model ``model`` is (or wraps) as transformers built it, on meta: no
    FSDP class renames, no checkpoint wrappers, no adapters. Its names are checkpoint keys."""
    from transformers import PreTrainedModel

    top = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if top is None:
        raise ValueError(f"{type(model).__name__} holds no transformers model")
    cls = next(
        c
        for c in type(top).__mro__
        if issubclass(c, PreTrainedModel) and not c.__name__.startswith("FSDP")
    )
    if cls is type(top) and not _is_wrapped(model):
        return top
    with torch.device("meta"):
        return cls(top.config)


def _is_wrapped(model: nn.Module) -> bool:
    return any(
        is_adapter(n) or "_checkpoint_wrapped_module" in n for n, _ in model.named_parameters()
    )


def _built_shape(source: Source, shapes: dict) -> tuple[int, ...]:
    if source.convert is None:
        return tuple(shapes[source.keys[0]])
    metas = [torch.empty(shapes[k], device="meta") for k in source.keys]
    return tuple(source.convert(metas).shape)


def _split(transforms):
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters, {p: c for c in converters for p in c.source_patterns}


def _sources(plain: nn.Module, shapes: dict) -> tuple[dict[str, Source], list[str]]:
    """(model key -> its Source, the file keys no model tensor uses), walking the keys as
    transformers' ``convert_and_load_state_dict_in_model`` does: its renamings, then at most
    one converter a key, keys in its natural order (experts 0, 1, ... 10); the base model's
    prefix added or dropped where the file has the other form."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters, by_pattern = _split(get_model_conversion_mapping(plain, None, None))
    meta_sd = plain.state_dict()
    prefix = plain.base_model_prefix
    groups: dict[str, tuple] = {}  # first target -> (converter or None, {pattern: [file keys]})
    unused = []
    for key in sorted(shapes, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, prefix, meta_sd)
        if renamed not in meta_sd and key in meta_sd:
            renamed, pattern = key, None
        if renamed not in meta_sd:
            unused.append(key)
            continue
        converter = by_pattern[pattern] if pattern is not None else None
        _, sources = groups.setdefault(renamed, (converter, {}))
        sources.setdefault(pattern if pattern is not None else key, []).append(key)
    out: dict[str, Source] = {}
    for first, (converter, sources) in groups.items():
        keys = [k for ks in sources.values() for k in ks]
        if converter is None:
            out[first] = Source(keys[:1])
            continue
        if len(converter.target_patterns) > 1:  # one file tensor into several: not per tensor
            raise NotPerRank(
                f"transformers splits {keys[0]} into {len(converter.target_patterns)} tensors"
            )
        out[first] = Source(keys, _converting(converter, first, sources, plain))
    return out, unused


def _converting(converter, first: str, sources: dict[str, list[str]], plain: nn.Module):
    """``convert(tensors)``: the converter's operations on the file tensors, given in the order
    of ``sources``' lists."""

    def convert(tensors: list[torch.Tensor]) -> torch.Tensor:
        return _run(converter, first, sources, tensors, plain)[first]

    return convert


def _run(converter, first: str, sources: dict[str, list], tensors, plain) -> dict:
    """transformers' own ``WeightConverter.convert`` on a copy of ``converter`` given
    ``tensors`` (in the order of ``sources``' lists): its outputs by key, each one tensor."""

    step = deepcopy(converter)
    at = 0
    for pattern, keys in sources.items():
        step.collected_tensors[pattern] = list(tensors[at : at + len(keys)])
        at += len(keys)
    out = step.convert(first, model=plain, config=plain.config)
    return {k: v[0] if isinstance(v, list) else v for k, v in out.items()}


def plan_saving(plain: nn.Module, keys) -> list[tuple[list[str], Callable]]:
    """The groups an export writes, in order: (model keys, ``save(dict key -> tensor) -> dict
    file key -> tensor``), as ``save_pretrained`` writes them (transformers'
    ``revert_weight_conversion``, one group at a time: one fused experts tensor into one tensor
    per expert). Tied aliases and the model's ``_keys_to_ignore_on_save`` are left out."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        apply_converters,
        apply_renamings,
        dot_natural_key,
    )

    keys = set(keys)
    for alias, target in (getattr(plain, "all_tied_weights_keys", None) or {}).items():
        if alias in keys and target in keys:
            keys.discard(alias)
    keys -= set(transformers_private.keys_to_ignore(plain, "on_save"))
    transforms = [
        t
        for t in get_model_conversion_mapping(plain, add_legacy=False)
        if not isinstance(t, PrefixChange)
    ]
    renamings, converters, by_pattern = _split([t.reverse_transform() for t in transforms[::-1]])
    groups: dict[str, tuple] = {}
    for key in sorted(keys, key=dot_natural_key):
        renamed, pattern = apply_converters(key, converters)
        if pattern is None:
            renamed, converter, pattern = apply_renamings(key, renamings), None, key
        else:
            converter = by_pattern[pattern]
        _, sources = groups.setdefault(renamed, (converter, {}))
        sources.setdefault(pattern, []).append(key)
    out = []
    for first, (converter, sources) in groups.items():
        model_keys = [k for ks in sources.values() for k in ks]
        out.append((model_keys, _saving(converter, first, sources, plain, renamings)))
    return out


def _saving(converter, first: str, sources: dict, plain: nn.Module, renamings):
    from transformers.core_model_loading import apply_renamings

    model_keys = [k for ks in sources.values() for k in ks]
    if converter is None:
        return lambda values: {first: values[model_keys[0]].contiguous()}

    def save(values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = _run(converter, first, sources, [values[k] for k in model_keys], plain)
        return {apply_renamings(k, renamings): v.contiguous() for k, v in out.items()}

    return save
