"""Write a Hugging Face model directory (config.json, safetensors) from trained weights.

Used at the end of training (``checkpoint.export_hf=true``) and by ``fsdp-lab export``, which
reads a checkpoint in one plain process, without the ranks that wrote it.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import torch

from fsdp_lab.config import (
    CheckpointVerify,
    Config,
    ConfigError,
    FinetuneMethod,
    ModelTask,
    to_typed,
)
from fsdp_lab.engine import finetune
from fsdp_lab.engine.model import (
    align_special_tokens,
    build_full_model,
    build_hf_config,
    build_meta_model,
    load_pretrained,
)
from fsdp_lab.state import checkpoint as ckpt
from fsdp_lab.state import formats


def export_hf(
    model_sd: dict[str, torch.Tensor],
    hf_config,
    out_dir: Path,
    *,
    max_shard_size: str = "2GB",
    replace: bool = False,
    task: ModelTask = ModelTask.causal_lm,
    tokenizer=None,
    preset: bool = False,
) -> Path:
    """Save ``model_sd`` as a from_pretrained-able directory; complete or invisible.

    The weights are assigned into a meta-built model (no second copy), and tied parameters are
    re-tied, so save_pretrained writes a tied head once, as transformers expects. The run's
    tokenizer, if it has one, is saved beside the weights, so the directory is all that
    ``from_pretrained`` and ``generate`` need. An existing
    non-empty ``out_dir`` is an error unless ``replace`` (a run re-exporting its own hf/), and
    then it is swapped out only once the new export is whole.
    """
    out_dir = _new_out_dir(out_dir, replace)
    if preset and tokenizer is not None:
        align_special_tokens(hf_config, tokenizer)
    model = build_meta_model(hf_config, task)
    _assign(model, model_sd, hf_config)
    model.config.use_cache = True  # trained without a KV cache; generation wants one
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    _swap_into_place(tmp, out_dir)
    return out_dir


def export_run(
    model_sd: dict[str, torch.Tensor],
    hf_config,
    out_dir: Path,
    cfg: Config,
    *,
    merge: bool = False,
    **kwargs,
) -> Path:
    """A run's trained weights as a Hugging Face directory: a LoRA run's as a PEFT adapter
    directory (``PeftModel.from_pretrained(base, out_dir)``; with peft installed
    ``from_pretrained(out_dir)`` too), or with ``merge`` as a whole model with the adapters
    merged into the base; every other run's as a whole model (``export_hf``)."""
    if cfg.finetune.method is FinetuneMethod.lora:
        peft_model = _peft_model(model_sd, hf_config, cfg)
        if not merge:
            return _save_adapter(peft_model, out_dir, **kwargs)
        merged = peft_model.merge_and_unload()
        model_sd = merged.state_dict()
    return export_hf(model_sd, hf_config, out_dir, task=cfg.model.task, **kwargs)


def _peft_model(model_sd: dict[str, torch.Tensor], hf_config, cfg: Config):
    """A PeftModel holding ``model_sd`` (our names: PEFT's without ``base_model.model.``),
    built on meta and given the tensors, not a copy of them."""
    from peft import get_peft_model

    base = build_meta_model(hf_config, cfg.model.task)
    if cfg.model.pretrained:
        base.name_or_path = cfg.model.name_or_path  # the adapter config's base model
    lora = finetune.lora_config(cfg.finetune, hf_config.model_type)
    if cfg.model.task is ModelTask.causal_lm:
        lora.task_type = "CAUSAL_LM"  # so AutoModelForCausalLM.from_pretrained takes the dir
    peft_model = get_peft_model(base, lora, adapter_name=finetune.ADAPTER)
    _assign(peft_model, model_sd, hf_config, prefix="base_model.model.", base=base)
    return peft_model


def _assign(model, model_sd: dict, hf_config, *, prefix: str = "", base=None) -> None:
    """Give ``model`` the tensors of ``model_sd`` (not copies; keys under ``prefix`` in it),
    every weight but a tied one required; tied parameters re-tied on ``base`` (the HF model)."""
    base = model if base is None else base
    sd = {prefix + k: v for k, v in model_sd.items()}
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    tied = {prefix + k for k in _tied_keys(base)}
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ConfigError(
            f"export: the weights do not fit {type(base).__name__}{' with LoRA' if prefix else ''} "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if getattr(hf_config, "tie_word_embeddings", False):
        base.tie_weights()


def _new_out_dir(out_dir: Path, replace: bool) -> Path:
    """An export's directory: new or empty, or (``replace``) a run's own earlier export."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not replace:
        raise ConfigError(f"export: {out_dir} is not empty; choose a new output directory")
    return out_dir


def _save_adapter(peft_model, out_dir: Path, *, replace: bool = False, tokenizer=None, **_) -> Path:
    """PEFT's adapter directory (adapter_config.json, adapter_model.safetensors) and the
    tokenizer; complete or invisible, as ``export_hf``."""
    out_dir = _new_out_dir(out_dir, replace)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with warnings.catch_warnings():  # transformers' deprecation of a name PEFT still reads
        warnings.simplefilter("ignore", FutureWarning)
        peft_model.save_pretrained(tmp, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    _swap_into_place(tmp, out_dir)
    return out_dir


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    old = out_dir.with_name(out_dir.name + ".old")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _tied_keys(model) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied)  # a dict (transformers 5) or a list: its keys either way


def load_checkpoint_weights(
    path: Path, verify: CheckpointVerify = CheckpointVerify.checksum, *, base: Path | None = None
) -> tuple[dict[str, torch.Tensor], object, Config]:
    """(full model state dict, transformers config, run config) of a checkpoint, in this one
    process; the checkpoint is verified as ``verify`` says and read through safe_load's guards
    (a run dir or checkpoint root: its latest checkpoint). ``base``: where the frozen base of a
    fine-tune's checkpoint is here, if not where its run read it (another machine); the run
    config returned then names it."""
    path = ckpt.resolve_resume(str(path), Path(path), verify)
    trainer = json.loads((path / ckpt.TRAINER_FILE).read_text())
    cfg = to_typed(trainer["config"])
    if base is not None:
        model_cfg = dataclasses.replace(cfg.model, name_or_path=str(Path(base).resolve()))
        cfg = dataclasses.replace(cfg, model=model_cfg)
    record = ckpt.frozen_base_record(trainer)
    source = cfg.model.name_or_path  # the run's, or --base
    if not record["saved"] and not Path(source).exists():
        raise ckpt.CheckpointError(
            f"checkpoint {path} holds only the trainable parameters of a fine-tune of {source}, "
            "which is not here; pass --base DIR (a directory of the same base weights)"
        )
    hf_config = build_hf_config(cfg.model)
    model, held = _model_for(path, record, cfg, hf_config)
    formats.format_of(path).read_model(path, model, held=held)
    return model.state_dict(), hf_config, cfg


def _model_for(path: Path, record: dict, cfg: Config, hf_config):
    """A CPU model with the checkpoint's parameters (its finetune applied), and what of it the
    checkpoint holds. A fine-tune's checkpoint without its frozen base gets the base read
    from where the run read it, checked against the fingerprint the run recorded."""
    if record["saved"]:  # every weight comes from the checkpoint: any init gives the shapes
        model = build_full_model(hf_config, seed=0, task=cfg.model.task)
        finetune.apply(model, cfg.finetune)
        return model, ckpt.FrozenBase()
    source = cfg.model.name_or_path  # the run's, or --base (load_checkpoint_weights checked it)
    model = load_pretrained(source, cfg.model.task)
    finetune.apply(model, cfg.finetune, seed=cfg.seed)
    fingerprint = finetune.frozen_fingerprint(model)
    if fingerprint != record["fingerprint"]:
        raise ckpt.CheckpointError(
            f"checkpoint {path} holds only the trainable parameters of a fine-tune, and the "
            f"weights in {source} differ from its base (fingerprint {fingerprint[:12]}, not "
            f"{record['fingerprint'][:12]}); pass --base DIR with the base it was trained on"
        )
    names = frozenset(finetune.trainable_names(model))
    return model, ckpt.FrozenBase(trainable=names, fingerprint=fingerprint, source=source)
