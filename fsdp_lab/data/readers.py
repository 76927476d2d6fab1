"""The document files' formats, each cut into segments and read back: plain text, JSON (lines
or one array), parquet and CSV. ``fsdp_lab.data.formats`` holds their rows.

Cutting reads only what it must (sizes, parquet footers, a CSV header, the first line of a JSON
file, a window around each cut), so a corpus of many GB is planned in a moment; a wrong column
fails then, before any work. Reading yields a segment's texts one by one (a piece of a long text
file is one text), SKIPPED for a row without text, or its whole rows (data=chat), in bounded
memory, and stops a bad input with one line naming the file and the line or row: malformed JSON,
text that is not UTF-8, a text column holding something else.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import re
import sys
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path

from fsdp_lab.config import ConfigError
from fsdp_lab.data.segment import PIECE_BYTES, UNTIL_END, Cutting, Segment
from fsdp_lab.data.sources import is_compressed, open_input

CHUNK_BYTES = 1 << 20
WINDOW_BYTES = 1 << 20  # how far past a nominal cut to look for a clean one
# Where a text piece may end: after a lone newline between two non-space characters.
CLEAN_CUT = re.compile(rb"(?<=[^\s])\n(?=[^\s])")
SKIPPED = object()  # yielded for a row without text: counted, not tokenised

Rows = Iterator[tuple[object, Callable[[], str]]]  # each row, and a function naming it


# -- what every reader shares ---------------------------------------------------------------------


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


def not_utf8(path: str, byte: int, where: str) -> ConfigError:
    return ConfigError(
        f"data.files: {path} is not UTF-8 text: byte 0x{byte:02x} {where}; convert it to UTF-8 "
        "(iconv -f <its encoding> -t utf-8) or leave it out"
    )


def _not_utf8_at(path: str, offset: int, byte: int) -> ConfigError:
    where = f"at line {_line_of(path, offset)} (byte offset {offset})"
    return not_utf8(path, byte, where)


def field_value(row, column: str, where) -> str | object:
    """A row's text in ``column`` (``where()`` names the row, computed only for a bad one)."""
    if not isinstance(row, dict):
        raise ConfigError(
            f"data.files: {where()} is a JSON {type(row).__name__}, not an object with a "
            f"{column!r} field; each row must be an object"
        )
    return text_value(row.get(column), column, where)


def text_value(value, column: str, where) -> str | object:
    """A column's value as a text, SKIPPED where it holds none; anything else stops the input."""
    if isinstance(value, str):
        return value if not value.isspace() and value else SKIPPED
    if value is None:
        return SKIPPED
    raise ConfigError(
        f"data.files: {where()}: {column!r} holds a {type(value).__name__}, not text; set "
        "data.text_column to the text's column"
    )


def missing_column(column: str, where: str, columns: list) -> ConfigError:
    return ConfigError(
        f"data.text_column={column!r} is not a column of {where}; its columns are {columns}"
    )


# -- plain text: a file is one document -----------------------------------------------------------


def cut_text(path: Path, how: Cutting) -> list[Segment]:
    """One document per file, in pieces on a fixed grid when it is long (its split decided
    from its head by ``how.split_of``)."""
    size = path.stat().st_size
    if size <= PIECE_BYTES:
        return [Segment(str(path), how.format, 0, size, size)]
    with path.open("rb") as f:
        cuts = [0]
        for nominal in range(PIECE_BYTES, size, PIECE_BYTES):
            cut = _clean_cut(f, nominal, size)
            if cuts[-1] < cut < size:
                cuts.append(cut)
        cuts.append(size)
        f.seek(0)
        split = how.split_of(f.read(PIECE_BYTES), size)
    return [
        Segment(str(path), how.format, a, b, b - a, doc_end=b == size, split=split)
        for a, b in pairwise(cuts)
    ]


def _clean_cut(f, nominal: int, size: int) -> int:
    """The first clean cut after ``nominal``: after a lone newline between non-space characters,
    else after any newline, else at a character boundary (a megabyte without a newline)."""
    f.seek(nominal)
    window = f.read(WINDOW_BYTES)
    m = CLEAN_CUT.search(window)
    if m is None:
        nl = window.find(b"\n")
        if nl >= 0:
            return nominal + nl + 1
        # UTF-8 continuation bytes are 0b10xxxxxx: never start a piece inside a character.
        lead = next((i for i, b in enumerate(window) if b & 0xC0 != 0x80), len(window))
        return min(size, nominal + lead)
    return nominal + m.end()


def read_text(seg: Segment, column: str) -> Iterator[str]:
    """A piece of a text file, as one text."""
    with open(seg.path, "rb") as f:
        f.seek(seg.start)
        raw = f.read(seg.stop - seg.start)
    try:
        yield raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_utf8_at(seg.path, seg.start + e.start, raw[e.start]) from None


# -- JSON: one row a line, or one array of rows ---------------------------------------------------


def _head(path: str | Path) -> bytes:
    """The first bytes of a JSON file, leading space removed: its first row, or its ``[``."""
    with open_input(path) as f:
        return f.read(1 << 16).lstrip()


def _is_array(head: bytes) -> bool:
    """A JSON array of rows, not JSON lines: decided from the head by the cutter and again by
    the reader of its first segment, so the two agree."""
    return head.startswith(b"[")


def cut_json(path: Path, how: Cutting) -> list[Segment]:
    """JSON lines cut at line ends every ``how.step`` bytes; a JSON array, or a compressed file
    (which cannot be entered midway), is read whole, in order."""
    size = path.stat().st_size
    head = _head(path)
    if _is_array(head):
        return [Segment(str(path), how.format, 0, size, size)]
    _check_json_fields(path, head.split(b"\n", 1)[0], how.column)
    if is_compressed(path):
        return [Segment(str(path), how.format, 0, UNTIL_END, size)]
    cuts = [0]
    with path.open("rb") as f:
        for nominal in range(how.step, size, how.step):
            f.seek(nominal)
            f.readline()
            if cuts[-1] < f.tell() < size:
                cuts.append(f.tell())
    cuts.append(size)
    return [Segment(str(path), how.format, a, b, b - a) for a, b in pairwise(cuts)]


def _check_json_fields(path: Path, first_line: bytes, text_column: str | None) -> None:
    """The text column is a field of the first row (a wrong column fails before any work)."""
    try:
        row = json.loads(first_line)
    except ValueError:
        if first_line.strip() == b"{":  # one object over many lines: a document, not rows
            raise ConfigError(
                f"data.files: {path} is one JSON object, not JSON lines or an array of rows; "
                f"write one row a line (e.g. jq -c '.data[]' {path.name} > rows.jsonl)"
            ) from None
        return  # named with its line by the reader
    if isinstance(row, dict) and text_column is not None and text_column not in row:
        raise missing_column(text_column, str(path), list(row))


def read_json(seg: Segment, column: str) -> Iterator[str | object]:
    for row, where in json_rows(seg):
        yield field_value(row, column, where)


def json_rows(seg: Segment) -> Rows:
    """A segment's rows: an array's elements (its first and only segment), or JSON lines."""
    if seg.start == 0 and _is_array(_head(seg.path)):
        yield from _json_array_rows(seg)
    else:
        yield from _json_line_rows(seg)


def _json_line_rows(seg: Segment) -> Rows:
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


def _json_array_rows(seg: Segment) -> Rows:
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


# -- parquet: a segment a row group --------------------------------------------------------------


def cut_parquet(path: Path, how: Cutting) -> list[Segment]:
    """A parquet file's row groups (``how.column`` None: whole rows, checked by the caller)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"data.files: {path} is not a readable parquet file ({e})") from e
    if how.column is not None:
        _check_parquet_column(path, meta.schema.to_arrow_schema(), how.column)
    size, rows = path.stat().st_size, max(1, meta.num_rows)
    return [
        Segment(str(path), how.format, g, g + 1, size * meta.row_group(g).num_rows // rows)
        for g in range(meta.num_row_groups)
    ]


def _check_parquet_column(path: Path, schema, text_column: str) -> None:
    import pyarrow as pa

    if text_column not in schema.names:
        raise missing_column(text_column, str(path), schema.names)
    column_type = schema.field(text_column).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise ConfigError(
            f"data.text_column={text_column!r} of {path} holds {column_type}, not text; name "
            "the text column"
        )


def read_parquet(seg: Segment, column: str) -> Iterator[str | object]:
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
            yield text_value(value, column, lambda n=row: f"{seg.path} row {n}")


def parquet_rows(seg: Segment) -> Rows:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(seg.path, buffer_size=1 << 20, pre_buffer=False)
    row = sum(pf.metadata.row_group(g).num_rows for g in range(seg.start))
    for batch in pf.iter_batches(
        batch_size=256, row_groups=range(seg.start, seg.stop), use_threads=False
    ):
        for value in batch.to_pylist():
            row += 1
            yield value, lambda n=row: f"{seg.path} row {n}"


# -- CSV: a file read whole, in order -------------------------------------------------------------


def cut_csv(path: Path, how: Cutting) -> list[Segment]:
    """The whole file, once its header has the text column."""
    with io.TextIOWrapper(open_input(path), encoding="utf-8", errors="replace", newline="") as f:
        header = next(csv.reader(f), [])
    if how.column not in header:
        raise missing_column(how.column, str(path), header)
    return [Segment(str(path), how.format, 0, 0, path.stat().st_size)]


def read_csv(seg: Segment, column: str) -> Iterator[str | object]:
    csv.field_size_limit(sys.maxsize)
    with open_input(seg.path) as raw:
        reader = csv.reader(codecs.iterdecode(raw, "utf-8"))
        try:
            index = next(reader).index(column)
            for row in reader:
                where = lambda: f"{seg.path} line {reader.line_num}"
                yield text_value(row[index] if index < len(row) else None, column, where)
        except UnicodeDecodeError as e:
            where = f"after line {reader.line_num}"
            raise not_utf8(seg.path, e.object[e.start], where) from None
        except csv.Error as e:
            raise ConfigError(
                f"data.files: {seg.path} line {reader.line_num} is not valid CSV ({e}); fix it"
            ) from None
