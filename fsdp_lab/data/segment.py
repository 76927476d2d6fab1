"""A segment: part of one input that a preparing process reads in order, and what cutting an
input into segments needs. Each format's row in ``fsdp_lab.data.formats`` cuts its files into
segments and reads them back; a segment names its row (``format``), so the stage that cuts and the
stage that reads agree on one name. Imports nothing of ours."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

PIECE_BYTES = 1 << 20  # a long text document is tokenised in pieces of about this size
UNTIL_END = -1  # a segment's stop for a stream read to its end (a compressed file)


@dataclass(frozen=True)
class Segment:
    """Part of one input that a task reads in order.

    ``format`` is the name of its row in the format table. ``start``/``stop`` are what that
    format counts in: byte offsets (text, JSON lines), row groups (parquet), rows (arrow) or token
    indices (bin, npy). A long text document spans several pieces: EOS follows only the last
    (``doc_end``), and its split is decided once by the planner from its head (``split``)."""

    path: str
    format: str
    start: int = 0
    stop: int = 0
    size: int = 0  # input bytes it stands for (progress)
    doc_end: bool = True
    split: str | None = None  # "train" | "val" for a piece of a long document


@dataclass(frozen=True)
class Cutting:
    """What cutting one file into segments needs; each format reads the fields it uses."""

    format: str
    """The row's name, which each of its segments carries."""
    step: int
    """About this many input bytes a segment, where the format can be cut."""
    column: str | None = "text"
    """The text column to check before any work; None: whole rows are read (data=chat)."""
    split_of: Callable[[bytes, int], str] | None = None
    """``split_of(head, length)``: the split of a long text document read in pieces."""
    dtype: str = "uint16"
    """Token files without a dtype of their own (.bin): the ids' dtype."""
    eos: int | None = None
    """Token files: a segment ends just after this id, so documents stay whole."""
