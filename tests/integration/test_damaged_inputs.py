"""The right cause, where it is: a NaN in a model directory's weights and an inf in a resumed
checkpoint's optimizer state are named by tensor and file as the ranks read them (not blamed on
the learning rate steps later); LoRA asked of a whole model's checkpoint says how, before any
rank starts. Real runs of train.py on 2 CPU ranks; nothing of the input is written over."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import check_ok, train
from test_loading_runs import save

from fsdp_lab.state import integrity

pytestmark = pytest.mark.slow

TWO = ("hardware=cpu", "hardware.nproc_per_node=2", "trainer.eval_every=0", "logger=none")
BAD = "model.layers.0.mlp.up_proj.weight"


def _errors(proc) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr
    return [x for x in proc.stderr.splitlines() if x.startswith("fsdp_lab: error:")]


def _tree(path: Path) -> dict[str, bytes]:
    files = sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p.relative_to(path)): p.read_bytes() for p in files}


def test_a_nan_in_a_model_directory_is_named_with_its_tensor_and_file(tmp_path):
    from safetensors.torch import load_file, save_file

    model = save(tmp_path / "model", "llama", shard="10MB")
    file = model / "model.safetensors"
    tensors = load_file(file)
    tensors[BAD][3, 5] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    before = _tree(model)
    run = tmp_path / "run"
    proc = train(run, *TWO, "model=local", f"model.name_or_path={model}", "trainer.max_steps=2")
    assert proc.returncode == 1
    (error,) = _errors(proc)
    assert f"{file}: tensor {BAD} holds 1 NaN/inf value(s)" in error, error
    assert "the weights are damaged" in error and "optim.lr" not in error
    assert json.loads((run / "run.json").read_text())["status"] == "failed"
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
    assert _tree(model) == before


def test_a_whole_models_checkpoint_damaged_or_asked_for_lora(tmp_path):
    """One full-format run's checkpoint: LoRA asked of it says how (before any rank); an inf in
    its optimizer state (written with it, its checksums true) is named at resume."""
    first = tmp_path / "first"
    check_ok(train(first, *TWO, "trainer.max_steps=2", "checkpoint=full"))
    ckpt = first / "checkpoints" / "step_00000002"
    assert (ckpt / integrity.MARKER).is_file()

    lora = train(tmp_path / "lora", *TWO, f"resume={ckpt}", "finetune=lora", timeout=120)
    assert lora.returncode == 2
    (error,) = _errors(lora)
    assert "is a whole model's, without LoRA adapters" in error
    assert f"fsdp-lab export {ckpt} DIR" in error and "model.name_or_path=DIR" in error
    assert not (tmp_path / "lora" / "logs").exists()  # no rank started

    optim = torch.load(ckpt / "optim.pt", weights_only=True)
    slot = next(iter(optim["state"].values()))
    slot["exp_avg"].view(-1)[0] = float("inf")
    torch.save(optim, ckpt / "optim.pt")
    marker = json.loads((ckpt / integrity.MARKER).read_text())
    marker["files"].update(integrity.file_entries(ckpt, ["optim.pt"]))  # saved so, damage and all
    (ckpt / integrity.MARKER).write_text(json.dumps(marker))
    before = _tree(ckpt)
    resumed = train(tmp_path / "resumed", *TWO, f"resume={ckpt}", "trainer.max_steps=4")
    assert resumed.returncode == 1
    (error,) = _errors(resumed)
    assert f"checkpoint {ckpt}: optimizer state exp_avg of " in error and "NaN/inf" in error
    assert "resume from an earlier checkpoint" in error
    assert _tree(ckpt) == before
    assert not (tmp_path / "resumed" / "checkpoints").exists()
