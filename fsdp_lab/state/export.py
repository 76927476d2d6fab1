"""Write a Hugging Face model directory (config.json, safetensors) from trained weights.

Used at the end of training (``checkpoint.export_hf=true``) and by ``fsdp-lab export``, which
reads a checkpoint in one plain process, without the ranks that wrote it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from fsdp_lab.config import CheckpointVerify, Config, ConfigError, ModelTask, to_typed
from fsdp_lab.engine.model import (
    align_special_tokens,
    build_full_model,
    build_hf_config,
    build_meta_model,
)
from fsdp_lab.state import checkpoint as ckpt
from fsdp_lab.state import integrity, safe_load


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
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not replace:
        raise ConfigError(f"export: {out_dir} is not empty; choose a new output directory")
    if preset and tokenizer is not None:
        align_special_tokens(hf_config, tokenizer)
    model = build_meta_model(hf_config, task)
    missing, unexpected = model.load_state_dict(model_sd, strict=False, assign=True)
    missing = [k for k in missing if k not in _tied_keys(model)]
    if missing or unexpected:
        raise ConfigError(
            f"export: the weights do not fit {type(model).__name__} (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    if getattr(hf_config, "tie_word_embeddings", False):
        model.tie_weights()
    model.config.use_cache = True  # trained without a KV cache; generation wants one
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    old = out_dir.with_name(out_dir.name + ".old")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
    tmp.rename(out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _tied_keys(model) -> set[str]:
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return set(tied)  # a dict (transformers 5) or a list: its keys either way


def load_checkpoint_weights(
    path: Path, verify: CheckpointVerify = CheckpointVerify.checksum
) -> tuple[dict[str, torch.Tensor], object, Config]:
    """(full model state dict, transformers config, run config) of a checkpoint, in this one
    process; the checkpoint is verified as ``verify`` says and read through safe_load's guards
    (a run dir or checkpoint root: its latest checkpoint)."""
    path = ckpt.resolve_resume(str(path), Path(path), verify)
    marker = integrity.read_marker(path)
    trainer = json.loads((path / ckpt.TRAINER_FILE).read_text())
    cfg = to_typed(trainer["config"])
    hf_config = build_hf_config(cfg.model)
    if marker["format"] == "full":
        return safe_load.load_plain(path / "model.pt"), hf_config, cfg
    import warnings

    import torch.distributed.checkpoint as dcp

    # DCP loads in place into tensors of the right shapes: a CPU model supplies them.
    model = build_full_model(hf_config, seed=0, task=cfg.model.task)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(
            state,
            storage_reader=safe_load.Reader(path),
            planner=safe_load.LoadPlanner(path),
            no_dist=True,
        )
    return state["model"], hf_config, cfg
