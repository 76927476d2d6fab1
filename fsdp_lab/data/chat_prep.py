"""data=chat through the corpus cache: rows -> pieces -> ids with a learned mask, and back.

In the launcher, ``chat_format`` fixes how rows become text (the layout, read from the first
row's columns, the template and its special tokens, data.train_on): it goes into the cache key
and to the preparing processes. There ``chat_task`` reads a task's rows, renders each
(``chat.pieces``), tokenises the pieces in batches and writes the conversation's ids, its learned
mask and its length; a conversation is held out for validation by a hash of its row (not its
rendering: another template keeps the split), so the split is by conversation and fixed.
``load`` memory-maps a prepared entry as two ``packing.ChatSplit`` laid out in rows of the
run's trainer.seq_len.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import xxhash

from fsdp_lab.config import Config, ConfigError, DataKind
from fsdp_lab.data import chat, formats, tasks
from fsdp_lab.data.packing import ChatSplit, hold_out
from fsdp_lab.data.sources import local_files

log = logging.getLogger(__name__)

BATCH_ROWS = 256  # conversations rendered and tokenised at once


def chat_format(cfg: Config, tok) -> dict:
    """What turns a row into pieces, as plain data (ChatFormat's fields)."""
    d = cfg.data
    first, where = _first_row(d.files, d.kind, d.messages_column)
    layout = d.layout.value
    if layout == "auto":
        layout = chat.detect_layout(
            list(first),
            d.messages_column,
            d.prompt_column,
            d.completion_column,
            source=where,
        )
    strings = layout == "prompt_completion" and isinstance(first.get(d.prompt_column), str)
    try:  # string rows need none; but a later row may hold messages
        template = chat.template_of(tok, d.chat_template)
    except ConfigError:
        if not strings or d.chat_template is not None:
            raise
        template = None
    fmt = chat.ChatFormat(
        layout=layout,
        template=template,
        bos=_default_bos(tok) if strings else None,
        template_vars=chat.template_vars_of(tok) if tok is not None else {},
        train_on=d.train_on.value,
        messages_column=d.messages_column,
        prompt_column=d.prompt_column,
        completion_column=d.completion_column,
    )
    return asdict(fmt)


def _default_bos(tok) -> str | None:
    """The BOS text where the tokenizer opens every text with it (Llama's), else None."""
    bos = getattr(tok, "bos_token", None)
    if tok is None or bos is None:
        return None
    ids = tok("a", add_special_tokens=True)["input_ids"]
    return bos if ids and ids[0] == tok.bos_token_id else None


def _first_row(patterns: list[str], kind: DataKind, column: str) -> tuple[dict, str]:
    """The first row of the first non-empty file, and where it is (for the layout): read
    through the first segment the planner cuts, as a preparing process reads it."""
    files = local_files(patterns)
    fmt = formats.file_format(files, kind)
    path = next((f for f in files if f.stat().st_size), None)  # (plan warns of empty ones)
    if path is None:
        raise ConfigError("data.files: every file is empty; add conversations")
    first = formats.cut([path], fmt, step=tasks.MAX_TASK_BYTES, column=None)[0]
    for row, where in formats.read_rows(first):
        if not isinstance(row, dict):
            raise ConfigError(
                f"data.files: {where()} is a JSON {type(row).__name__}, not an object with a "
                f"{column!r} field; each row must be an object"
            )
        return row, str(path)
    raise ConfigError(f"data.files: {path} holds no row; add conversations")


# -- in a preparing process -----------------------------------------------------------------------


def chat_task(runner, task, out) -> dict:
    """A task's rows as conversations: ids, learned mask and length (``worker.TaskRunner``'s
    ``run`` calls it with the task's ``ShardWriter``)."""
    fmt = chat.ChatFormat(**runner.setup.chat)
    batch: list[tuple[chat.Pieces, bool, bytes]] = []
    skipped = 0
    for seg in task.segments:
        for row, where in formats.read_rows(seg):
            got = chat.pieces(row, fmt, where)
            if got is None:
                skipped += 1
                continue
            batch.append((*got, _identity(row)))
            if len(batch) >= BATCH_ROWS:
                _write(batch, runner, out)
                batch = []
        _write(batch, runner, out)
        batch = []
        runner.progress(seg.size)
    return {"skipped": skipped}


def _identity(row: dict) -> bytes:
    """What decides a conversation's split: the row itself, not its rendering, so another
    template or data.train_on keeps every conversation in its split (and a row read from
    parquet or JSON lines is the same row)."""
    return json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode("utf-8")


def _write(batch: list[tuple[chat.Pieces, bool, bytes]], runner, out) -> None:
    if not batch:
        return
    setup = runner.setup
    ids = iter(runner.encoder.encode([text for pieces, _, _ in batch for text, _ in pieces]))
    eos = np.array([setup.eos], dtype=np.int64)
    for pieces, add_eos, identity in batch:
        parts, learned = [], []
        for _, trained in pieces:
            part = next(ids)
            parts.append(part)
            learned.append(np.full(len(part), trained, dtype=np.uint8))
        if add_eos:  # prompt/completion strings: the completion ends with EOS, learned
            parts.append(eos)
            learned.append(np.ones(1, dtype=np.uint8))
        conversation = np.concatenate(parts)
        if len(conversation) == 0:
            continue
        split = runner.split_of(identity)
        out.add_conversation(split, conversation, np.concatenate(learned))


# -- a prepared entry -----------------------------------------------------------------------------


@dataclass
class ChatCorpus:
    """A prepared data=chat corpus, laid out in rows of ``seq_len``: ``corpus.Corpus``'s fields
    (train and val are ``ChatSplit``s: ``len()`` counts rows) and the counts a user checks."""

    train: ChatSplit
    val: ChatSplit
    fingerprint: str
    num_tokens: int
    num_documents: int
    path: Path
    skipped: int  # rows without an assistant turn

    def summary(self) -> dict:
        """Conversations, tokens, the share learned, and what did not fit (run.json, preview)."""
        splits = {"train": self.train, "val": self.val}
        learned = {k: s.learned_tokens() for k, s in splits.items()}
        in_rows = {k: int(s.lengths.sum()) for k, s in splits.items()}
        return {
            "conversations": {k: s.conversations for k, s in splits.items()},
            "rows": {k: len(s) for k, s in splits.items()},
            "tokens": self.num_tokens,
            "tokens_in_rows": in_rows,
            "learned_tokens": learned,
            "learned_share": round(sum(learned.values()) / max(1, sum(in_rows.values())), 4),
            "row_fill": round(
                sum(in_rows.values())
                / max(1, sum(len(s) for s in splits.values()) * self.train.seq_len),
                4,
            ),
            "truncated": sum(s.truncated for s in splits.values()),
            "dropped": sum(s.dropped for s in splits.values()),
            "skipped_without_reply": self.skipped,
        }


def load(entry: Path, meta, cfg: Config) -> ChatCorpus:
    """A prepared entry as rows of trainer.seq_len (packing and overlong as data. says);
    ``meta``: its ``cache.EntryMeta`` (not imported here: the cache's worker imports this
    module)."""
    d, seq_len = cfg.data, cfg.trainer.seq_len
    arrays = {s: _arrays(entry, s, meta.dtype) for s in ("train", "val")}
    if meta.split == "blocks":  # every conversation in one split: hold out the last ones
        tokens, mask, offsets, counts = arrays["train"]
        train, val = hold_out(offsets, counts, d.validation_fraction)
        arrays = {"train": (tokens, mask, *train), "val": (tokens, mask, *val)}
    splits = {
        s: ChatSplit(*a, seq_len=seq_len, packing=d.packing, overlong=d.overlong)
        for s, a in arrays.items()
    }
    identity = [meta.digests, meta.split, seq_len, d.packing.value, d.overlong.value]
    identity.append(d.validation_fraction if meta.split == "blocks" else 0)
    corpus = ChatCorpus(
        train=splits["train"],
        val=splits["val"],
        fingerprint=xxhash.xxh3_128_hexdigest(json.dumps(identity).encode())[:20],
        num_tokens=sum(meta.tokens.values()),
        num_documents=sum(meta.documents.values()),
        path=entry,
        skipped=meta.skipped_rows,
    )
    _check_rows(corpus)
    return corpus


def _arrays(entry: Path, split: str, dtype: str) -> tuple[np.ndarray, ...]:
    """A split's ids, learned mask, conversation offsets and learned counts."""

    def mapped(name: str, dt: str) -> np.ndarray:
        path = entry / f"{split}.{name}"
        n = path.stat().st_size // np.dtype(dt).itemsize
        return np.memmap(path, dtype=dt, mode="r", shape=(n,)) if n else np.empty(0, dt)

    lengths = mapped("docs.bin", "uint32")
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return (
        mapped("bin", dtype),
        mapped("mask.bin", "uint8"),
        offsets,
        mapped("learned.bin", "uint32"),
    )


def _check_rows(corpus: ChatCorpus) -> None:
    t = corpus.train
    if len(t) == 0:
        raise ConfigError(
            f"data.overlong=drop: all {t.conversations:,} training conversations are longer "
            f"than trainer.seq_len={t.seq_len}; raise trainer.seq_len or set "
            "data.overlong=truncate"
            if t.dropped
            else "data: no training conversation; add conversations or lower "
            "data.validation_fraction"
        )
    if t.dropped or t.truncated:
        share = (t.dropped or t.truncated) / max(1, t.conversations)
        log.warning(
            "data: %s of %s training conversations are longer than trainer.seq_len=%d and were "
            "%s (%.1f%%); raise trainer.seq_len to keep them whole",
            f"{t.dropped or t.truncated:,}",
            f"{t.conversations:,}",
            t.seq_len,
            "dropped" if t.dropped else "truncated",
            100 * share,
        )
