"""A checkpoint read back in one plain process, a tensor group at a time: what ``fsdp-lab
export`` streams out (``state.export.export_model``) and what the tests compare whole. A
fine-tune's checkpoint that left its frozen base out reads the base from its files, once their
fingerprint is the one the run recorded.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from fsdp_lab.config import CheckpointVerify, Config, QuantizeBase, to_typed
from fsdp_lab.engine import conversion, finetune, loading, low_precision, nf4, weights
from fsdp_lab.engine.model import build_hf_config, model_on_meta, tied_groups
from fsdp_lab.state import checkpoint as ckpt
from fsdp_lab.state import formats
from fsdp_lab.state.export import Fetch


def open_checkpoint(
    path: Path, verify: CheckpointVerify = CheckpointVerify.checksum, *, base: Path | None = None
) -> tuple[torch.nn.Module, Fetch, object, Config]:
    """(the run's model on meta, ``fetch`` of its tensors, transformers config, run config) of
    a checkpoint, read in this one process a group at a time; the checkpoint is verified as
    ``verify`` says and read through safe_load's guards (a run dir or checkpoint root: its
    latest checkpoint). A fine-tune's checkpoint without its frozen base reads the base from
    where its run read it, or from ``base`` (another machine; the run config returned then
    names it), checked against the fingerprint the run recorded."""
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
    model = model_on_meta(hf_config, cfg.model.task, cfg.finetune)
    held, frozen = set(conversion.owned_tensors(model)), None
    if not record["saved"]:
        held = set(finetune.trainable_names(model))
        frozen = _base_reader(path, record, model, cfg.seed, source)
    reader = formats.format_saved_in(path).tensor_reader(path)
    fetch = _checkpoint_fetch(model, reader, held, frozen)
    if cfg.finetune.quantize_base is QuantizeBase.nf4:  # the base as the run held it
        fetch = _dequantized_nf4(fetch, low_precision.base_weights(model))
    return model, fetch, hf_config, cfg


def _dequantized_nf4(fetch: Fetch, quantized: set[str]) -> Fetch:
    """A QLoRA run's base weights through NF4 and back: the values its model computed with."""

    def read(keys: list[str]) -> dict[str, torch.Tensor]:
        out = fetch(keys)
        for key in quantized.intersection(out):
            out[key] = nf4.round_trip(out[key]).to(out[key].dtype)
        return out

    return read


def _base_reader(path: Path, record: dict, model, seed: int, source: str):
    """(files, load plan) of the frozen base a fine-tune's checkpoint leaves out, once its
    files' fingerprint is the one the run recorded."""
    files = weights.WeightFiles(source)
    plan = conversion.plan_loading(model, files, source)
    if ckpt.legacy_fingerprint(record["fingerprint"]):  # recorded before per-rank loading
        fingerprint = finetune.frozen_fingerprint(
            model, lambda name, _: plan.sources[name].read(files)
        )
    else:
        spec = loading.InitialWeights(seed=seed, pretrained=source)
        fingerprint = loading.frozen_fingerprint(model, spec, (files, plan))
    if fingerprint != record["fingerprint"]:
        raise ckpt.CheckpointError(
            f"checkpoint {path} holds only the trainable parameters of a fine-tune, and the "
            f"weights in {source} differ from its base (fingerprint {str(fingerprint)[:12]}, "
            f"not {str(record['fingerprint'])[:12]}); pass --base DIR with the base it was "
            "trained on"
        )
    return files, plan


def _checkpoint_fetch(model, fill, held: set[str], base) -> Fetch:
    """``fetch`` of a checkpoint in one process: the tensors it holds through its format's
    reader (``fill``), the others (a frozen base) from the base's files."""
    names = conversion.owned_tensors(model)

    def fetch(keys: list[str]) -> dict[str, torch.Tensor]:
        out = {
            k: torch.empty(names[k][2].shape, dtype=names[k][2].dtype) for k in keys if k in held
        }
        if out:
            fill(out)
        for k in keys:
            if k not in held:
                files, plan = base
                out[k] = plan.sources[k].read(files).to(names[k][2].dtype)
        return out

    return fetch


def load_checkpoint_weights(
    path: Path, verify: CheckpointVerify = CheckpointVerify.checksum, *, base: Path | None = None
) -> tuple[dict[str, torch.Tensor], object, Config]:
    """(full model state dict, transformers config, run config) of a checkpoint, whole in this
    one process: for comparisons of small models (an export streams: ``export_checkpoint``)."""
    model, fetch, hf_config, cfg = open_checkpoint(path, verify, base=base)
    names = conversion.owned_tensors(model)
    values = fetch(list(names))
    sd = {key: values[key] for key in model.state_dict() if key in values}
    for group in tied_groups(model):  # a tied tensor under each of its names
        value = next(values[n] for n in group if n in values)
        sd.update(dict.fromkeys(group, value))
    return sd, hf_config, cfg
