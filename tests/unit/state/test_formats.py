"""The checkpoint formats: a reader/writer per format, and none chosen by a match elsewhere."""

from __future__ import annotations

import re

from conftest import assert_only_named_in

from fsdp_lab.config import CheckpointFormat, checkpoint_formats
from fsdp_lab.state import formats


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
