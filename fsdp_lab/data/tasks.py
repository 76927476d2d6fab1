"""A corpus cut into an ordered list of tasks, each a few segments one preparing process reads.

A segment is a byte range of a JSON-lines file, a row group of a parquet file, a piece of a long
text file, a range of token ids, rows of an Arrow file or a stream. Concatenating the tasks'
outputs in task order gives the same token stream however the corpus was cut and however many
processes read it: the only cuts that could change a token are those inside one long text
document, and they lie on a fixed grid (PIECE_BYTES) at a single newline between two non-space
characters, where a byte-level BPE tokenizer (GPT-2, Llama 3, Qwen2, SmolLM2) gives the same
tokens as for the whole text.

Planning reads only what it must (sizes, parquet footers, a CSV header, the first line of a
JSON file, a window around each cut), so a corpus of many GB is planned in a moment.
"""

from __future__ import annotations

import io
import json
import os
import re
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np

from fsdp_lab.config import ConfigError, DataConfig, DataKind
from fsdp_lab.data.sources import is_compressed, load_hub, non_empty, open_input

PIECE_BYTES = 1 << 20  # a long text document is tokenised in pieces of about this size
WINDOW_BYTES = 1 << 20  # how far past a nominal cut to look for a clean one
# Tasks: about 64 per corpus, between 1 and 16 MiB each (never a function of data.num_proc, so
# a stopped preparation continues with the same tasks on any number of processes).
MIN_TASK_BYTES, MAX_TASK_BYTES, TASKS_PER_CORPUS = 1 << 20, 16 << 20, 64
UNTIL_END = -1  # a segment's stop for a stream read to its end (a compressed file)
# Where a text piece may end: after a lone newline between two non-space characters.
CLEAN_CUT = re.compile(rb"(?<=[^\s])\n(?=[^\s])")


@dataclass(frozen=True)
class Segment:
    """Part of one input that a task reads in order.

    ``start``/``stop`` are byte offsets (text, jsonl), row groups (parquet), rows (arrow) or
    token indices (bin, npy). A long text document spans several pieces: EOS follows only the last
    (``doc_end``), and its split is decided once by the planner from its head (``split``)."""

    path: str
    format: str  # text | jsonl | json_array | parquet | csv | arrow | bin | npy | stream
    start: int = 0
    stop: int = 0
    size: int = 0  # input bytes it stands for (progress)
    doc_end: bool = True
    split: str | None = None  # "train" | "val" for a piece of a long document


@dataclass(frozen=True)
class Task:
    index: int
    segments: tuple[Segment, ...]

    @property
    def size(self) -> int:
        return sum(s.size for s in self.segments)

    def to_json(self) -> dict:
        return {"index": self.index, "segments": [asdict(s) for s in self.segments]}

    @staticmethod
    def from_json(d: dict) -> Task:
        return Task(d["index"], tuple(Segment(**s) for s in d["segments"]))


@dataclass
class Source:
    """A corpus to prepare: what identifies it in the cache key, and its tasks."""

    key: dict
    tasks: list[Task] = field(default_factory=list)
    total_bytes: int | None = None  # None: unknown (a stream)


def task_bytes(total: int) -> int:
    return int(min(MAX_TASK_BYTES, max(MIN_TASK_BYTES, total // TASKS_PER_CORPUS)))


def group_tasks(segments: list[Segment], per_task: int) -> list[Task]:
    """Consecutive segments grouped into tasks of about ``per_task`` input bytes."""
    tasks: list[Task] = []
    group: list[Segment] = []
    size = 0  # of the group so far (a sum per segment would be quadratic in small files)
    for seg in segments:
        if group and size + seg.size > per_task:
            tasks.append(Task(len(tasks), tuple(group)))
            group, size = [], 0
        group.append(seg)
        size += seg.size
    if group:
        tasks.append(Task(len(tasks), tuple(group)))
    return tasks


# -- text files ---------------------------------------------------------------------------------


def text_segments(files: list[Path], fmt: str, text_column: str, step: int, split_of) -> list:
    """Segments of text files (``split_of(head, length)`` decides a long document's split)."""
    segments: list[Segment] = []
    for path in non_empty(files):
        match fmt:
            case "text":
                segments += _text_file(path, split_of)
            case "json":
                segments += _json_file(path, text_column, step)
            case "parquet":
                segments += _parquet_file(path, text_column)
            case "csv":
                _check_csv_header(path, text_column)
                segments.append(Segment(str(path), "csv", 0, 0, path.stat().st_size))
            case _:
                raise ValueError(f"no reader for format {fmt}")
    return segments


def _text_file(path: Path, split_of) -> list[Segment]:
    """One document per file, in pieces on a fixed grid when it is long."""
    size = path.stat().st_size
    if size <= PIECE_BYTES:
        return [Segment(str(path), "text", 0, size, size)]
    with path.open("rb") as f:
        cuts = [0]
        for nominal in range(PIECE_BYTES, size, PIECE_BYTES):
            cut = _clean_cut(f, nominal, size)
            if cuts[-1] < cut < size:
                cuts.append(cut)
        cuts.append(size)
        f.seek(0)
        split = split_of(f.read(PIECE_BYTES), size)
    return [
        Segment(str(path), "text", a, b, b - a, doc_end=b == size, split=split)
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


def _json_file(path: Path, text_column: str, step: int) -> list[Segment]:
    """JSON lines cut at line ends every ``step`` bytes; a JSON array, or a compressed file
    (which cannot be entered midway), is read whole, in order."""
    size = path.stat().st_size
    with open_input(path) as f:
        head = f.read(1 << 16).lstrip()
        if head.startswith(b"["):
            return [Segment(str(path), "json_array", 0, size, size)]
        first = head.split(b"\n", 1)[0]
        _check_json_fields(path, first, text_column)
        if is_compressed(path):
            return [Segment(str(path), "jsonl", 0, UNTIL_END, size)]
        cuts = [0]
        for nominal in range(step, size, step):
            f.seek(nominal)
            f.readline()
            if cuts[-1] < f.tell() < size:
                cuts.append(f.tell())
    cuts.append(size)
    return [Segment(str(path), "jsonl", a, b, b - a) for a, b in pairwise(cuts)]


def _check_json_fields(path: Path, first_line: bytes, text_column: str) -> None:
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
        raise ConfigError(
            f"data.text_column={text_column!r} is not a column of {path}; its columns are "
            f"{list(row)}"
        )


def _parquet_file(path: Path, text_column: str | None) -> list[Segment]:
    """A parquet file's row groups (``text_column`` None: whole rows, checked by the caller)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except (pa.ArrowException, OSError) as e:
        raise ConfigError(f"data.files: {path} is not a readable parquet file ({e})") from e
    if text_column is not None:
        _check_parquet_column(path, meta.schema.to_arrow_schema(), text_column)
    size, rows = path.stat().st_size, max(1, meta.num_rows)
    return [
        Segment(str(path), "parquet", g, g + 1, size * meta.row_group(g).num_rows // rows)
        for g in range(meta.num_row_groups)
    ]


def _check_parquet_column(path: Path, schema, text_column: str) -> None:
    import pyarrow as pa

    if text_column not in schema.names:
        raise ConfigError(
            f"data.text_column={text_column!r} is not a column of {path}; its columns are "
            f"{schema.names}"
        )
    column_type = schema.field(text_column).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise ConfigError(
            f"data.text_column={text_column!r} of {path} holds {column_type}, not text; name "
            "the text column"
        )


def _check_csv_header(path: Path, text_column: str) -> None:
    import csv

    with io.TextIOWrapper(open_input(path), encoding="utf-8", errors="replace", newline="") as f:
        header = next(csv.reader(f), [])
    if text_column not in header:
        raise ConfigError(
            f"data.text_column={text_column!r} is not a column of {path}; its columns are {header}"
        )


# -- token files ----------------------------------------------------------------------------------


def token_array(path: Path, dtype: str) -> np.ndarray:
    """A token file as a read-only memory map: .bin of ``dtype``, or a 1-D integer .npy."""
    if path.suffix.lower() == ".npy":
        try:
            arr = np.load(path, mmap_mode="r")
        except (ValueError, OSError) as e:
            raise ConfigError(f"data.files: {path} is not a readable .npy file ({e})") from e
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ConfigError(
                f"data.files: {path} holds a {arr.dtype} array of shape {arr.shape}; "
                "data=tokens reads 1-D integer arrays"
            )
        return arr
    itemsize, size = np.dtype(dtype).itemsize, path.stat().st_size
    if size % itemsize:
        raise ConfigError(
            f"data.files: {path} is {size} bytes, not a whole number of data.dtype={dtype} "
            f"ids ({itemsize} bytes each); check data.dtype (uint16 for nanoGPT's .bin files)"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def token_segments(files: list[Path], dtype: str, eos: int, step: int) -> list[Segment]:
    """Token files cut after an EOS about every ``step`` bytes (documents stay whole)."""
    segments: list[Segment] = []
    for path in non_empty(files):
        arr = token_array(path, dtype)
        fmt, per_token = path.suffix.lower()[1:], arr.dtype.itemsize
        cuts, nominal = [0], max(1, step // per_token)
        while cuts[-1] + nominal < len(arr):
            cut = _after_eos(arr, cuts[-1] + nominal, eos)
            if cut >= len(arr):
                break
            cuts.append(cut)
        cuts.append(len(arr))
        segments += [Segment(str(path), fmt, a, b, (b - a) * per_token) for a, b in pairwise(cuts)]
    return segments


def _after_eos(arr: np.ndarray, start: int, eos: int) -> int:
    window = 1 << 16
    while start < len(arr):
        hits = np.flatnonzero(arr[start : start + window] == eos)
        if len(hits):
            return start + int(hits[0]) + 1
        start, window = start + window, window * 2
    return len(arr)


# -- hub datasets and the corpus ------------------------------------------------------------------


def arrow_segments(cache_files: list[str], step: int) -> list[Segment]:
    """Row ranges of the Arrow files datasets converted a hub dataset into."""
    import pyarrow as pa

    segments: list[Segment] = []
    for name in cache_files:
        with pa.memory_map(name) as source:
            rows = pa.ipc.open_stream(source).read_all().num_rows  # zero-copy: a memory map
        size = os.path.getsize(name)
        per = max(1, rows * step // max(1, size))
        for a in range(0, rows, per):
            b = min(rows, a + per)
            segments.append(Segment(name, "arrow", a, b, size * (b - a) // max(1, rows)))
    return segments


def _column(d: DataConfig) -> str | None:
    """The text column to check in each file; None: whole rows are read (data=chat)."""
    return None if d.kind is DataKind.chat else d.text_column


def plan(d: DataConfig, key: dict, *, eos: int | None, hf_cache: Path, split_of) -> Source:
    """The corpus's tasks, in order. ``split_of(head, length)`` decides the split of a long text
    document (read in pieces) the way a preparing process decides any other's."""
    if "files" in key:
        files = [Path(name) for name, _, _ in key["files"]]
        total = sum(size for _, size, _ in key["files"])
        step = task_bytes(total)
        segments = (
            token_segments(files, d.dtype.value, eos, step)
            if d.kind is DataKind.tokens
            else text_segments(files, key["format"], _column(d), step, split_of)
        )
    elif d.streaming:
        total, segments = None, [Segment(d.name, "stream")]
    else:
        cache_files = [f["filename"] for f in load_hub(d, hf_cache, streaming=False).cache_files]
        total = sum(os.path.getsize(f) for f in cache_files)
        segments = arrow_segments(cache_files, task_bytes(total))
    if not segments:
        raise ConfigError("data.files: every file is empty; add text")
    return Source(key, group_tasks(segments, task_bytes(total or 0)), total)
