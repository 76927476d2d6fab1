"""One preparing process: ``python -m fsdp_lab.data.worker SETUP_JSON``.

It reads tasks (JSON lines) on stdin; for each it reads the task's documents in order, tokenises
them in batches, puts each document in the training or the validation split, and writes the
task's two shards (EOS after every document) under the setup's shard directory. It answers one
JSON line per task on stdout: progress while it works, then the task's counts, or one line
naming what was wrong. Its memory is a batch of text and its tokens, whatever the corpus's size.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import xxhash

from fsdp_lab.config import ConfigError, DataConfig, DataKind
from fsdp_lab.data import encode, formats, readers
from fsdp_lab.data.chat_prep import chat_task
from fsdp_lab.data.pool import memory_of
from fsdp_lab.data.segment import PIECE_BYTES, Segment
from fsdp_lab.data.sources import load_hub
from fsdp_lab.data.tasks import Task

SPLITS = ("train", "val")
BATCH_BYTES, BATCH_DOCS = 1 << 20, 1024  # text tokenised at once
FLUSH_TOKENS = 1 << 20  # tokens buffered per split before they are written


@dataclass
class Setup:
    """What every task of one preparation shares."""

    shard_dir: str  # where tasks write their shards (set by cache.build)
    dtype: str  # of the shards: uint16 or uint32
    eos: int
    fraction: float  # validation_fraction
    column: str = "text"
    encoder: str | None = None  # the encoder spec's path; None: token files
    input_dtype: str = "uint16"  # of .bin token files
    id_limit: int | None = None  # token files: ids must be below it (the model's vocabulary)
    stream: dict | None = None  # a streamed hub dataset: DataConfig fields and hf_cache
    chat: dict | None = None  # data=chat: how a row becomes pieces (chat.ChatFormat's fields)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))


def in_validation(head: bytes, length: int, fraction: float) -> bool:
    """A document's split, from its first megabyte and its length: the same document lands in
    the same split whatever file, position, seed or process it comes from."""
    if fraction <= 0:
        return False
    return xxhash.xxh3_64_intdigest(head[:PIECE_BYTES], seed=length) < fraction * 2.0**64


class CacheWriteError(Exception):
    """Writing a shard failed (a full disk, most often): not the input's fault."""

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


IDS = "bin"  # the stream of token ids: <split>.bin
PER_DOCUMENT = ("docs.bin", "learned.bin")  # streams with one element a conversation


def streams(chat: bool) -> dict[str, str | None]:
    """The files of each split and what each holds per element: the token ids (the shards'
    dtype: None), and for data=chat which tokens are learned (uint8, one per token), each
    conversation's length and its learned tokens after the first (uint32 each, one per
    conversation: the counts need no pass over the mask; no EOS between conversations)."""
    if not chat:
        return {IDS: None}
    return {IDS: None, "mask.bin": "uint8", "docs.bin": "uint32", "learned.bin": "uint32"}


class ShardWriter:
    """A task's shards (each split's streams), written as the task goes, named final only once
    complete."""

    def __init__(self, directory: Path, index: int, dtype: str, eos: int, *, chat=False) -> None:
        self.dtype, self.eos = np.dtype(dtype), np.array([eos], dtype=dtype)
        self.streams = {k: np.dtype(v or dtype) for k, v in streams(chat).items()}
        self.paths = {
            (s, k): directory / f"{index:06d}.{s}.{k}" for s in SPLITS for k in self.streams
        }
        try:
            self.files = {sk: open(f"{p}.tmp", "wb") for sk, p in self.paths.items()}  # noqa: SIM115
        except OSError as e:
            raise CacheWriteError(e) from e
        self.pending: dict[tuple, list[np.ndarray]] = {sk: [] for sk in self.paths}
        self.buffered = dict.fromkeys(SPLITS, 0)
        self.documents, self.tokens = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
        self.max_id = -1

    def add(self, split: str, ids: np.ndarray, *, doc_end: bool = True) -> None:
        self.pending[split, IDS].append(ids)
        if doc_end:
            self.pending[split, IDS].append(self.eos)
            self.documents[split] += 1
        self._added(split, len(ids) + doc_end)

    def add_conversation(self, split: str, ids: np.ndarray, learned: np.ndarray) -> None:
        """A data=chat conversation: its ids and which of them are learned."""
        self.pending[split, IDS].append(ids)
        self.pending[split, "mask.bin"].append(learned)
        self.pending[split, "docs.bin"].append(np.array([len(ids)]))
        self.pending[split, "learned.bin"].append(np.array([int(learned[1:].sum())]))
        self.documents[split] += 1
        self._added(split, len(ids))

    def _added(self, split: str, n: int) -> None:
        self.buffered[split] += n
        if self.buffered[split] >= FLUSH_TOKENS:
            self._flush(split)

    def _flush(self, split: str) -> None:
        for kind, dtype in self.streams.items():
            pending = self.pending[split, kind]
            if not pending:
                continue
            data = np.concatenate(pending).astype(dtype, copy=False)
            if kind == IDS:
                self.max_id = max(self.max_id, int(data.max()))
                self.tokens[split] += len(data)
            try:
                self.files[split, kind].write(data.data)  # (ndarray.tofile drops the errno)
            except OSError as e:
                raise CacheWriteError(e) from e
            self.pending[split, kind] = []
        self.buffered[split] = 0

    def close(self) -> None:
        for split in SPLITS:
            self._flush(split)
        for sk, f in self.files.items():
            try:
                f.close()
                os.replace(f"{self.paths[sk]}.tmp", self.paths[sk])
            except OSError as e:
                raise CacheWriteError(e) from e

    def abandon(self) -> None:
        for sk, f in self.files.items():
            with contextlib.suppress(OSError):  # a full disk fails the close's flush too
                f.close()
            Path(f"{self.paths[sk]}.tmp").unlink(missing_ok=True)


class TaskRunner:
    """Runs tasks of one setup: the encoder (and a stream) are made once per process."""

    def __init__(self, setup: Setup, progress=lambda n: None) -> None:
        self.setup, self.progress = setup, progress
        dtype = np.dtype(setup.dtype)
        self.encoder = (
            None if setup.encoder is None else encode.read_spec(Path(setup.encoder), dtype)
        )
        self._stream = None

    @property
    def stream(self):
        """A streamed hub dataset, opened by the task that reads it (its errors are the task's)."""
        if self._stream is None and self.setup.stream is not None:
            fields = {k: v for k, v in self.setup.stream.items() if k != "hf_cache"}
            d = DataConfig(kind=DataKind(fields.pop("kind")), streaming=True, **fields)
            self._stream = load_hub(d, Path(self.setup.stream["hf_cache"]), streaming=True)
        return self._stream

    def split_of(self, raw: bytes) -> str:
        """The split of a document whose split the planner did not decide, by its content."""
        return "val" if in_validation(raw, len(raw), self.setup.fraction) else "train"

    def run(self, task: Task) -> dict:
        s = self.setup
        out = ShardWriter(Path(s.shard_dir), task.index, s.dtype, s.eos, chat=bool(s.chat))
        try:
            if s.chat:
                extra = chat_task(self, task, out)
            elif self.encoder is None:
                extra = self._token_task(task, out)
            else:
                extra = self._text_task(task, out)
            out.close()
        except BaseException:
            out.abandon()
            raise
        result = {
            "index": task.index,
            "documents": [out.documents[k] for k in SPLITS],
            "tokens": [out.tokens[k] for k in SPLITS],
            "max_id": out.max_id,
            "peak_rss": memory_of(os.getpid())[1],
            **extra,
        }
        try:  # the task's marker is part of the cache: a full disk here is the cache's
            Path(s.shard_dir, f"{task.index:06d}.json").write_text(json.dumps(result))
        except OSError as e:
            raise CacheWriteError(e) from e
        return result

    def _text_task(self, task: Task, out: ShardWriter) -> dict:
        batch: list[tuple[str, Segment]] = []
        size, skipped, budget = 0, 0, (self.setup.stream or {}).get("max_tokens")
        for seg in task.segments:
            streamed = formats.is_streamed(seg)  # no sizes known in advance: the text read
            for text in formats.read_texts(seg, self.setup.column, self.stream):
                if text is readers.SKIPPED:
                    skipped += 1
                    continue
                batch.append((text, seg))
                size += len(text)
                if size >= BATCH_BYTES or len(batch) >= BATCH_DOCS:
                    more = self._encode(batch, out, budget)
                    if streamed:
                        self.progress(size)
                    batch, size = [], 0
                    if not more:
                        return {"skipped": skipped}
            self._encode(batch, out, budget)
            self.progress(size if streamed else seg.size)
            batch, size = [], 0
        return {"skipped": skipped}

    def _encode(self, batch: list[tuple[str, Segment]], out: ShardWriter, budget) -> bool:
        """Tokenise and file a batch; False once ``budget`` tokens are reached (a stream)."""
        if not batch:
            return True
        for (text, seg), ids in zip(batch, self.encoder.encode([t for t, _ in batch]), strict=True):
            split = seg.split or self.split_of(text.encode("utf-8"))
            out.add(split, ids, doc_end=seg.doc_end)
            if (
                budget is not None
                and sum(out.tokens.values()) + sum(out.buffered.values()) >= budget
            ):
                return False
        return True

    def _token_task(self, task: Task, out: ShardWriter) -> dict:
        """Documents of token files: the ids up to and including each EOS (one is added after a
        last document that has none)."""
        s, at = self.setup, None
        for seg in task.segments:
            arr = formats.read_ids(seg, s.input_dtype)
            _check_ids(arr, seg, s.id_limit)
            ends = np.flatnonzero(arr == s.eos) + 1
            if len(ends) == 0 or ends[-1] != len(arr):
                arr, ends = np.append(arr, s.eos), np.append(ends, len(arr) + 1)
            wide = arr.astype("<u4")
            starts = np.concatenate([[0], ends[:-1]])
            for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
                doc = wide[a:b]
                val = in_validation(doc[: PIECE_BYTES // 4].tobytes(), b - a, s.fraction)
                out.add("val" if val else "train", arr[a : b - 1])
            self.progress(seg.size)
            if len(arr) and (at is None or int(arr.max()) > at[2]):
                at = [seg.path, seg.start + int(np.argmax(arr)), int(arr.max())]
        return {"max_at": at}


def _check_ids(arr: np.ndarray, seg: Segment, limit: int | None) -> None:
    if not len(arr):
        return
    low, high = int(arr.min()), int(arr.max())
    if low < 0:
        raise ConfigError(
            f"data.files: {seg.path} holds a negative token id ({low}) at token "
            f"{seg.start + int(np.argmin(arr))}; check data.dtype"
        )
    if limit is not None and high >= limit:
        raise ConfigError(
            f"data.files: {seg.path} holds token id {high} at token "
            f"{seg.start + int(np.argmax(arr))}, beyond the model's vocabulary of {limit}; set "
            f"model.vocab_size>={high + 1}, or check data.dtype and the files"
        )


def write_error(partial: Path, e: OSError) -> str:
    """One line for a failed write of the cache (a full disk, most often)."""
    kept = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file()) / 1e9
    return (
        f"data.cache_dir: cannot write the tokenised corpus in {partial.parent} "
        f"({e.strerror or e}); free space there and run again, or set data.cache_dir to a "
        f"disk with room ({kept:.2f} GB prepared so far are kept in {partial} for the next "
        "run; delete it to free the space)"
    )


def describe_failure(e: BaseException, setup: Setup, task: Task) -> tuple[str, bool]:
    """One line for what stopped a task, and whether the work so far is worth keeping (not
    for bad input: the input must change, and with it the cache key)."""
    shards = Path(setup.shard_dir)
    if isinstance(e, ConfigError):
        return str(e), False
    if isinstance(e, CacheWriteError):
        return write_error(shards.parent, e.error), True
    if isinstance(e, OSError) and e.filename:
        return f"data.files: cannot read {e.filename} ({e.strerror or e})", False
    where = task.segments[0].path if task.segments else "?"
    return f"data: preparing {where} failed: {type(e).__name__}: {e}".splitlines()[0], False


def main(setup_path: str) -> None:
    """Serve tasks until stdin closes; stray prints go to stderr, the answers to stdout. Ctrl-C
    is the launcher's to handle: it stops its preparing processes itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    last = [0.0, 0]

    def send(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")

    def progress(n: int, *, now: bool = False) -> None:
        last[1] += n
        if last[1] and (now or time.monotonic() - last[0] > 0.5):
            send({"progress": last[1]})
            last[0], last[1] = time.monotonic(), 0

    setup = Setup(**json.loads(Path(setup_path).read_text()))
    runner = TaskRunner(setup, progress)
    for line in sys.stdin:
        task = Task.from_json(json.loads(line))
        try:
            result = runner.run(task)
        except Exception as e:  # noqa: BLE001 - reported to the launcher in one line
            if not isinstance(e, (ConfigError, OSError, CacheWriteError)):
                traceback.print_exc()
            message, kept = describe_failure(e, setup, task)
            send({"error": message, "kept": kept})
            return
        progress(0, now=True)
        send({"result": result})


if __name__ == "__main__":
    main(sys.argv[1])
