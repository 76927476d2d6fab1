"""A config's errors: ``ConfigError``, whose message names the setting and the fix on one line,
and the small checks every group's rules share. Imports nothing else of ours."""

from __future__ import annotations

import sys
from pathlib import Path


class ConfigError(ValueError):
    """A user error in the config: the message names the setting and the fix, on one line."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """An error in one short line, to quote inside a one-line message: its first line (or its
    type's name when it has no text), cut at ``limit`` characters (HTTP clients' and hub
    errors' first lines run to a kilobyte)."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


def positive(value: int | float, name: str) -> None:
    """``name`` must be > 0."""
    if value <= 0:
        raise ConfigError(f"{name}={value} must be > 0; set {name}=<a positive value>")


def typed_command() -> str:
    """The training command as the user typed it, for a fix that names what to run: ``python
    train.py`` from a checkout's script, else ``fsdp-lab train`` (the same command from any
    directory, installed or not)."""
    return "python train.py" if Path(sys.argv[0]).name == "train.py" else "fsdp-lab train"
