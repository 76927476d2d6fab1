"""A private name of a library, looked up when used: the one mechanism behind both doors
(``torch_private``, ``transformers_private``). Standard library only."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any


@dataclass(frozen=True)
class Private:
    """``library``'s ``module``.``name`` (dotted: attributes within it), and the public API
    that would replace it."""

    library: str
    module: str
    name: str
    waits_for: str
    cuda: bool = False  # only in CUDA builds of torch

    def get(self) -> Any:
        return _resolve(self)


@functools.cache
def _resolve(private: Private) -> Any:
    """``private``'s object (looked up once); a line naming it and the fix where it moved."""
    try:
        value = importlib.import_module(private.module)
        for part in private.name.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError) as e:
        lib = private.library
        raise RuntimeError(
            f"{lib} {version(lib)} has no {private.module}.{private.name}, which fsdp_lab "
            f"uses until {private.waits_for} ({e}): pin the {lib} of pyproject.toml's range"
        ) from None
    return value


def missing(names: Iterable[Private]) -> list[str]:
    """A line for each of ``names`` its library lacks."""
    lines = []
    for private in names:
        try:
            private.get()
        except RuntimeError as e:
            lines.append(str(e))
    return lines
