"""The checkpoint formats, one row each: what a format allows, for the rules and the launcher.

``state.formats`` holds each format's reader/writer (a ``StateFormat`` per row); this table
says, without torch, what the checks before launch need to know of a format. A new format is a
``CheckpointFormat``, a row here, its ``StateFormat`` in ``state.formats.STATE_FORMATS`` and a
``conf/checkpoint/`` file.

| checkpoint.format | saves | async saves | whole files |
| sharded           | yes   | yes         | no          |
| full              | yes   | no          | yes         |
| none              | no    | no          | no          |
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config.training import CheckpointFormat


@dataclass(frozen=True)
class FormatRow:
    saves: bool
    """Writes checkpoints at all (none: the run keeps nothing to resume from)."""
    async_saves: bool
    """checkpoint.async_enabled can write it in the background (DCP's async_save)."""
    whole_files: bool
    """Whole tensors in torch.save files, not DCP's shards (a hardware row refusing
    ``Feature.whole_file_checkpoints`` neither writes nor resumes it: torch_xla's planners
    read only DCP's files)."""


CHECKPOINT_FORMATS: dict[CheckpointFormat, FormatRow] = {
    CheckpointFormat.sharded: FormatRow(saves=True, async_saves=True, whole_files=False),
    CheckpointFormat.full: FormatRow(saves=True, async_saves=False, whole_files=True),
    CheckpointFormat.none: FormatRow(saves=False, async_saves=False, whole_files=False),
}


def format_row(fmt: CheckpointFormat | str) -> FormatRow:
    """The row of a format (or of its name, as a checkpoint's marker says it)."""
    return CHECKPOINT_FORMATS[CheckpointFormat[fmt] if isinstance(fmt, str) else fmt]


def with_async_saves() -> list[str]:
    """The formats checkpoint.async_enabled can write, by name, for an error's fix."""
    return [f.name for f, row in CHECKPOINT_FORMATS.items() if row.async_saves]
