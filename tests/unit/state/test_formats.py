"""The checkpoint formats: a reader/writer per format, and none chosen by a match elsewhere."""

from __future__ import annotations

import re

from conftest import ROOT

from fsdp_lab.config import CheckpointFormat
from fsdp_lab.state import formats


def test_every_format_but_none_has_a_reader_writer():
    assert set(formats.FORMATS) == set(CheckpointFormat) - {CheckpointFormat.none}


def test_an_engine_io_replaces_the_sharded_writer_only():
    class Io:
        def save(self, model, optimizer, path) -> None: ...

        def load(self, model, optimizer, path, *, reader) -> None: ...

    sharded = formats.format_for(CheckpointFormat.sharded, engine_io=Io())
    assert isinstance(sharded, formats.EngineSharded)
    assert isinstance(formats.format_for(CheckpointFormat.full, engine_io=Io()), formats.FullState)
    assert isinstance(formats.format_for(CheckpointFormat.sharded), formats.DcpSharded)


DISPATCH = re.compile(r"match [\w.]*format\b|CheckpointFormat\[")


def test_no_other_state_module_dispatches_on_the_format():
    hits = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in sorted((ROOT / "fsdp_lab" / "state").glob("*.py"))
        if path.name != "formats.py"
        for m in DISPATCH.finditer(path.read_text())
    ]
    assert not hits, "format dispatch outside state.formats:\n" + "\n".join(hits)
