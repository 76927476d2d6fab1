"""The cache of tokenised corpora: an entry per corpus, prepared once, by one process.

Under ``data.cache_dir``:

    tokens-<key>/             complete: meta.json, train.bin, val.bin (renamed into place whole)
    .tokens-<key>.partial/    a preparation under way: its shards and progress.json
    tokens-<key>.lock         locked (flock) by the process preparing the entry; says which

The first process to arrive takes the lock (``cache_lock``) and prepares; others (a sweep's
jobs, the nodes of a job sharing the directory) wait and say what for. The kernel releases a dead
holder's lock, so the next process takes over, and continues from the shards the dead one
finished: the tasks' shards are appended to the splits in task order, and progress.json records
how far. The entry's meta.json is an ``EntryMeta``, read by its fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from fsdp_lab.config import ConfigError
from fsdp_lab.data.pool import Pool, Progress, Stopped
from fsdp_lab.data.tasks import Source, Task
from fsdp_lab.data.worker import PER_DOCUMENT, SPLITS, Setup, streams, write_error

log = logging.getLogger(__name__)


def is_complete(entry: Path) -> bool:
    return (entry / "meta.json").is_file()


@dataclass
class Totals:
    """What the appended shards hold so far (kept in progress.json)."""

    appended: int = 0  # tasks appended, in order
    documents: dict = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    tokens: dict = field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    skipped: int = 0
    max_id: int = -1
    max_at: list | None = None  # token files: [path, position, id] of the largest id
    peak_rss: int = 0  # the largest peak RSS of a preparing process (bytes)

    def add(self, result: dict) -> None:
        self.appended += 1
        for i, split in enumerate(SPLITS):
            self.documents[split] += result["documents"][i]
            self.tokens[split] += result["tokens"][i]
        self.skipped += result.get("skipped", 0)
        self.max_id = max(self.max_id, result["max_id"])
        self.peak_rss = max(self.peak_rss, result["peak_rss"])
        at = result.get("max_at")
        if at is not None and (self.max_at is None or at[2] > self.max_at[2]):
            self.max_at = at


@dataclass(frozen=True)
class EntryMeta:
    """meta.json of a complete entry: what its token files hold and how they were made. Written
    by ``_commit``; every reader reads these fields (``read``), never the file's keys."""

    dtype: str  # of the token files: uint16 or uint32
    eos: int
    split: str
    """How validation is held out: "documents" (val.bin holds whole documents) or "blocks"
    (every document fell in one split: the last blocks of train.bin, cut at load)."""
    digests: dict[str, str]
    """The content hash of each file ("train", "val", "train.mask", ...), in the order written:
    with the split and the block length, what identifies the data in checkpoints."""
    documents: dict[str, int]  # per split (conversations for data=chat)
    tokens: dict[str, int]  # per split, EOS included
    skipped_rows: int  # rows without text (data=chat: without an assistant turn)
    max_token_id: int
    max_token_at: list | None  # token files: [path, position, id] of the largest id
    shards: int  # tasks the corpus was prepared in
    peak_rss_per_process: int  # bytes: the largest peak RSS of a preparing process
    seconds: float  # the preparation's wall time (of the run that finished it)
    input_bytes: int  # read by that run

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EntryMeta:
        """The record of meta.json's dict, as every version of the cache's format 3 wrote it
        (a key it does not know is left out)."""
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})

    @classmethod
    def read(cls, entry: Path) -> EntryMeta:
        return cls.from_dict(json.loads((entry / "meta.json").read_text()))


def build(
    entry: Path, source: Source, setup: Setup, *, write_encoder, num_proc: int, private: bool
) -> EntryMeta:
    """Prepare ``entry`` (the caller holds its lock): run the tasks not done yet, append their
    shards in task order, and rename the finished entry into place. Returns its meta.
    ``write_encoder(path)`` saves the tokenizer for the preparing processes (None: token files).

    A stop (a kill, Ctrl-C, a full disk, a dead process) keeps the partial entry for the next
    run to continue; bad input removes it, since the input must change (and with it the key)."""
    suffix = f"-{socket.gethostname()}-{os.getpid()}" if private else ""
    partial = entry.parent / f".{entry.name}.partial{suffix}"
    digest = xxhash.xxh3_64_hexdigest(json.dumps([t.to_json() for t in source.tasks]).encode())
    totals = _resume(partial, digest)
    setup = _setup(partial, setup, write_encoder)
    todo = _todo(source, totals, Path(setup.shard_dir))
    progress = Progress(source.total_bytes, sum(t.size for t in source.tasks[: totals.appended]))
    try:
        with _open_splits(partial, totals, setup) as splits:
            results = _results(todo, partial, setup, num_proc, progress)
            _append_in_order(results, source, totals, splits, partial, digest)
    except OSError as e:
        raise Stopped(write_error(partial, e)) from None
    except ConfigError as e:
        if not isinstance(e, Stopped):
            shutil.rmtree(partial, ignore_errors=True)
        raise
    except KeyboardInterrupt:
        progress.close()
        log.warning(
            "data: interrupted after %d of %d shards; they are kept in %s, and the next run "
            "of this corpus continues from there",
            totals.appended,
            len(source.tasks),
            partial,
        )
        raise
    finally:
        progress.close()
    seconds = round(time.monotonic() - progress.start, 2)
    return _commit(entry, partial, totals, setup, seconds, progress.done - progress.initial)


def _setup(partial: Path, setup: Setup, write_encoder) -> Setup:
    """The preparing processes' setup, saved with the tokenizer in the partial entry."""
    shard_dir = partial / "shards"
    shard_dir.mkdir(exist_ok=True)
    setup = dataclasses.replace(setup, shard_dir=str(shard_dir))
    if write_encoder is not None:
        setup.encoder = str(partial / "encoder.json")
        write_encoder(Path(setup.encoder))
    setup.save(partial / "setup.json")
    return setup


def _todo(source: Source, totals: Totals, shard_dir: Path) -> list[Task]:
    """The tasks neither appended nor finished by a run that stopped."""
    todo = [t for t in source.tasks[totals.appended :] if not _finished(shard_dir, t)]
    if totals.appended or len(todo) < len(source.tasks):
        log.info(
            "data: continuing a stopped preparation: %d shards appended, %d more finished, %d "
            "to go",
            totals.appended,
            len(source.tasks) - totals.appended - len(todo),
            len(todo),
        )
    return todo


def _append_in_order(results, source: Source, totals: Totals, splits, partial, digest) -> None:
    """Append each task's shards once every task before it is appended (results arrive in any
    order; a stopped run's finished shards are on disk), recording how far in progress.json."""
    shard_dir, done = partial / "shards", {}

    def append_ready() -> None:
        while totals.appended < len(source.tasks):
            task = source.tasks[totals.appended]
            result = done.pop(task.index, None) or _finished(shard_dir, task)
            if not result:
                return
            _append(shard_dir, task, splits)
            totals.add(result)
            _write_json(partial / "progress.json", {"plan": digest, **totals.__dict__})
            # Only now: a stop before progress.json is written re-appends the task from them
            # (the split files are cut back to the recorded sizes).
            _remove_shards(shard_dir, task, splits)

    with contextlib.closing(results):
        append_ready()
        for result in results:
            done[result["index"]] = result
            append_ready()
    if totals.appended != len(source.tasks):
        raise RuntimeError(f"{totals.appended} of {len(source.tasks)} shards appended")


def _resume(partial: Path, digest: str) -> Totals:
    """The totals of a stopped preparation of the same tasks, or a fresh start."""
    try:
        saved = json.loads((partial / "progress.json").read_text())
    except (OSError, ValueError):
        saved = None
    if saved is not None and saved.pop("plan") == digest:
        return Totals(**saved)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    totals = Totals()  # recorded at once: a stop before the first append keeps finished shards
    _write_json(partial / "progress.json", {"plan": digest, **totals.__dict__})
    return totals


def _finished(shard_dir: Path, task: Task) -> dict | None:
    """A task's result when its shards are complete on disk (a stopped run's work)."""
    try:
        return json.loads((shard_dir / f"{task.index:06d}.json").read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _open_splits(partial: Path, totals: Totals, setup: Setup):
    """Each split's files, cut back to what progress.json says was appended."""
    files = {}
    try:
        for split in SPLITS:
            for kind, dtype in streams(setup.chat is not None).items():
                per = totals.documents if kind in PER_DOCUMENT else totals.tokens
                size = per[split] * np.dtype(dtype or setup.dtype).itemsize
                path = partial / f"{split}.{kind}"
                path.touch()
                f = files[split, kind] = path.open("r+b")
                f.truncate(size)
                f.seek(size)
        yield files
    finally:
        for f in files.values():
            f.close()


def _results(todo: list[Task], partial: Path, setup: Setup, num_proc: int, progress: Progress):
    if not todo:
        return
    streaming = setup.stream is not None
    pool = Pool(
        1 if streaming else min(num_proc, len(todo)),
        partial / "setup.json",
        threads=num_proc if streaming else 1,
    )
    try:
        yield from pool.run(todo, progress.update)
    finally:
        pool.close()


def _append(shard_dir: Path, task: Task, splits: dict) -> None:
    for split, kind in splits:
        shard = shard_dir / f"{task.index:06d}.{split}.{kind}"
        with shard.open("rb") as f:
            shutil.copyfileobj(f, splits[split, kind], 1 << 22)
        splits[split, kind].flush()


def _remove_shards(shard_dir: Path, task: Task, splits: dict) -> None:
    for split, kind in splits:
        (shard_dir / f"{task.index:06d}.{split}.{kind}").unlink(missing_ok=True)
    (shard_dir / f"{task.index:06d}.json").unlink(missing_ok=True)


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _digest_name(split: str, kind: str) -> str:
    """A file's name among the digests: "train" for train.bin, "train.mask" for train.mask.bin."""
    return ".".join([split, *kind.split(".")[:-1]])


def _digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _commit(
    entry: Path, partial: Path, totals: Totals, setup: Setup, seconds: float, input_bytes: int
) -> EntryMeta:
    """meta.json, then the whole entry renamed into place: complete or invisible."""
    if sum(totals.documents.values()) == 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise ConfigError(
            f"data: no row of data.files has a reply to learn ({totals.skipped:,} rows without "
            "an assistant turn); check data.files and data.layout"
            if setup.chat is not None
            else f"data: the corpus has no non-empty text in column {setup.column!r}; check "
            "data.files and data.text_column"
        )
    kinds = streams(setup.chat is not None)
    # progress.json goes first: a stop from here on makes the next run start afresh, never
    # continue from files changed below.
    for name in ("progress.json", "shards", "setup.json", "encoder.json"):
        path = partial / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    split = "documents"
    if setup.fraction > 0 and min(totals.documents.values()) == 0:
        # Every document fell in one split (a corpus of one or a few documents): the
        # validation split becomes the last blocks of that one stream, cut at load.
        split = "blocks"
        if totals.documents["train"] == 0:
            for kind in kinds:
                os.replace(partial / f"val.{kind}", partial / f"train.{kind}")
                (partial / f"val.{kind}").touch()
            for d in (totals.documents, totals.tokens):
                d["train"], d["val"] = d["val"], 0
    meta = EntryMeta(
        dtype=setup.dtype,
        eos=setup.eos,
        split=split,
        digests={
            _digest_name(s, kind): _digest(partial / f"{s}.{kind}")
            for s in SPLITS
            for kind in kinds
        },
        documents=totals.documents,
        tokens=totals.tokens,
        skipped_rows=totals.skipped,
        max_token_id=totals.max_id,
        max_token_at=totals.max_at,
        shards=totals.appended,
        peak_rss_per_process=totals.peak_rss,
        seconds=seconds,
        input_bytes=input_bytes,
    )
    _write_json(partial / "meta.json", meta.to_dict())
    try:
        partial.rename(entry)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)
        if not is_complete(entry):  # a private builder (no locks) may have lost a fair race
            raise
    return meta
