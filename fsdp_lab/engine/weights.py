"""A pretrained model directory's weight files, checked before any rank starts: what it holds,
whether every file its index names is there and whole, and whether each tensor's shape is the
model's. Only the safetensors headers are read (a few kB a file), never the tensors.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (each tensor's
dtype, shape and ``data_offsets`` into the data that follows), then the data. A file cut short
(an interrupted copy or download) is found from its size: the header says where the data ends.
Pickled weights (``pytorch_model.bin``) are refused, as every pickle fsdp_lab meets is.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from fsdp_lab.config import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
# Bits an element of each safetensors dtype takes (safetensors' Dtype::bitsize).
DTYPE_BITS = {
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E5M2FNUZ": 8,
    "F8_E4M3FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "I64": 64, "U64": 64, "F64": 64,
}  # fmt: skip
_SHOWN = 3  # keys named in an error


@dataclass(frozen=True)
class FileTensor:
    """Where one tensor lies: its file, dtype (safetensors' name), shape and byte range."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute offsets into the file
    end: int


class WeightFiles:
    """A local model directory's safetensors tensors, read one at a time: whole, or only a
    region (``safe_open(...).get_slice``, an mmap'd byte range). Each read opens and closes its
    file, so the pages it touched leave this process's memory with it."""

    def __init__(self, name_or_path: str) -> None:
        self.path = Path(name_or_path).expanduser()
        if not self.path.is_dir():
            raise ConfigError(
                f"model.name_or_path={name_or_path} is not a local directory; per-rank loading "
                "reads the safetensors files of one"
            )
        self.tensors: dict[str, FileTensor] = {}
        for file in _weight_files(self.path, f"model.name_or_path={name_or_path}"):
            self.tensors.update(_entries(file))

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: t.shape for k, t in self.tensors.items()}

    def read(self, key: str, region: tuple[slice, ...] | None = None):
        """The tensor ``key`` in its file's dtype, or only ``region`` of it."""
        from safetensors import safe_open

        with safe_open(self.tensors[key].file, framework="pt") as f:
            if region is None or not region:
                return f.get_tensor(key)
            return f.get_slice(key)[region]

    def digest(self, key: str, *, chunk: int) -> str:
        """xxh3-128 of the tensor's dtype, shape and bytes as stored, read ``chunk`` at a time."""
        import xxhash

        t = self.tensors[key]
        digest = xxhash.xxh3_128(f"{t.dtype}|{list(t.shape)}|".encode())
        with t.file.open("rb") as f:
            f.seek(t.begin)
            left = t.end - t.begin
            while left > 0:
                data = f.read(min(chunk, left))
                if not data:
                    raise ConfigError(f"{t.file} is cut short; copy the checkpoint again")
                digest.update(data)
                left -= len(data)
        return digest.hexdigest()


def local_files(name_or_path: str) -> WeightFiles | None:
    """A local model directory's safetensors files, their headers read and checked (None: not
    a local directory, a hub id that transformers resolves). Raises ``ConfigError``, one line
    naming the file and the fix, for a directory without weights, with pickled weights only,
    whose index names a missing file, or with a file that is not safetensors or is cut short."""
    return WeightFiles(name_or_path) if Path(name_or_path).expanduser().is_dir() else None


def _weight_files(path: Path, setting: str) -> list[Path]:
    if (path / INDEX).is_file():
        files = _indexed_files(path / INDEX, setting)
    elif (path / SINGLE).is_file():
        files = [path / SINGLE]
    elif any((path / p).is_file() for p in PICKLES):
        raise ConfigError(
            f"{setting} holds pickled weights only ({PICKLES[0]}), which fsdp_lab does not "
            "unpickle; convert them once where you trust the file: AutoModel.from_pretrained(DIR)"
            ".save_pretrained(DIR) writes model.safetensors"
        )
    else:
        raise ConfigError(
            f"model.pretrained=true but {setting} holds no weights ({SINGLE} or {INDEX}); set "
            "model.pretrained=false for random init"
        )
    return files


def _indexed_files(index: Path, setting: str) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{setting}: {index.name} is not a safetensors index ({e})") from e
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise ConfigError(
            f"{setting}: {index.name} names {len(missing)} file(s) the directory lacks "
            f"({', '.join(missing[:_SHOWN])}{', ...' if len(missing) > _SHOWN else ''}); copy the "
            "checkpoint again"
        )
    return [index.parent / n for n in names]


def _entries(file: Path) -> dict[str, FileTensor]:
    """The file's tensors, after checking that the file holds all its data."""
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((v["data_offsets"][1] for v in entries.values()), default=0)
        start = 8 + length
        tensors = {
            k: FileTensor(
                file,
                str(v["dtype"]),
                tuple(int(d) for d in v["shape"]),
                start + int(v["data_offsets"][0]),
                start + int(v["data_offsets"][1]),
            )
            for k, v in entries.items()
        }
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        raise ConfigError(
            f"{file} is not a safetensors file ({_first(str(e))}); copy the checkpoint again"
        ) from e
    _check_ranges(file, tensors, start)
    if 8 + length + end > size:
        raise ConfigError(
            f"{file} is cut short: {size} bytes where its header describes {8 + length + end}; "
            "copy the checkpoint again"
        )
    return tensors


def _check_ranges(file: Path, tensors: dict[str, FileTensor], start: int) -> None:
    """Each tensor's byte range holds exactly its dtype x shape (of the dtypes in
    ``DTYPE_BITS``), and the ranges tile the data from its start without a gap or an overlap
    (as safetensors writes them, and as its reader insists, a rank at a time): one line naming
    the tensor and the file, before any rank."""
    fix = "the file is damaged: copy the checkpoint again"
    for key, t in tensors.items():
        bits = DTYPE_BITS.get(t.dtype)
        if bits is None:  # a dtype newer than this table: its length is safetensors' to check
            continue
        size = math.prod(t.shape) * bits // 8
        if t.end - t.begin != size:
            raise ConfigError(
                f"{file}: tensor {key} ({t.dtype} {list(t.shape)}, {size:,} bytes) has a byte "
                f"range of {t.end - t.begin:,} bytes; {fix}"
            )
    at = start
    for key, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != at:
            what = "overlaps the tensor before it" if t.begin < at else "leaves a gap before it"
            raise ConfigError(
                f"{file}: tensor {key}'s byte range [{t.begin - start}, {t.end - start}) {what} "
                f"(which ends at {at - start}); {fix}"
            )
        at = t.end


def _first(text: str, limit: int = 300) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
