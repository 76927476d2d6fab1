"""The checkpoint formats: a reader/writer per format, and none chosen by a match elsewhere."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import assert_only_named_in

from fsdp_lab.config import CheckpointFormat, checkpoint_formats
from fsdp_lab.state import formats, safe_load


def test_every_format_but_none_has_a_reader_writer():
    assert set(formats.STATE_FORMATS) == set(CheckpointFormat) - {CheckpointFormat.none}


def test_an_engine_io_replaces_the_sharded_writer_only():
    class Io:
        def save(self, model, optimizer, path) -> None: ...

        def load(self, model, optimizer, path, *, reader) -> None: ...

    sharded = formats.format_for(CheckpointFormat.sharded, engine_io=Io())
    assert isinstance(sharded, formats.EngineSharded)
    assert isinstance(formats.format_for(CheckpointFormat.full, engine_io=Io()), formats.FullState)
    assert isinstance(formats.format_for(CheckpointFormat.sharded), formats.DcpSharded)


DISPATCH = re.compile(
    r"match [\w.]*(cfg|checkpoint)\.format\b"
    r"|CheckpointFormat\[|CheckpointFormat\.(sharded|full|none)\b"
    r"|\[\"format\"\] (==|!=) "
)


def test_no_other_module_dispatches_on_the_format():
    # The schema names the formats, the table says what each allows, state.formats holds
    # their readers and writers.
    allowed = {"config/checkpoint_formats.py", "config/training.py", "state/formats.py"}
    seen = ['if marker["format"] != "sharded":', "match self.cfg.format:"]
    assert_only_named_in(allowed, DISPATCH, seen, "format dispatch outside the formats' table")


def test_the_table_has_a_row_and_the_state_a_reader_writer_for_every_format():
    assert set(checkpoint_formats.CHECKPOINT_FORMATS) == set(CheckpointFormat)
    saving = {f for f, row in checkpoint_formats.CHECKPOINT_FORMATS.items() if row.saves}
    assert saving == set(formats.STATE_FORMATS)
    full = checkpoint_formats.CHECKPOINT_FORMATS[CheckpointFormat.full]
    assert checkpoint_formats.format_row("full") is full


@pytest.mark.parametrize("indexed", [True, False], ids=["indexed-groups", "flat"])
def test_the_optimizer_reloads_from_either_group_layout(tmp_path, indexed):
    """New checkpoints key the optimizer groups' settings by parameter name (a pipeline's
    stages hold different parameters, and a stage may have one group where another has two);
    one written before, by group index, still loads."""
    import torch.distributed.checkpoint as dcp
    from torch import nn
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
        groups = [
            {"params": [model[0].weight], "weight_decay": 0.1},
            {"params": [model[0].bias, *model[1].parameters()], "weight_decay": 0.0},
        ]
        return model, torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.9))

    model, optimizer = build()
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    options = StateDictOptions() if indexed else formats.FLAT_OPTIMIZER
    state = {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizer, options=options),
    }
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    keys = safe_load.read_metadata(tmp_path).state_dict_metadata
    assert ("optim.param_groups.0.lr" in keys) == indexed
    fresh, fresh_optimizer = build()
    formats.DcpSharded().load(
        tmp_path, model=fresh, optimizer=fresh_optimizer, held=formats.FrozenBase()
    )
    assert [g["betas"] for g in fresh_optimizer.param_groups] == [(0.8, 0.9)] * 2
    assert [g["weight_decay"] for g in fresh_optimizer.param_groups] == [0.1, 0.0]
    want = optimizer.state[model[0].weight]["exp_avg"]
    assert torch.equal(fresh_optimizer.state[fresh[0].weight]["exp_avg"], want)
