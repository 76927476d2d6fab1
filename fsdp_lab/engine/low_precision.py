"""Low precision from torchao, as tensor subclasses FSDP2 shards and all-gathers in their own
bytes: float8 linear layers (``precision.float8_recipe``) and a frozen base in NF4
(``finetune.quantize_base=nf4``, QLoRA).

Both convert the meta model before ``fully_shard``, and only the layers a family's table row
names (``config.families``: the blocks' projections) whose sizes the format takes; the rest
keep their dtype, and ``apply`` returns what run.json records: each layer kind's precision,
and why a layer was left out.

- **float8** swaps the chosen ``nn.Linear`` for torchao's ``Float8Linear``. With float8
  all-gathers their weights are ``WeightWithDynamicFloat8CastTensor``s: FSDP2 gathers 1 byte a
  parameter, cast with a scale from the whole tensor (``post_optimizer_step`` precomputes every
  layer's in one all-reduce after each step). gloo has no float8 dtype, so on the host the
  all-gather travels as bytes (``ByteAllGather``).
- **NF4** makes the chosen frozen weights ``NF4Tensor``s on meta, 4 bits a parameter plus 1/8
  for the scales; each rank quantises its own shard as it is filled (``engine.nf4``). A weight
  whose rows do not split into whole scale blocks per shard is held whole by every rank
  (``left_to_every_rank``), so the same layers are NF4 at any world size.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.config import Config, ConfigError, Float8Recipe, QuantizeBase, precisions
from fsdp_lab.config.families import family_of
from fsdp_lab.config.low_precision import NF4_SCALE_SPAN, nf4_splits
from fsdp_lab.engine.hardware import process_group
from fsdp_lab.engine.nf4 import is_nf4, local_bytes, nf4_api
from fsdp_lab.internals import torch_private

FLOAT8_DIM = 16  # float8 matmuls need both dimensions to be multiples of this


def _kind(name: str) -> str:
    """A layer's kind: the last part of its name (PEFT's ``base_layer`` is its wrapper's)."""
    parts = name.split(".")
    return parts[-2] if parts[-1] == "base_layer" and len(parts) > 1 else parts[-1]


def _pattern(name: str) -> str:
    """A layer's name with its block index as ``*``: one entry per layer of the stack."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


@dataclass(frozen=True)
class Choice:
    """Which linear layers a format converts, and why each other one was left as it is."""

    chosen: dict[str, nn.Linear]
    kept: dict[str, str]  # layer name pattern -> reason


def choose_linears(model: nn.Module, format_name: str, fits) -> Choice:
    """The blocks' projections of the model's family (``low_precision_linears``) that
    ``fits(weight) -> reason or None`` takes; adapters, the head and routers are kept."""
    family = family_of(getattr(getattr(model, "config", None), "model_type", ""))
    kinds = set(family.low_precision_linears) if family else set()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    chosen: dict[str, nn.Linear] = {}
    kept: dict[str, str] = {}
    for name, module in model.named_modules():
        if type(module) is not nn.Linear and module is not head:  # a fused loss's head
            continue  # subclasses its Linear (train.loss_code)
        reason = None
        if ".lora_" in name:
            reason = "a LoRA adapter: it trains in the compute dtype"
        elif module is head:
            reason = "the output head: its logits feed the loss"
        elif _kind(name) not in kinds:
            reason = (
                f"not one of {family.model_type}'s block projections ({', '.join(sorted(kinds))})"
                if kinds
                else f"{format_name} has no layer list for this model type (config.families)"
            )
        else:
            reason = fits(module)
        if reason is None:
            chosen[name] = module
        else:
            kept.setdefault(_pattern(name), reason)
    return Choice(chosen, kept)


def _float8_fits(module: nn.Linear) -> str | None:
    out_f, in_f = module.weight.shape
    if out_f % FLOAT8_DIM or in_f % FLOAT8_DIM:
        return f"its size {out_f}x{in_f} is not a multiple of {FLOAT8_DIM} in both dimensions"
    return None


def _nf4_fits(module: nn.Linear) -> str | None:
    if module.weight.requires_grad:
        return "it trains (NF4 holds frozen weights only)"
    rows, cols = module.weight.shape
    if (rows * cols) % NF4_SCALE_SPAN:
        return f"its {rows}x{cols} weight is not a whole number of NF4 scale blocks"
    return None


def _record(choice: Choice, precision: str, kept_as: str, **facts) -> dict:
    layers: dict[str, str] = {}
    for name in choice.chosen:
        layers[_pattern(name)] = precision
    for pattern, reason in choice.kept.items():
        layers.setdefault(pattern, f"{kept_as}: {reason}")
    return {
        "converted": len(choice.chosen),
        "kinds": sorted({_kind(n) for n in choice.chosen}),
        "layers": layers,
        **facts,
    }


def apply(model: nn.Module, cfg: Config) -> dict | None:
    """Convert the meta ``model``'s chosen linear layers (before ``fully_shard``); returns
    run.json's ``low_precision`` record, or None when the run uses neither format."""
    if cfg.finetune.quantize_base is QuantizeBase.nf4:
        return _quantize_base(model)
    if cfg.precision.float8_recipe is not None:
        return _to_float8(model, cfg.precision.float8_recipe, float8_all_gather(cfg))
    return None


def float8_all_gather(cfg: Config) -> bool:
    return precisions.float8_all_gather(cfg.precision)


def _no_layer(setting: str, choice: Choice) -> RuntimeError:

    why = "; ".join(f"{k}: {v}" for k, v in list(choice.kept.items())[:3])
    return ConfigError(f"{setting} converts no layer of this model ({why}); remove it")


def _to_float8(model: nn.Module, recipe: Float8Recipe, all_gather: bool) -> dict:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    choice = choose_linears(model, "float8", _float8_fits)
    if not choice.chosen:
        raise _no_layer(f"precision.float8_recipe={recipe.name}", choice)
    config = Float8LinearConfig.from_recipe_name(recipe.value)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    chosen = set(choice.chosen)
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda module, fqn: fqn in chosen
    )
    gather = "float8 all-gather" if all_gather else "bf16 all-gather"
    return _record(
        choice,
        f"float8 ({recipe.name}, {gather})",
        "bf16",
        scheme="float8",
        recipe=recipe.name,
        all_gather=all_gather,
    )


def _quantize_base(model: nn.Module) -> dict:
    """The same layers at any world size (so the same model): one a shard axis cannot split
    into whole scale blocks is held whole by every rank (``left_to_every_rank``)."""
    _, to_nf4 = nf4_api()
    choice = choose_linears(model, "nf4", _nf4_fits)
    if not choice.chosen:
        raise _no_layer("finetune.quantize_base=nf4", choice)
    for module in choice.chosen.values():
        # On meta: to_nf4 gives the subclass its shapes; the values come in store_nf4.
        module.weight = nn.Parameter(to_nf4(module.weight.detach()), requires_grad=False)
    params = sum(m.weight.numel() for m in choice.chosen.values())
    return _record(
        choice,
        "nf4 (frozen, 4-bit NormalFloat, double-quantised scales)",
        "not nf4",
        scheme="nf4",
        params=params,
    )


def base_weights(model: nn.Module) -> set[str]:
    """The names of the weights ``finetune.quantize_base=nf4`` holds in NF4 (a model with
    its adapters, on meta or not): the same at any world size."""
    return {f"{name}.weight" for name in choose_linears(model, "nf4", _nf4_fits).chosen}


def left_to_every_rank(model: nn.Module, shard_ways: int) -> set[nn.Parameter] | None:
    """The NF4 weights FSDP2 must not manage, which every rank holds whole (frozen: nothing
    to reduce): those whose rows do not split into whole scale blocks per shard, and all of
    them on a 1-rank shard axis (one rank, no_shard), where torch 2.13's 1-rank all-gather
    shortcut takes only the first of an NF4 tensor's three all-gather inputs (a ValueError
    in ``fsdp_post_all_gather``)."""
    whole = {p for p in model.parameters() if is_nf4(p) and not nf4_splits(*p.shape, shard_ways)}
    return whole or None


# -- after fully_shard ----------------------------------------------------------------------------


def after_sharding(model: nn.Module, cfg: Config, device: torch.device) -> None:
    """gloo has no float8 dtype: on the host, every unit's all-gather travels as bytes."""
    if not float8_all_gather(cfg) or device.type != "cpu":
        return
    for module in model.modules():
        if hasattr(module, "set_custom_all_gather"):
            module.set_custom_all_gather(_byte_all_gather())


def _byte_all_gather():
    class ByteAllGather(torch_private.all_gather_base()):
        """FSDP2's all-gather of one flat buffer, viewed as bytes (gloo gathers no float8)."""

        def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
            return dist.all_gather_single(
                output_tensor.view(torch.uint8),
                input_tensor.view(torch.uint8),
                group=group,
                async_op=async_op,
            )

    return ByteAllGather()


def post_step(cfg: Config):
    """What the engine runs after each optimizer step (``ShardedModel.post_step``), or None."""
    return post_optimizer_step if float8_all_gather(cfg) else None


def post_optimizer_step(model: nn.Module) -> None:
    """float8 all-gathers: every float8 weight's scale from its new values, in one all-reduce
    (else each unit's all-gather reduces its own amax)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


# -- what the plan and run.json read ------------------------------------------------------------


def storage(p: torch.Tensor) -> str:
    """How a parameter is stored and gathered (``planning.memory.ParamShape.storage``): nf4, float8
    (its weight subclass with float8 all-gathers) or fp32."""
    if is_nf4(p):
        return "nf4"
    return "float8" if type(p).__name__ == "WeightWithDynamicFloat8CastTensor" else "fp32"


def measured(model: nn.Module, record: dict | None, whole: set | None) -> dict | None:
    """run.json's record (``apply``'s), with an NF4 base's bytes on each rank and the NF4
    parameters every rank holds whole; a collective."""
    if record is None or record["scheme"] != "nf4":
        return record
    mine = sum(local_bytes(p) for p in model.parameters() if is_nf4(p))
    return {
        **record,
        "bytes_per_rank": process_group.gather_from_processes(mine),
        "params_whole_on_every_rank": sum(p.numel() for p in whole or ()),
    }
