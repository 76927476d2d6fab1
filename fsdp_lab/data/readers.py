"""The documents of one segment, read in order and in bounded memory, for a preparing process.

Each reader yields the texts of its segment one by one (a piece of a long text file is one
text), skipping empty ones, and stops a bad input with one line naming the file and the line or
row: malformed JSON, text that is not UTF-8, a text column holding something else. Token files
are read by ``fsdp_lab.data.worker`` directly, as arrays.
"""

from __future__ import annotations

import codecs
import csv
import json
import sys
from collections.abc import Callable, Iterator

from fsdp_lab.config import ConfigError
from fsdp_lab.data.sources import open_input
from fsdp_lab.data.tasks import UNTIL_END, Segment

CHUNK_BYTES = 1 << 20
SKIPPED = object()  # yielded for a row without text: counted, not tokenised


def read_texts(seg: Segment, column: str, stream=None) -> Iterator[str | object]:
    """Texts of ``seg`` in order (SKIPPED for a row whose text is missing or blank)."""
    match seg.format:
        case "text":
            yield _text_piece(seg)
        case "jsonl":
            yield from _json_lines(seg, column)
        case "json_array":
            yield from _json_array(seg, column)
        case "parquet":
            yield from _parquet(seg, column)
        case "csv":
            yield from _csv(seg, column)
        case "arrow":
            yield from _arrow(seg, column)
        case "stream":
            yield from _stream(stream, column)
        case _:
            raise ValueError(f"no reader for format {seg.format}")


def _line_of(path: str, offset: int) -> int:
    """The 1-based line holding byte ``offset`` of the (decompressed) file, read only to name a
    bad line."""
    count, done = 1, 0
    with open_input(path) as f:
        while done < offset:
            chunk = f.read(min(CHUNK_BYTES, offset - done))
            if not chunk:
                break
            count += chunk.count(b"\n")
            done += len(chunk)
    return count


def _not_utf8(path: str, byte: int, where: str) -> ConfigError:
    return ConfigError(
        f"data.files: {path} is not UTF-8 text: byte 0x{byte:02x} {where}; convert it to UTF-8 "
        "(iconv -f <its encoding> -t utf-8) or leave it out"
    )


def _not_utf8_at(path: str, offset: int, byte: int) -> ConfigError:
    where = f"at line {_line_of(path, offset)} (byte offset {offset})"
    return _not_utf8(path, byte, where)


def _text_piece(seg: Segment) -> str:
    with open(seg.path, "rb") as f:
        f.seek(seg.start)
        raw = f.read(seg.stop - seg.start)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8_at(seg.path, seg.start + e.start, raw[e.start]) from None


def _field(row, column: str, where) -> str | object:
    """``where()`` names the row, computed only for a bad one."""
    if not isinstance(row, dict):
        raise ConfigError(
            f"data.files: {where()} is a JSON {type(row).__name__}, not an object with a "
            f"{column!r} field; each row must be an object"
        )
    return _text(row.get(column), column, where)


def _text(value, column: str, where) -> str | object:
    if isinstance(value, str):
        return value if not value.isspace() and value else SKIPPED
    if value is None:
        return SKIPPED
    raise ConfigError(
        f"data.files: {where()}: {column!r} holds a {type(value).__name__}, not text; set "
        "data.text_column to the text's column"
    )


def read_rows(seg: Segment) -> Iterator[tuple[object, Callable[[], str]]]:
    """The rows of ``seg`` whole (data=chat), each with a function naming it for an error."""
    match seg.format:
        case "jsonl":
            yield from _json_line_rows(seg)
        case "json_array":
            yield from _json_array_rows(seg)
        case "parquet":
            yield from _parquet_rows(seg)
        case _:
            raise ConfigError(
                f"data.files: {seg.path} is {seg.format}; data=chat reads .jsonl, .json or "
                ".parquet rows"
            )


def _json_lines(seg: Segment, column: str) -> Iterator[str | object]:
    for row, where in _json_line_rows(seg):
        yield _field(row, column, where)


def _json_line_rows(seg: Segment) -> Iterator[tuple[object, Callable[[], str]]]:
    with open_input(seg.path) as f:
        if seg.start:
            f.seek(seg.start)
        offset = seg.start
        while seg.stop == UNTIL_END or offset < seg.stop:
            line = f.readline()
            if not line:
                break
            here, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except UnicodeDecodeError as e:
                raise _not_utf8_at(seg.path, here + e.start, line[e.start]) from None
            except ValueError as e:
                raise ConfigError(
                    f"data.files: {seg.path} line {_line_of(seg.path, here)} is not valid JSON "
                    f"({str(e).split(': line')[0]}); fix or remove that line"
                ) from None
            yield row, lambda at=here: f"{seg.path} line {_line_of(seg.path, at)}"


def _json_array(seg: Segment, column: str) -> Iterator[str | object]:
    for row, where in _json_array_rows(seg):
        yield _field(row, column, where)


def _json_array_rows(seg: Segment) -> Iterator[tuple[object, Callable[[], str]]]:
    """The elements of a top-level JSON array, decoded as the file is read."""
    decoder, utf8 = json.JSONDecoder(), codecs.getincrementaldecoder("utf-8")()
    buf, pos, read, eof, row, opened = "", 0, 0, False, 0, False
    with open_input(seg.path) as f:
        while True:
            while pos < len(buf) and (buf[pos] in " \t\r\n," or (buf[pos] == "[" and not opened)):
                opened |= buf[pos] == "["
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            if pos < len(buf):
                try:
                    value, end = decoder.raw_decode(buf, pos)
                except ValueError as e:
                    if eof:
                        raise ConfigError(
                            f"data.files: {seg.path} element {row + 1} is not valid JSON "
                            f"({str(e).split(': line')[0]}); fix the file"
                        ) from None
                else:
                    if end < len(buf) or eof:  # a number at the buffer's end may go on
                        row, buf, pos = row + 1, buf[end:], 0
                        yield value, lambda n=row: f"{seg.path} element {n}"
                        continue
            if eof:
                raise ConfigError(f"data.files: {seg.path} ends inside its JSON array; fix it")
            chunk = f.read(CHUNK_BYTES)
            try:
                buf = buf[pos:] + utf8.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                at = read - (len(e.object) - len(chunk)) + e.start
                raise _not_utf8_at(seg.path, at, e.object[e.start]) from None
            pos, read, eof = 0, read + len(chunk), not chunk


def _parquet(seg: Segment, column: str) -> Iterator[str | object]:
    import pyarrow.parquet as pq

    # Buffered, not pre-buffered: pages are decoded as read, so a large row group (300 MB of
    # text measured) costs a batch of memory, not the whole column chunk (110 vs 397 MB RSS).
    pf = pq.ParquetFile(seg.path, buffer_size=1 << 20, pre_buffer=False)
    row = sum(pf.metadata.row_group(g).num_rows for g in range(seg.start))
    for batch in pf.iter_batches(
        batch_size=1024, row_groups=range(seg.start, seg.stop), columns=[column], use_threads=False
    ):
        for value in batch.column(0).to_pylist():
            row += 1
            yield _text(value, column, lambda n=row: f"{seg.path} row {n}")


def _parquet_rows(seg: Segment) -> Iterator[tuple[object, Callable[[], str]]]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(seg.path, buffer_size=1 << 20, pre_buffer=False)
    row = sum(pf.metadata.row_group(g).num_rows for g in range(seg.start))
    for batch in pf.iter_batches(
        batch_size=256, row_groups=range(seg.start, seg.stop), use_threads=False
    ):
        for value in batch.to_pylist():
            row += 1
            yield value, lambda n=row: f"{seg.path} row {n}"


def _csv(seg: Segment, column: str) -> Iterator[str | object]:
    csv.field_size_limit(sys.maxsize)
    with open_input(seg.path) as raw:
        reader = csv.reader(codecs.iterdecode(raw, "utf-8"))
        try:
            index = next(reader).index(column)
            for row in reader:
                where = lambda: f"{seg.path} line {reader.line_num}"
                yield _text(row[index] if index < len(row) else None, column, where)
        except UnicodeDecodeError as e:
            where = f"after line {reader.line_num}"
            raise _not_utf8(seg.path, e.object[e.start], where) from None
        except csv.Error as e:
            raise ConfigError(
                f"data.files: {seg.path} line {reader.line_num} is not valid CSV ({e}); fix it"
            ) from None


def _arrow(seg: Segment, column: str) -> Iterator[str | object]:
    """Rows [start, stop) of one of datasets' Arrow files (memory-mapped: skipping is free)."""
    import pyarrow as pa

    with pa.memory_map(seg.path) as source:
        reader, row = pa.ipc.open_stream(source), 0
        if column not in reader.schema.names:
            raise ConfigError(
                f"data.text_column={column!r} is not a column of the dataset; its columns are "
                f"{reader.schema.names}"
            )
        for batch in reader:
            lo, hi = max(seg.start - row, 0), min(seg.stop - row, batch.num_rows)
            if lo < hi:
                values = batch.column(column).slice(lo, hi - lo).to_pylist()
                for i, value in enumerate(values):
                    yield _text(value, column, lambda n=row + lo + i + 1: f"{seg.path} row {n}")
            row += batch.num_rows
            if row >= seg.stop:
                return


def _stream(dataset, column: str) -> Iterator[str | object]:
    """A streamed dataset's rows as they arrive (``dataset``: datasets' IterableDataset)."""
    for row, example in enumerate(dataset, start=1):
        if column not in example:
            raise ConfigError(
                f"data.text_column={column!r} is not a column of the dataset; its columns are "
                f"{list(example)}"
            )
        yield _text(example[column], column, lambda n=row: f"row {n} of the stream")
