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
import struct
from pathlib import Path

from torch import nn

from fsdp_lab.config import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
_SHOWN = 3  # keys named in an error


def read_headers(name_or_path: str) -> dict[str, tuple[int, ...]] | None:
    """Every tensor's shape in a local model directory's safetensors files (None: not a local
    directory, a hub id that transformers resolves). Raises ``ConfigError``, one line naming
    the file and the fix, for a directory without weights, with pickled weights only, whose
    index names a missing file, or with a file that is not safetensors or is cut short."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        return None
    setting = f"model.name_or_path={name_or_path}"
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
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        shapes.update(_header(file))
    return shapes


def check_shapes(shapes: dict[str, tuple[int, ...]], model: nn.Module, name_or_path: str) -> None:
    """Each checkpoint tensor the model has under the same name has the model's shape (a
    config.json that disagrees with its weights: another size, another vocabulary). Names the
    model does not have are left to transformers, which renames and merges some as it loads
    (Mixtral's per-expert tensors into one)."""
    own = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    wrong = [(k, s, own[k]) for k, s in shapes.items() if k in own and own[k] != s]
    if wrong:
        shown = "; ".join(
            f"{k} is {list(s)} in the file, {list(m)} in the model" for k, s, m in wrong[:_SHOWN]
        )
        raise ConfigError(
            f"model.name_or_path={name_or_path}: {len(wrong)} tensor(s) disagree with its "
            f"config.json ({shown}); the weights and config.json come from different models"
        )


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


def _header(file: Path) -> dict[str, tuple[int, ...]]:
    """The file's tensors and shapes, after checking that the file holds all its data."""
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if not 0 < length <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((v["data_offsets"][1] for v in entries.values()), default=0)
        shapes = {k: tuple(int(d) for d in v["shape"]) for k, v in entries.items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as e:
        raise ConfigError(
            f"{file} is not a safetensors file ({_first(str(e))}); copy the checkpoint again"
        ) from e
    if 8 + length + end > size:
        raise ConfigError(
            f"{file} is cut short: {size} bytes where its header describes {8 + length + end}; "
            "copy the checkpoint again"
        )
    return shapes


def _first(text: str, limit: int = 300) -> str:
    line = text.splitlines()[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."
