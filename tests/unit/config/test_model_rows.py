"""The model's task and fine-tune method, a row each, and the offload group read through one
owner: no module outside them dispatches on a member."""

from __future__ import annotations

import re

import transformers
from conftest import assert_only_named_in

from fsdp_lab.config import FinetuneMethod, ModelTask
from fsdp_lab.config.model import FINETUNE_METHODS, TASKS, method_row, task_row
from fsdp_lab.config.sharding import OffloadConfig, offload_config, offloaded


def test_every_task_and_method_has_one_row():
    assert set(TASKS) == set(ModelTask) and set(FINETUNE_METHODS) == set(FinetuneMethod)
    for row in TASKS.values():
        assert hasattr(transformers, row.auto_class), row.auto_class
        assert row.causal != row.masks_tokens  # today's two tasks: one of each
    assert task_row(ModelTask.causal_lm).peft_task_type == "CAUSAL_LM"
    assert [m for m, row in FINETUNE_METHODS.items() if not row.freezes] == [FinetuneMethod.full]
    assert [m for m, row in FINETUNE_METHODS.items() if row.adapters] == [FinetuneMethod.lora]
    assert method_row(FinetuneMethod.lora).freezes  # adapters train over a frozen base


def test_offload_has_one_owner():
    assert not offloaded(OffloadConfig()) and offloaded(offload_config(True))
    assert not offloaded(offload_config(False))


def test_no_other_module_dispatches_on_a_task_method_or_offload_device():
    # The schema names each default; the families table says each preset's task; the
    # fine-tune engine holds each method's code.
    assert_only_named_in(
        {"config/model.py", "config/families.py"},
        re.compile(r"\bModelTask\.(causal_lm|masked_lm)\b"),
        ["if cfg.model.task is ModelTask.masked_lm:"],
        "model task dispatch outside config.model",
    )
    assert_only_named_in(
        {"config/model.py", "engine/finetune.py"},
        re.compile(r"\bFinetuneMethod\.(full|freeze|lora)\b"),
        ["lora = cfg.finetune.method is FinetuneMethod.lora"],
        "fine-tune method dispatch outside config.model",
    )
    assert_only_named_in(
        {"config/sharding.py"},
        re.compile(r"\bOffloadDevice\.(none|cpu)\b"),
        ["offload = cfg.offload.device is OffloadDevice.cpu"],
        "offload device dispatch outside config.sharding",
    )
