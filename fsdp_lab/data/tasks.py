"""A corpus: what identifies it in the cache key (``source_key``: no file is opened), and the
ordered list of tasks it is cut into, each a few segments one preparing process reads.

A segment is what its format's row (``fsdp_lab.data.formats``) cuts a file into: a byte range of
a JSON-lines file, a row group of a parquet file, a piece of a long text file, a range of token
ids, rows of an Arrow file, or a stream. Concatenating the tasks' outputs in task order gives the
same token stream however the corpus was cut and however many processes read it: the only cuts
that could change a token are those inside one long text document, and they lie on a fixed grid
(PIECE_BYTES) at a single newline between two non-space characters, where a byte-level BPE
tokenizer (GPT-2, Llama 3, Qwen2, SmolLM2) gives the same tokens as for the whole text.

Planning reads only what it must, so a corpus of many GB is planned in a moment.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fsdp_lab.config import ConfigError, DataConfig
from fsdp_lab.config.data_kinds import Holds, kind_row
from fsdp_lab.config.data_kinds import Source as Origin
from fsdp_lab.data import formats
from fsdp_lab.data.segment import Segment
from fsdp_lab.data.sources import file_stats, load_hub, local_files, non_empty, shakespeare_files

# Tasks: about 64 per corpus, between 1 and 16 MiB each (never a function of data.num_proc, so
# a stopped preparation continues with the same tasks on any number of processes).
MIN_TASK_BYTES, MAX_TASK_BYTES, TASKS_PER_CORPUS = 1 << 20, 16 << 20, 64


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


# -- the corpus -----------------------------------------------------------------------------------


def source_key(d: DataConfig, *, eos: int | None) -> dict:
    """What identifies the corpus in the cache key: the files (path, size, mtime) and how they
    are read, or the hub dataset. Cheap: no file is opened."""
    origin = kind_row(d.kind).source
    if origin is Origin.hub:
        local = [f for f in d.files if os.path.exists(os.path.expanduser(f))]
        return {
            "hub": d.name,
            "subset": d.subset,
            "split": d.split,
            "data_files": d.files,
            "local_files": file_stats(local_files(local)) if local else [],
            "streaming": d.streaming,
            "max_tokens": d.max_tokens,
            "text_column": d.text_column,
        }
    files = shakespeare_files() if origin is Origin.package else local_files(d.files)
    fmt = formats.file_format(files, d.kind)
    if fmt.ids is not None:  # token ids: their dtype and the EOS that ends a document
        return {"files": file_stats(files), "dtype": d.dtype.value, "eos": eos}
    if _column(d) is None:  # whole rows: what renders one (template, train_on) is keyed apart
        return {"files": file_stats(files), "format": fmt.name}
    formats.check_column(fmt, d.text_column)
    return {"files": file_stats(files), "format": fmt.name, "text_column": d.text_column}


def _column(d: DataConfig) -> str | None:
    """The text column to check in each file; None: whole rows are read (data=chat)."""
    return None if kind_row(d.kind).reads is Holds.rows else d.text_column


def plan(d: DataConfig, key: dict, *, eos: int | None, hf_cache: Path, split_of) -> Source:
    """The corpus's tasks, in order. ``split_of(head, length)`` decides the split of a long text
    document (read in pieces) the way a preparing process decides any other's."""
    if "files" in key:
        files = [Path(name) for name, _, _ in key["files"]]
        total = sum(size for _, size, _ in key["files"])
        row = formats.file_format(files, d.kind)
        segments = formats.cut(
            non_empty(files),
            row,
            step=task_bytes(total),
            column=_column(d),
            split_of=split_of,
            dtype=d.dtype.value,
            eos=eos,
        )
    elif d.streaming:
        total, segments = None, [Segment(d.name, formats.HUB_STREAM.name)]
    else:
        cache_files = [f["filename"] for f in load_hub(d, hf_cache, streaming=False).cache_files]
        total = sum(os.path.getsize(f) for f in cache_files)
        paths = [Path(f) for f in cache_files]
        segments = formats.cut(paths, formats.HUB_FILES, step=task_bytes(total))
    if not segments:
        raise ConfigError("data.files: every file is empty; add text")
    return Source(key, group_tasks(segments, task_bytes(total or 0)), total)
