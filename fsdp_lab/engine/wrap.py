"""Choose the FSDP units: the submodules that get their own ``fully_shard`` (the root always does).

Pure: reads module structure only, needs no process group and works on a meta model.
"""

from __future__ import annotations

from torch import nn

from fsdp_lab.config import ConfigError, WrapConfig, WrapPolicy


def select_units(model: nn.Module, cfg: WrapConfig) -> list[nn.Module]:
    """Submodules to shard as units, in forward (module registration) order, root excluded."""
    match cfg.policy:
        case WrapPolicy.transformer:
            units = _by_class(model, cfg.classes)
        case WrapPolicy.size:
            units = _by_size(model, cfg.min_num_params)
        case WrapPolicy.none:
            units = []
        case _:
            raise ValueError(f"unknown wrap.policy {cfg.policy}")
    return [u for u in units if _keeps_tied_params_together(model, u)]


def _by_class(model: nn.Module, classes: list[str]) -> list[nn.Module]:
    names = list(classes) or sorted(getattr(model, "_no_split_modules", None) or [])
    if not names:
        raise ConfigError(
            f"wrap=transformer: {type(model).__name__} declares no _no_split_modules; "
            "name the block classes with wrap.classes=[...] or use wrap=size"
        )
    present = {type(m).__name__ for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigError(
            f"wrap.classes: {missing} match no module of {type(model).__name__}; "
            f"its module classes are {sorted(present)}"
        )
    wanted = set(names)
    return [m for m in model.modules() if m is not model and type(m).__name__ in wanted]


def _by_size(model: nn.Module, min_num_params: int) -> list[nn.Module]:
    """Bottom-up: a module becomes a unit when its params not already in a unit reach the bar."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> int:
        remaining = sum(visit(child) for child in module.children())
        remaining += sum(p.numel() for p in module.parameters(recurse=False))
        if module is not model and remaining >= min_num_params:
            units.append(module)
            return 0
        return remaining

    visit(model)
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(units, key=lambda m: order[id(m)])


def _keeps_tied_params_together(model: nn.Module, unit: nn.Module) -> bool:
    """A unit must hold every use of a shared (tied) parameter or none of them.

    Tied input/output embeddings live in two modules; splitting them across units would give one
    parameter two owners. Such modules are left to a common ancestor (usually the root).
    """
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    inside: dict[int, int] = {}
    for _, p in unit.named_parameters(remove_duplicate=False):
        inside[id(p)] = inside.get(id(p), 0) + 1
    return all(count == uses[pid] for pid, count in inside.items())


def summarize_units(model: nn.Module, units: list[nn.Module]) -> str:
    """The FSDP units in one line, by class and count, then the root ("LlamaDecoderLayer x2,
    root LlamaForCausalLM"): what the plan and the run's report show."""
    kinds: dict[str, int] = {}
    for u in units:
        kinds[type(u).__name__] = kinds.get(type(u).__name__, 0) + 1
    parts = [f"{n} x{c}" for n, c in kinds.items()] + [f"root {type(model).__name__}"]
    return ", ".join(parts)
