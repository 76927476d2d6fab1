"""The token files' formats (data=tokens): nanoGPT's raw ``.bin`` of ``data.dtype`` ids and a 1-D
integer ``.npy``, each memory-mapped, cut after an EOS about every few MB (documents stay whole)
and read back as arrays of ids. ``fsdp_lab.data.formats`` holds their rows."""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import numpy as np

from fsdp_lab.config import ConfigError
from fsdp_lab.data.segment import Cutting, Segment

Ids = Callable[[Path, str], np.ndarray]  # a token file's ids, given data.dtype


def bin_ids(path: Path, dtype: str) -> np.ndarray:
    """A raw file of ``dtype`` ids as a read-only memory map."""
    itemsize, size = np.dtype(dtype).itemsize, path.stat().st_size
    if size % itemsize:
        raise ConfigError(
            f"data.files: {path} is {size} bytes, not a whole number of data.dtype={dtype} "
            f"ids ({itemsize} bytes each); check data.dtype (uint16 for nanoGPT's .bin files)"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def npy_ids(path: Path, dtype: str) -> np.ndarray:
    """A 1-D integer .npy as a read-only memory map (its own dtype: ``dtype`` is not read)."""
    try:
        arr = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as e:
        raise ConfigError(f"data.files: {path} is not a readable .npy file ({e})") from e
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ConfigError(
            f"data.files: {path} holds a {arr.dtype} array of shape {arr.shape}; "
            "data=tokens reads 1-D integer arrays"
        )
    return arr


def cut_ids(path: Path, how: Cutting, *, ids: Ids) -> list[Segment]:
    """A token file cut after an EOS about every ``how.step`` bytes."""
    arr = ids(path, how.dtype)
    per_token = arr.dtype.itemsize
    cuts, nominal = [0], max(1, how.step // per_token)
    while cuts[-1] + nominal < len(arr):
        cut = _after_eos(arr, cuts[-1] + nominal, how.eos)
        if cut >= len(arr):
            break
        cuts.append(cut)
    cuts.append(len(arr))
    return [Segment(str(path), how.format, a, b, (b - a) * per_token) for a, b in pairwise(cuts)]


def _after_eos(arr: np.ndarray, start: int, eos: int) -> int:
    window = 1 << 16
    while start < len(arr):
        hits = np.flatnonzero(arr[start : start + window] == eos)
        if len(hits):
            return start + int(hits[0]) + 1
        start, window = start + window, window * 2
    return len(arr)
