"""Tensor parallelism (``parallel.tensor``) from the model's own plan, before FSDP shards the rest.

Hugging Face configs carry a TP plan for their decoder layers (``config.base_model_tp_plan``:
``layers.*.self_attn.q_proj -> colwise`` ...). Its strings are mapped here onto torch's DTensor
parallel styles and applied with ``parallelize_module`` on the TP sub-mesh; ``fully_shard`` then
shards every parameter on the data-parallel sub-mesh (a TP-sharded weight becomes a 2D DTensor).

The embeddings and the head stay whole on the TP axis (replicated, sharded by FSDP only): the
chunked loss reads the head's weight as one matrix, and a tied head (Qwen2) stays tied to its
embedding. Those parameters live on the data-parallel mesh alone, the TP-sharded ones on both
axes, so gradient clipping groups the norms by mesh (``clip_grad_norm``).
"""

from __future__ import annotations

import fnmatch
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from fsdp_lab.config import ConfigError, ParallelConfig
from fsdp_lab.engine.hardware import process_group
from fsdp_lab.internals import torch_private

STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
}


def model_plan(model: nn.Module, cfg: ParallelConfig) -> dict[str, str]:
    """Full module pattern -> style name: ``parallel.plan``, else the config's
    ``base_model_tp_plan``, both relative to the base model (``model.`` for a causal LM)."""
    plan = cfg.plan if cfg.plan is not None else getattr(model.config, "base_model_tp_plan", None)
    if not plan:
        raise ConfigError(
            f"parallel.tensor={cfg.tensor}: {type(model).__name__} has no tensor-parallel plan "
            "(config.base_model_tp_plan); give one with parallel.plan={'layers.*.attn.c_attn': "
            "colwise, ...} or use parallel.tensor=1"
        )
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and not hasattr(model, prefix):
        prefix = ""  # the model is its own base model
    return {f"{prefix}.{k}" if prefix else k: v for k, v in dict(plan).items()}


@dataclass(frozen=True)
class Split:
    """One linear layer the plan splits over the TP ranks."""

    pattern: str  # the plan's pattern that matched it
    name: str
    module: nn.Module
    style: str

    @property
    def splits_output(self) -> bool:
        """colwise: the output features (the weight's rows) are split; rowwise: the input."""
        return self.style.startswith("colwise")


def splits(model: nn.Module, plan: dict[str, str]) -> list[Split]:
    """Every module each pattern of ``plan`` matches, in the plan's order."""
    names = [n for n, _ in model.named_modules()]
    return [
        Split(pattern, name, model.get_submodule(name), style)
        for pattern, style in plan.items()
        for name in names
        if fnmatch.fnmatchcase(name, pattern)
    ]


def check(model: nn.Module, cfg: ParallelConfig) -> dict[str, str]:
    """Refuse, before launch, a plan this model cannot take at this degree; the plan."""
    plan = model_plan(model, cfg)
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(
                f"parallel.plan: {pattern} has style {style!r}; use one of {sorted(STYLES)}"
            )
    found = splits(model, plan)
    for pattern in plan:
        if not any(s.pattern == pattern for s in found):
            linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][:6]
            raise ConfigError(
                f"parallel.plan: {pattern} matches no module of {type(model).__name__} "
                f"(its linear layers include {linear})"
            )
    for s in found:
        if not isinstance(s.module, nn.Linear):
            raise ConfigError(
                f"parallel.plan: {s.name} is a {type(s.module).__name__}; only nn.Linear "
                "layers are split by this plan"
            )
        dim = s.module.out_features if s.splits_output else s.module.in_features
        if dim % cfg.tensor:
            raise ConfigError(
                f"parallel.tensor={cfg.tensor} does not divide {s.name}'s "
                f"{'output' if s.splits_output else 'input'} size {dim}; "
                "use a TP degree that divides it"
            )
    c = model.config
    for field in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(c, field, None)
        if n is not None and n % cfg.tensor:
            raise ConfigError(
                f"parallel.tensor={cfg.tensor} does not divide the model's {field}={n}; use a "
                "TP degree that divides the head counts"
            )
    return plan


def apply(model: nn.Module, tp_mesh: DeviceMesh, cfg: ParallelConfig) -> None:
    """Split the plan's linear layers over ``tp_mesh`` (on meta: no memory is touched). The
    plan was checked on the whole model before launch (``check``); a pipeline rank's model may
    hold none of a pattern's layers (another stage's)."""
    plan = model_plan(model, cfg)
    # DTensor warns, once per rank, that reducing the (dp, tp) norm takes two all-reduces:
    # one scalar per step, not worth a flattened mesh.
    logging.getLogger(torch_private.REDISTRIBUTE_LOGGER).setLevel(logging.ERROR)
    styles = {k: STYLES[v]() for k, v in plan.items()}
    if cfg.sequence_parallel:
        styles = sequence_parallel_plan(model, plan)
    parallelize_module(model, tp_mesh, styles)


# The decoder layer's children sequence parallelism needs (Llama, Qwen2, Mistral ... name them so).
SP_CHILDREN = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def sequence_parallel_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, ParallelStyle]:
    """The plan with sequence parallelism, as torchtitan does it, fitted to Hugging Face layers.

    Between the TP regions the residual stream stays split on the sequence (Shard(1)): the
    norms run on their rows (SequenceParallel), attention and MLP all-gather their input, and
    the row-wise layers reduce-scatter their output instead of all-reducing it. The split
    happens at the first layer's input (a local slice: the embeddings stay whole, as HF builds
    positions, masks and rotary tables from their full length) and is gathered back before
    the final norm, so the head and the loss see whole sequences."""
    layers = _layers_pattern(plan)
    container, base = layers.removesuffix(".*"), layers.removesuffix(".layers.*")
    layer = model.get_submodule(f"{container}.0")
    missing = [c for c in SP_CHILDREN if not hasattr(layer, c)]
    norm = f"{base}.norm"
    if missing or not _has(model, norm):
        raise ConfigError(
            f"parallel.sequence_parallel=true: {type(layer).__name__} has no "
            f"{missing or [norm]} (sequence parallelism is built for Llama-style layers: "
            f"{', '.join(SP_CHILDREN)} and a final {norm}); set parallel.sequence_parallel=false"
        )
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        rowwise = style.startswith("rowwise")
        styles[pattern] = RowwiseParallel(output_layouts=Shard(1)) if rowwise else STYLES[style]()
    styles.update(
        {
            f"{layers}.input_layernorm": SequenceParallel(),
            f"{layers}.post_attention_layernorm": SequenceParallel(),
            # HF passes hidden_states to attention by keyword, to the MLP by position.
            f"{layers}.self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            f"{layers}.mlp": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            ),
            f"{container}.0": PrepareModuleInput(
                input_layouts=(Replicate(),),
                desired_input_layouts=(Shard(1),),
                use_local_output=True,
            ),
            norm: PrepareModuleInput(
                input_layouts=(Shard(1),),
                desired_input_layouts=(Replicate(),),
                use_local_output=True,
            ),
        }
    )
    return styles


def _layers_pattern(plan: dict[str, str]) -> str:
    """``model.layers.*`` out of the plan's patterns (``model.layers.*.self_attn.q_proj``)."""
    heads = {k.split(".*.")[0] + ".*" for k in plan if ".*." in k}
    if len(heads) != 1:
        raise ConfigError(
            f"parallel.sequence_parallel=true needs a plan over one stack of layers "
            f"('<stack>.*.<module>'); got {sorted(plan)}"
        )
    return heads.pop()


def _has(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def clip_grad_norm(parameters, max_norm: float, *, pipeline=None) -> torch.Tensor:
    """``clip_grad_norm_`` over parameters that may live on different meshes (with TP: the
    TP-sharded ones on (dp, tp), the rest on dp): each mesh's norm is reduced over its own mesh,
    then they are combined. The total norm, before clipping, as a plain tensor. ``pipeline``:
    the process group of the pipeline axis, whose other ranks hold the other stages' parameters:
    the squared norm is summed over it too."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            groups[p.grad.device_mesh if isinstance(p.grad, DTensor) else None].append(p)
    if len(groups) <= 1 and pipeline is None:
        params = next(iter(groups.values()), [])
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
    norms = []
    for params in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    squared = torch.stack(norms).float().square().sum() if norms else torch.zeros(())
    if pipeline is not None:
        squared = squared.to(process_group.collective_device(squared.device))
        torch.distributed.all_reduce(squared, group=pipeline)
    total = squared.sqrt()
    for params in groups.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
