"""Which parameters train (the finetune group): freeze patterns, or PEFT's LoRA adapters.

``apply`` runs on the model's structure on meta (every rank, the launcher's checks, ``fsdp-lab
plan``), before TP, activation checkpointing, compile and ``fully_shard``, and in the same way
on rank 0's full CPU model, the source of the initial weights: both then have the same
parameters by name, and the adapters' initial values are rank 0's, seeded. LoRA is PEFT's own
(``inject_adapter_in_model``): the model keeps its class, so wrap policies, the fused loss and
the plan see the model they know, and each targeted ``q_proj`` becomes a PEFT layer holding
``q_proj.base_layer`` and ``q_proj.lora_A/B.default``. FSDP2 shards per parameter, so frozen
and trainable parameters may share a unit; frozen ones get no gradient and no optimizer state.
"""

from __future__ import annotations

import fnmatch
import warnings

import torch
from torch import nn

from fsdp_lab.config import ConfigError, FinetuneConfig, FinetuneMethod
from fsdp_lab.engine.activations import clean_name

ADAPTER = "default"  # PEFT's adapter name: lora_A.default.weight
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head


def apply(model: nn.Module, cfg: FinetuneConfig, *, seed: int | None = None) -> None:
    """Freeze, or add the LoRA adapters (initialised under ``seed`` when given: rank 0's
    source; on meta there is nothing to initialise). Refuses, naming the setting, a pattern
    that matches nothing and a choice that leaves nothing to train."""
    match cfg.method:
        case FinetuneMethod.full:
            return
        case FinetuneMethod.freeze:
            _freeze(model, cfg)
        case FinetuneMethod.lora:
            _add_lora(model, cfg, seed)
        case _:
            raise ValueError(f"unknown finetune.method {cfg.method}")
    total = sum(p.numel() for p in model.parameters())
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(
            f"finetune={cfg.method.name} freezes every parameter ({total:,}): nothing would "
            "train; freeze fewer modules (finetune.freeze, finetune.freeze_blocks)"
        )


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's stack of transformer blocks: its first ModuleList of num_hidden_layers
    modules (model.layers, transformer.h, encoder.layer)."""
    num_layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == num_layers:
            return list(module)
    return []


def _freeze(model: nn.Module, cfg: FinetuneConfig) -> None:
    names = {id(m): n for n, m in model.named_modules()}
    stack = blocks(model)
    if cfg.freeze_blocks > len(stack):
        raise ConfigError(
            f"finetune.freeze_blocks={cfg.freeze_blocks} but the model has {len(stack)} blocks; "
            f"set finetune.freeze_blocks<={len(stack)}"
        )
    prefixes = [names[id(b)] for b in stack[: cfg.freeze_blocks]]
    for pattern in cfg.freeze:
        matched = [n for n in names.values() if n and fnmatch.fnmatchcase(n, pattern)]
        matched += [n for n, _ in model.named_parameters() if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            top = sorted({n for n in names.values() if n and n.count(".") <= 1})
            raise ConfigError(
                f"finetune.freeze pattern {pattern!r} matches no module or parameter; the "
                f"model's modules are named like {', '.join(top[:8])}"
            )
        prefixes += matched
    for name, p in model.named_parameters():
        if any(name == pre or name.startswith(pre + ".") for pre in prefixes):
            p.requires_grad_(False)


def linear_modules(model: nn.Module) -> list[str]:
    """The last parts of the names of the model's linear layers, as LoRA targets name them
    (GPT-2's Conv1D counts: it is a linear layer stored transposed)."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted(
        {
            n.rsplit(".", 1)[-1]
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear | Conv1D) and m is not head
        }
    )


def _check_targets(model: nn.Module, targets: list[str] | None) -> None:
    """Each target must name a module (PEFT matches a name or its last parts: key ==
    target or key ending in .target); PEFT itself only fails when none matches."""
    if targets is None or targets == [ALL_LINEAR]:
        return
    names = [n for n, _ in model.named_modules()]
    for target in targets:
        if not any(n == target or n.endswith("." + target) for n in names):
            raise ConfigError(
                f"finetune.target_modules: {target!r} matches no module of "
                f"{type(model).__name__}; its linear layers are {', '.join(linear_modules(model))}"
            )


def lora_config(cfg: FinetuneConfig, model_type: str):
    """PEFT's LoraConfig of ``cfg``; target_modules=None takes PEFT's default for the
    architecture (q_proj and v_proj for Llama and Qwen2, query and value for BERT)."""
    from peft import LoraConfig
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT

    targets = cfg.target_modules
    if targets is None:
        targets = DEFAULT.get(model_type)
        if targets is None:
            raise ConfigError(
                f"finetune=lora: PEFT has no default target modules for model_type={model_type}; "
                "set finetune.target_modules=[...] (or [all-linear])"
            )
    targets = list(targets)
    return LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=ALL_LINEAR if targets == [ALL_LINEAR] else targets,
    )


def _add_lora(model: nn.Module, cfg: FinetuneConfig, seed: int | None) -> None:
    try:
        from peft import inject_adapter_in_model
    except ImportError as e:
        raise ConfigError(
            "finetune=lora needs the package peft: pip install peft (or pip install -e .)"
        ) from e
    _check_targets(model, cfg.target_modules)
    config = lora_config(cfg, model.config.model_type)
    if seed is not None:
        torch.manual_seed(seed)  # the adapters' init: lora_A Kaiming-uniform, lora_B zeros
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "Already found a peft_config": on purpose
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)


def adapts_head(model: nn.Module) -> bool:
    """Whether LoRA wrapped the output head (a fused loss reads the head's weight alone)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return head is not None and hasattr(head, "base_layer")


def counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter elements; a tied parameter counts once."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def trainable_names(model: nn.Module) -> set[str]:
    """The trainable parameters' names as state dicts key them (no wrapper parts)."""

    return {clean_name(n) for n, p in model.named_parameters() if p.requires_grad}


def frozen_fingerprint(model: nn.Module, read=None) -> str | None:
    """An xxh3-128 digest of the frozen parameters' names, dtypes, shapes and fp32 bytes in name
    order (None: none is frozen): what a checkpoint recorded of its base before per-rank loading
    (2026-11-27; since, ``loading.frozen_fingerprint`` of the files), and what rank 0's route
    records of a hub id's base. Of a whole model, or one tensor at a time where ``read(name,
    param)`` gives each whole (a gather on every rank, or a read from the files), so a fine-tune
    checkpointed before resumes and exports as it did."""
    import xxhash

    frozen = sorted(
        ((clean_name(n), p) for n, p in model.named_parameters() if not p.requires_grad),
        key=lambda item: item[0],
    )
    if not frozen:
        return None
    digest = xxhash.xxh3_128()
    for name, p in frozen:
        t = (p if read is None else read(name, p)).detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(-1).view(torch.uint8).numpy())
    return digest.hexdigest()
