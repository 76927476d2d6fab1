"""Corpora for training: tokenised once into a cache, then memory-mapped as packed blocks.

``prepare`` runs first in the launcher (so a missing file, a wrong column or a malformed row is
one line before any rank starts) and then in every rank, where it finds the cache. The cache key
is everything the tokens depend on: the files (path, size, mtime) or the hub dataset, the column,
the tokenizer (vocabulary and normalisation), the token dtype and the validation share. Not the
block length: a cached corpus serves every ``trainer.seq_len``.

Preparation (``cache.build``) streams the documents in tasks through ``data.num_proc``
processes, in bounded memory, into two token files: each split's documents, in corpus order,
with EOS after each, as uint16 where the vocabulary fits (else uint32). A document is held out
for validation by a hash of its content (``worker.in_validation``), so the split is fixed and no
document is in both; a corpus whose documents all land in one split (one or a few documents) is
split at a block boundary instead. Blocks are the token files cut into ``seq_len`` rows (a
partial last block dropped), memory-mapped. The files' content hash identifies the data in
checkpoints: a copy of the same corpus elsewhere is the same data.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from fsdp_lab.config import Config, ConfigError
from fsdp_lab.config.data_kinds import Holds, Rows, Source, kind_row
from fsdp_lab.config.hardware import cache_root
from fsdp_lab.config.model import task_row
from fsdp_lab.data import cache, cache_lock, chat_prep, encode, tasks, worker
from fsdp_lab.data.worker import Setup, in_validation

log = logging.getLogger(__name__)

FORMAT_VERSION = 3
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
)


@dataclass
class Corpus:
    train: np.ndarray  # [n, seq_len] uint16 or uint32, memory-mapped from the cache
    val: np.ndarray  # [m, seq_len] (m may be 0)
    fingerprint: str  # hash of the tokens and the block length: the same data wherever it is
    num_tokens: int
    num_documents: int
    path: Path  # the cache entry


def default_cache_dir() -> Path:
    return cache_root() / "data"


# -- tokenizer ---------------------------------------------------------------------------------


def load_tokenizer(cfg: Config):
    """The run's tokenizer: data.tokenizer, else the model directory's, else byte-level (ByT5).

    Synthetic data and token files need none (their tokens are ids already): None unless the
    model directory has one, which then goes into the export. A masked_lm run gets a mask token
    added where the tokenizer has none (byte-level)."""
    source, setting = cfg.data.tokenizer, "data.tokenizer"
    if source is None and cfg.model.name_or_path is not None:
        path = Path(cfg.model.name_or_path).expanduser()
        if not path.is_dir() or any((path / f).is_file() for f in TOKENIZER_FILES):
            source, setting = cfg.model.name_or_path, "model.name_or_path"
    row = kind_row(cfg.data.kind)
    if source is None and not row.tokenised:
        if row.prepared and task_row(cfg.model.task).masks_tokens:
            raise ConfigError(
                f"data={cfg.data.kind.value} with model.task=masked_lm needs the tokenizer's "
                "mask and special tokens; set data.tokenizer=<its tokenizer directory>"
            )
        return None
    from transformers import AutoTokenizer, ByT5Tokenizer  # after the return: seconds to import

    if source is None and cfg.model.pretrained:
        raise ConfigError(
            f"model.pretrained=true but {cfg.model.name_or_path} has no tokenizer, and its "
            "embeddings expect its own token ids; set data.tokenizer=<its tokenizer directory>, "
            "or model.pretrained=false to train from scratch on bytes"
        )
    if source is None:
        tok = ByT5Tokenizer(extra_ids=0)
    else:
        try:
            tok = AutoTokenizer.from_pretrained(os.path.expanduser(source))
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            message = (
                f"{setting}={source}: no tokenizer can be loaded from it ({first[:200]}); "
                "point data.tokenizer at a tokenizer directory"
            )
            if not row.prepared and setting == "model.name_or_path":
                log.warning("%s; synthetic data needs none, the export will have none", message)
                return None
            raise ConfigError(message) from e
    if task_row(cfg.model.task).masks_tokens and tok.mask_token_id is None:
        tok.add_special_tokens({"mask_token": "<mask>"})
    if eos_id(tok) is None:
        raise ConfigError(
            f"{setting}={source}: the tokenizer has no EOS (or SEP) token to put "
            "between documents; use another data.tokenizer"
        )
    return tok


def absolute_paths(cfg: Config) -> Config:
    """Local paths made absolute, so that a checkpoint's config still finds them from another
    working directory (a later `fsdp-lab export`, a resumed run started elsewhere)."""

    def absolute(path: str | None) -> str | None:
        if path is None or not os.path.exists(os.path.expanduser(path)):
            return path  # a hub id, or missing (reported where it is needed)
        return str(Path(path).expanduser().resolve())

    d = cfg.data
    hub = kind_row(d.kind).source is Source.hub
    data = dataclasses.replace(
        d,
        tokenizer=absolute(d.tokenizer),
        chat_template=absolute(d.chat_template),
        cache_dir=absolute(d.cache_dir),
        files=[
            # a hub dataset's data_files may be paths inside its repository: only local ones
            absolute(f) if hub else str(Path(os.path.expanduser(f)).absolute())
            for f in d.files
        ],
    )
    model = dataclasses.replace(cfg.model, name_or_path=absolute(cfg.model.name_or_path))
    return dataclasses.replace(cfg, data=data, model=model)


def eos_id(tok) -> int | None:
    return tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id


def _tokenizer_key(tok) -> str | None:
    """Everything that decides the ids: vocabulary, and normaliser/pre-tokeniser (fast
    tokenizers' whole definition) or the init arguments (lower-casing, prefix spaces)."""
    if tok is None:
        return None
    backend = getattr(tok, "backend_tokenizer", None)
    spec = (
        backend.to_str()
        if backend is not None
        else json.dumps(
            [sorted(tok.get_vocab().items()), tok.init_kwargs], ensure_ascii=False, default=str
        )
    )
    return (
        f"{type(tok).__name__}:{len(tok)}:{eos_id(tok)}:"
        + hashlib.sha256(spec.encode()).hexdigest()
    )


# -- the corpus ---------------------------------------------------------------------------------


def prepare(cfg: Config, tok, *, vocab_size: int) -> Corpus:
    """The run's train/validation blocks, tokenised into the cache first where needed.
    ``vocab_size``: the model's; token files must hold only ids below it."""
    d = cfg.data
    eos = _eos(cfg, tok)
    dtype = encode.token_dtype(len(tok) if tok is not None else vocab_size)
    key = {
        "version": FORMAT_VERSION,
        "source": tasks.source_key(d, eos=eos),
        "tokenizer": _tokenizer_key(tok),
        "dtype": dtype.name,
        "validation_fraction": d.validation_fraction,
    }
    chat = kind_row(d.kind).rows is Rows.conversations
    if chat:  # the template and what is learned decide the tokens and mask
        import transformers  # its renderer renders the template: another version may differ

        key["chat"] = chat_prep.chat_format(cfg, tok)
        key["renderer"] = f"transformers {transformers.__version__}"
        key["streams"] = sorted(worker.streams(chat=True))
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    root = Path(d.cache_dir).expanduser() if d.cache_dir else default_cache_dir()
    entry = root / f"tokens-{name}"
    prepared = False
    if not cache.is_complete(entry):
        lock = cache_lock.CacheLock(root / f"tokens-{name}.lock")
        if lock.acquire(entry):
            try:
                if not cache.is_complete(entry):  # made while this process waited for the lock
                    _build(
                        cfg, tok, key, entry, eos=eos, dtype=dtype, vocab=vocab_size,
                        private=lock.private,
                    )  # fmt: skip
                    prepared = True
            finally:
                lock.release()
    meta = cache.EntryMeta.read(entry)
    if chat:
        corpus = chat_prep.load(entry, meta, cfg)
    else:
        corpus = _load(entry, meta, cfg.trainer.seq_len, d.validation_fraction)
    _check_ids(meta, vocab_size)
    _report(corpus, meta, cfg, prepared=prepared)
    return corpus


def _eos(cfg: Config, tok) -> int:
    ids = kind_row(cfg.data.kind).reads is Holds.ids  # token files: data.eos_id may say
    if ids and cfg.data.eos_id is not None:
        return cfg.data.eos_id
    if tok is None:
        raise ConfigError(
            f"data={cfg.data.kind.value} needs the id that ends each document: set "
            "data.eos_id (50256 for GPT-2's tokenizer), or data.tokenizer to take its EOS"
        )
    return eos_id(tok)


def _build(
    cfg: Config, tok, key: dict, entry: Path, *, eos: int, dtype, vocab: int, private: bool
) -> None:
    d, root = cfg.data, entry.parent
    source = tasks.plan(
        d,
        key["source"],
        eos=eos,
        hf_cache=root / "hf_datasets",
        split_of=lambda head, length: (
            "val" if in_validation(head, length, d.validation_fraction) else "train"
        ),
    )
    tokens = kind_row(d.kind).reads is Holds.ids
    stream = None
    if d.streaming:
        fields = ("name", "subset", "split", "files", "max_tokens")
        stream = {f: getattr(d, f) for f in fields} | {"hf_cache": str(root / "hf_datasets")}
        stream["kind"] = d.kind.value
    setup = Setup(
        shard_dir="",
        dtype=dtype.name,
        eos=eos,
        fraction=d.validation_fraction,
        column=d.text_column,
        input_dtype=d.dtype.value,
        id_limit=vocab if tokens else None,
        stream=stream,
        chat=key.get("chat"),
    )
    num_proc = d.num_proc or _usable_cpus()
    procs = 1 if d.streaming else min(num_proc, len(source.tasks))
    log.info(
        "data: preparing %s (%s, %s) into %s",
        _describe_input(source),
        _count(len(source.tasks), "shard"),
        _count(procs, "process", "processes"),
        entry,
    )
    cache.build(
        entry,
        source,
        setup,
        write_encoder=None if tokens else lambda path: encode.write_spec(tok, path),
        num_proc=num_proc,
        private=private,
    )


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a SLURM job's share, not the node's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _describe_input(source: tasks.Source) -> str:
    if source.total_bytes is None:
        return "a stream"
    files = {seg.path for task in source.tasks for seg in task.segments}
    return f"{source.total_bytes / 1e6:,.1f} MB in {len(files)} file(s)"


def _blocks(path: Path, dtype: str, seq_len: int) -> np.ndarray:
    """A token file as [n, seq_len] blocks, memory-mapped (a partial last block dropped)."""
    n = path.stat().st_size // np.dtype(dtype).itemsize // seq_len
    if n == 0:
        return np.empty((0, seq_len), dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(n * seq_len,)).reshape(n, seq_len)


def _load(entry: Path, meta: cache.EntryMeta, seq_len: int, fraction: float) -> Corpus:
    train = _blocks(entry / "train.bin", meta.dtype, seq_len)
    if meta.split == "blocks":  # every document in one split: hold out its last blocks
        n_val = math.ceil(len(train) * fraction) if fraction > 0 else 0
        train, val = train[: len(train) - n_val], train[len(train) - n_val :]
    else:
        val = _blocks(entry / "val.bin", meta.dtype, seq_len)
    identity = [meta.digests, meta.split, seq_len, fraction if meta.split == "blocks" else 0]
    corpus = Corpus(
        train=train,
        val=val,
        fingerprint=xxhash.xxh3_128_hexdigest(json.dumps(identity, sort_keys=True).encode())[:20],
        num_tokens=sum(meta.tokens.values()) - sum(meta.documents.values()),
        num_documents=sum(meta.documents.values()),
        path=entry,
    )
    if len(corpus.train) == 0:
        raise ConfigError(
            f"data: {corpus.num_tokens} tokens make {len(train)} training blocks of "
            f"trainer.seq_len={seq_len}, too few for a training split; lower trainer.seq_len, "
            "lower data.validation_fraction or add text"
        )
    return corpus


def _check_ids(meta: cache.EntryMeta, vocab_size: int) -> None:
    """Every id below the model's vocabulary (token files; a tokenizer's ids are checked
    against it before)."""
    if meta.max_token_id < vocab_size:
        return
    at = meta.max_token_at
    where = (
        f"{at[0]} holds token id {at[2]} at token {at[1]}"
        if at
        else (f"the corpus holds token id {meta.max_token_id}")
    )
    raise ConfigError(
        f"data.files: {where}, beyond the model's vocabulary of {vocab_size}; set "
        f"model.vocab_size>={meta.max_token_id + 1}, or check data.dtype and the files"
    )


def _report(corpus: Corpus, meta: cache.EntryMeta, cfg: Config, *, prepared: bool) -> None:
    """The last line of a preparation (or the line of a cached corpus)."""
    seq_len, chat = cfg.trainer.seq_len, kind_row(cfg.data.kind).rows is Rows.conversations
    kind = f"rows ({cfg.data.packing.value})" if chat else "blocks"
    blocks = f"{len(corpus.train):,} train + {len(corpus.val):,} validation {kind} of {seq_len}"
    if not prepared:
        log.info("data: %s from %s", blocks, corpus.path)
        return
    docs, toks = meta.documents, sum(meta.tokens.values())
    size = sum((corpus.path / f"{s}.bin").stat().st_size for s in ("train", "val"))
    what = "rows without an assistant turn" if chat else "rows without text"
    skipped = f", {meta.skipped_rows:,} {what} skipped" if meta.skipped_rows else ""
    rate = meta.input_bytes / max(meta.seconds, 1e-9) / 1e6
    log.info(
        "data: %s %s (%s validation), %s tokens in %d shards (%s, %.1f MB; %.1f MB/s "
        "read)%s -> %s in %s",
        f"{sum(docs.values()):,}",
        "conversations" if chat else "documents",
        f"{docs['val']:,}",
        f"{toks:,}",
        meta.shards,
        meta.dtype,
        size / 1e6,
        rate,
        skipped,
        blocks,
        corpus.path,
    )
