"""A hub dataset's formats (data=hub): the Arrow files ``datasets`` converts it into, cut into row
ranges, and its stream (data.streaming), read as it arrives. ``fsdp_lab.data.formats`` holds
their rows; no file suffix leads to them, only data=hub."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from fsdp_lab.data.readers import missing_column, text_value
from fsdp_lab.data.segment import Cutting, Segment


def cut_arrow(path: Path, how: Cutting) -> list[Segment]:
    """Row ranges of one of datasets' Arrow files, about ``how.step`` bytes each."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        rows = pa.ipc.open_stream(source).read_all().num_rows  # zero-copy: a memory map
    size = os.path.getsize(path)
    per = max(1, rows * how.step // max(1, size))
    segments = []
    for a in range(0, rows, per):
        b = min(rows, a + per)
        segments.append(Segment(str(path), how.format, a, b, size * (b - a) // max(1, rows)))
    return segments


def read_arrow(seg: Segment, column: str) -> Iterator[str | object]:
    """Rows [start, stop) of one of datasets' Arrow files (memory-mapped: skipping is free)."""
    import pyarrow as pa

    with pa.memory_map(seg.path) as source:
        reader, row = pa.ipc.open_stream(source), 0
        if column not in reader.schema.names:
            raise missing_column(column, "the dataset", reader.schema.names)
        for batch in reader:
            lo, hi = max(seg.start - row, 0), min(seg.stop - row, batch.num_rows)
            if lo < hi:
                values = batch.column(column).slice(lo, hi - lo).to_pylist()
                for i, value in enumerate(values):
                    where = lambda n=row + lo + i + 1: f"{seg.path} row {n}"
                    yield text_value(value, column, where)
            row += batch.num_rows
            if row >= seg.stop:
                return


def read_stream(dataset, column: str) -> Iterator[str | object]:
    """A streamed dataset's rows as they arrive (``dataset``: datasets' IterableDataset, opened
    by the task that reads it)."""
    for row, example in enumerate(dataset, start=1):
        if column not in example:
            raise missing_column(column, "the dataset", list(example))
        yield text_value(example[column], column, lambda n=row: f"row {n} of the stream")
