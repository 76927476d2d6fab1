"""The input formats, one row each: the only place that says what a format is.

A row gives the file suffixes that name the format, how a file is cut into segments, how a
segment is read (its texts, its whole rows for data=chat, or its token ids), and whether it may
come compressed. Its name is in the cache key and in each of its segments, from the plan to the
preparing process that reads them. The planner, the preparing processes and data=chat read this
table; nothing else dispatches on a format. A new format is a row here and its cutter and reader
(``readers`` for document files; a module of its own for one with another library).

| format  | suffixes         | cut into                       | texts | chat rows | ids | .gz/.zst |
| text    | .txt .text .md   | a file, pieces of a long one   | yes   |           |     |          |
| json    | .json .jsonl     | line ranges, or a whole array  | yes   | yes       |     | yes      |
| parquet | .parquet         | row groups                     | yes   | yes       |     |          |
| csv     | .csv             | a whole file                   | yes   |           |     | yes      |
| bin     | .bin             | id ranges ending after an EOS  |       |           | yes |          |
| npy     | .npy             | id ranges ending after an EOS  |       |           | yes |          |
| arrow   | (data=hub)       | row ranges                     | yes   |           |     |          |
| stream  | (data.streaming) | one segment                    | yes   |           |     |          |
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np

from fsdp_lab.config import ConfigError, DataKind
from fsdp_lab.config.data_kinds import Holds, kind_row
from fsdp_lab.data import hub_readers, readers, token_readers
from fsdp_lab.data.segment import Cutting, Segment
from fsdp_lab.data.sources import COMPRESSED, format_suffix, is_compressed


@dataclass(frozen=True)
class Format:
    """One input format: a row of the table."""

    name: str
    """In the cache key and in each segment: renaming a format changes its corpora's keys."""
    suffixes: tuple[str, ...]
    """The files it reads (lower case, with the dot); none: reached from data=hub only."""
    cut: Callable[[Path, Cutting], list[Segment]] | None
    """One file into segments, in order (reads only what it must: sizes, a header, a footer);
    None: not cut (a stream is one segment)."""
    texts: Callable[[Segment, str], Iterator[str | object]] | None = None
    """A segment's texts in ``column``, in order (``readers.SKIPPED`` for a row without one)."""
    rows: Callable[[Segment], readers.Rows] | None = None
    """A segment's whole rows, each with a function naming it: data=chat reads the format."""
    ids: token_readers.Ids | None = None
    """A token file's ids (data=tokens), memory-mapped: the format holds ids, not text."""
    compressible: bool = False
    """Read front to back, so it may come compressed (.gz, .zst); others are read by seeking."""
    one_column: bool = False
    """Its files have no columns: a file is one document, its column 'text'."""
    streamed: bool = False
    """Read from the open hub dataset as it arrives (its reader takes the dataset, not the
    segment), so its size is known only as it is read."""

    def holds(self, what: Holds) -> bool:
        """Its reader gives ``what`` (a data kind reads the formats that give its column)."""
        reader = {Holds.texts: self.texts, Holds.rows: self.rows, Holds.ids: self.ids}[what]
        return reader is not None


# A table, a row a format: laid out by hand.
_ROWS = (
    Format("text", (".txt", ".text", ".md"), readers.cut_text, texts=readers.read_text,
           one_column=True),
    Format("json", (".json", ".jsonl"), readers.cut_json, texts=readers.read_json,
           rows=readers.json_rows, compressible=True),
    Format("parquet", (".parquet",), readers.cut_parquet, texts=readers.read_parquet,
           rows=readers.parquet_rows),
    Format("csv", (".csv",), readers.cut_csv, texts=readers.read_csv, compressible=True),
    Format("bin", (".bin",), partial(token_readers.cut_ids, ids=token_readers.bin_ids),
           ids=token_readers.bin_ids),
    Format("npy", (".npy",), partial(token_readers.cut_ids, ids=token_readers.npy_ids),
           ids=token_readers.npy_ids),
    Format("arrow", (), hub_readers.cut_arrow, texts=hub_readers.read_arrow),
    Format("stream", (), None, texts=hub_readers.read_stream, streamed=True),
)  # fmt: skip
INPUT_FORMATS: dict[str, Format] = {row.name: row for row in _ROWS}
HUB_FILES, HUB_STREAM = INPUT_FORMATS["arrow"], INPUT_FORMATS["stream"]  # what data=hub reads


def input_format(name: str) -> Format:
    try:
        return INPUT_FORMATS[name]
    except KeyError:
        known = sorted(INPUT_FORMATS)
        raise ValueError(f"no input format {name!r}; the formats are {known}") from None


def read_by(kind: DataKind) -> list[Format]:
    """The file formats data=<kind> reads: the kind's row names a column of this table (the
    formats whose reader gives texts, whole rows or ids), not a list of formats."""
    holds = kind_row(kind).reads
    if holds is None:
        raise ValueError(f"data.kind {kind} reads no files by their format")
    return [row for row in INPUT_FORMATS.values() if row.suffixes and row.holds(holds)]


def file_format(files: list[Path], kind: DataKind) -> Format:
    """The one format of ``files``, by their suffixes (a compressed file's inner one), as
    data=<kind> reads it; one line naming a file it cannot read, or a mix."""
    by_suffix = {suffix: row for row in read_by(kind) for suffix in row.suffixes}
    found = {by_suffix.get(format_suffix(f)) for f in files}
    if None in found:
        bad = next(f for f in files if format_suffix(f) not in by_suffix)
        packed = sorted(s for s, row in by_suffix.items() if row.compressible)
        also = f" ({', '.join(packed)} also compressed: {sorted(COMPRESSED)})" if packed else ""
        raise ConfigError(
            f"data.files: {bad} has an extension data={kind.value} does not read; use "
            f"{sorted(by_suffix)}{also}"
        )
    if len(found) > 1:
        names = sorted(row.name for row in found)
        raise ConfigError(f"data.files mixes formats {names}; use one format per run")
    row = found.pop()
    packed = next((f for f in files if is_compressed(f)), None)
    if packed is not None and not row.compressible:
        raise ConfigError(
            f"data.files: {packed} is compressed {row.name}, which is read in pieces that need "
            "seeking; decompress it, or store the documents as JSON lines (.jsonl.gz)"
        )
    return row


def check_column(row: Format, column: str) -> None:
    """data.text_column names a column the format has."""
    if row.one_column and column != "text":
        raise ConfigError(
            f"data.text_column={column!r} is not a column of {'/'.join(row.suffixes)} files, "
            "whose one column is 'text' (a file is a document); drop data.text_column"
        )


def cut(files: list[Path], row: Format, *, step: int, **how) -> list[Segment]:
    """``files`` of format ``row`` cut into segments, in order; ``step`` and ``how`` are the
    other fields of ``Cutting``, the format's own."""
    if row.cut is None:
        raise ValueError(f"format {row.name} is not cut into segments")
    cutting = Cutting(row.name, step, **how)
    return [seg for path in files for seg in row.cut(path, cutting)]


def read_texts(seg: Segment, column: str, dataset=None) -> Iterator[str | object]:
    """A segment's texts in order (``dataset``: the open hub dataset of a stream segment)."""
    row = input_format(seg.format)
    if row.texts is None:
        raise ValueError(f"format {row.name} holds token ids, not texts")
    return row.texts(dataset if row.streamed else seg, column)


def read_rows(seg: Segment) -> readers.Rows:
    """A segment's whole rows (data=chat), each with a function naming it for an error."""
    row = input_format(seg.format)
    if row.rows is None:
        whole = sorted(s for r in INPUT_FORMATS.values() if r.holds(Holds.rows) for s in r.suffixes)
        raise ConfigError(
            f"data.files: {seg.path} is {row.name}; {Holds.rows.value} are read from "
            f"{', '.join(whole)}"
        )
    return row.rows(seg)


def read_ids(seg: Segment, dtype: str) -> np.ndarray:
    """A token file segment's ids (``dtype``: data.dtype, for files without one of their own)."""
    row = input_format(seg.format)
    if row.ids is None:
        raise ValueError(f"format {row.name} holds texts, not token ids")
    return np.asarray(row.ids(Path(seg.path), dtype)[seg.start : seg.stop])


def is_streamed(seg: Segment) -> bool:
    """Its size is known only as it is read (progress counts the text read)."""
    return input_format(seg.format).streamed
