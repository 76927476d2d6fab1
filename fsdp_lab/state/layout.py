"""Where a run's checkpoints live, which are complete, and which one a run resumes from.

A checkpoint is complete once its marker exists (``checkpoint.Checkpointer`` writes it last and
renames the directory into place); ``latest`` names the newest. Resuming is decided once, before
launch: ``resolve_resume`` verifies and scans the checkpoint, and ``check_compatible`` compares
its shapes with the model's.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from fsdp_lab.config import CheckpointConfig, CheckpointVerify
from fsdp_lab.engine import finetune
from fsdp_lab.engine.conversion import LORA_BASE
from fsdp_lab.state import integrity, safe_load
from fsdp_lab.state.formats import saved_shapes
from fsdp_lab.state.integrity import MARKER, CheckpointError, verify

log = logging.getLogger(__name__)

LATEST, TRAINER_FILE = "latest", "trainer.json"
DAMAGED_SUFFIX = ".damaged"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoint_root(cfg: CheckpointConfig, run_dir: Path) -> Path:
    return Path(cfg.dir).expanduser().resolve() if cfg.dir else run_dir / "checkpoints"


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under root, oldest first (a dir counts once its marker exists)."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MARKER).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names, if complete; else the newest complete one."""
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if (named / MARKER).is_file():
            return named
    done = complete_checkpoints(root)
    return done[-1] if done else None


def resolve_resume(
    resume: str, root: Path, mode: CheckpointVerify = CheckpointVerify.checksum
) -> Path | None:
    """The checkpoint this run starts from (None: fresh), verified and scanned as safe to
    read. Decided once, before launch.

    resume=auto over a checkpoint that fails verification falls back to the newest one that
    passes, saying so in one line; the failed one is renamed ``<name>.damaged`` (kept, never
    resumed from). An explicit path that fails is refused."""
    match resume:
        case "never":
            return None
        case "auto":
            return _newest_good(root, mode)
        case _:
            path = Path(resume).expanduser().resolve()
            if not (path / MARKER).is_file():
                found = [latest_checkpoint(c) for c in (path, path / "checkpoints")]
                path = next((p for p in found if p is not None), None)
            if path is None:
                raise CheckpointError(
                    f"resume={resume}: no complete checkpoint there (a checkpoint dir holds "
                    f"{MARKER}); point resume at a checkpoint, a run dir or a checkpoint root"
                )
            check(path, mode)
            return path


def check(path: Path, mode: CheckpointVerify) -> dict:
    """Verify ``path`` as ``mode`` says, then read its pickles through their guards; the
    marker. Raises CheckpointError naming the file."""
    marker = verify(path, mode)
    safe_load.scan(path, marker)
    return marker


def _newest_good(root: Path, mode: CheckpointVerify) -> Path | None:
    first = latest_checkpoint(root)
    candidates = [first] if first is not None else []
    candidates += [p for p in reversed(complete_checkpoints(root)) if p != first]
    for path in candidates:
        try:
            check(path, mode)
        except integrity.CheckpointDamaged as e:  # a refusal (unsafe, too old) is not damage
            kept = _set_aside(path)
            fallback = next((p.name for p in candidates if p.name < path.name), None)
            log.warning(
                "%s; %s (it is kept as %s)",
                e.args[0].split("; ")[0],
                f"resuming from {fallback} instead" if fallback else "no earlier checkpoint",
                kept.name,
            )
            continue
        return path
    return None


def _set_aside(path: Path) -> Path:
    """Rename a damaged checkpoint out of the resume candidates, keeping its files."""
    target = path.with_name(path.name + DAMAGED_SUFFIX)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{DAMAGED_SUFFIX}-{n}")
    path.rename(target)
    return target


def frozen_base_record(trainer: dict) -> dict:
    """trainer.json's ``frozen_base`` (FrozenBase.record): whether the checkpoint holds the
    whole model (one written before fine-tuning existed does), else its base's source and
    fingerprint."""
    return trainer.get("frozen_base") or {"saved": True}


def _adapter_part(name: str) -> bool:
    """A LoRA-wrapped model's name a whole model's checkpoint lacks: an adapter, or the base
    layer PEFT moved the weight under."""

    return ".lora_" in name or LORA_BASE + "." in name


def check_compatible(path: Path, model: torch.nn.Module) -> dict:
    """A checkpoint of another model fails before launch, naming a parameter that differs.
    Returns its ``frozen_base_record``.

    ``model`` may be on the meta device: only names and shapes are compared. A fine-tune's
    checkpoint that leaves out the frozen base is compared on its trainable parameters; the
    base is checked by its fingerprint when the ranks have read it.
    """

    saved = saved_shapes(path)
    record = frozen_base_record(json.loads((path / TRAINER_FILE).read_text()))
    expected = model.state_dict()
    if not record["saved"]:
        trainable = finetune.trainable_names(model)
        expected = {k: v for k, v in expected.items() if k in trainable}
    whole = record["saved"] and not any(_adapter_part(k) for k in saved)  # no adapters saved
    for name, tensor in expected.items():
        if name not in saved and whole and _adapter_part(name):
            raise CheckpointError(
                f"checkpoint {path} is a whole model's, without LoRA adapters ({name}); to "
                f"start LoRA from its weights, export it (fsdp-lab export {path} DIR) and train "
                "finetune=lora model=local model.name_or_path=DIR resume=never"
            )
        if name not in saved:
            raise CheckpointError(
                f"checkpoint {path} has no {name}: it is of another model; set resume=never "
                "or point resume at a checkpoint of this model"
            )
        if saved[name] != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {path} holds {name} with shape {list(saved[name])}, this model "
                f"has {list(tensor.shape)}: it is of another model; set resume=never or point "
                "resume at a checkpoint of this model"
            )
    return record
