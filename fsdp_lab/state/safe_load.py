"""Reading a checkpoint without running code from it.

A checkpoint may come from a shared filesystem, a colleague or the internet, and Python's pickle
runs whatever a file tells it to. Three places in a checkpoint are pickles:

- DCP's ``.metadata``, which torch reads with a plain ``pickle.load``: read here by an unpickler
  that admits only DCP's metadata dataclasses, torch dtypes, ``torch.Size``, layouts, memory
  formats and paths (``Reader``);
- BYTE_IO items inside the ``.distcp`` shards (the optimizer's param_groups, for example), which
  torch's default load planner reads with ``torch.load(weights_only=False)``: read here with
  ``weights_only=True`` (``LoadPlanner``; the XLA engine's planner does the same);
- the torch files of a checkpoint (RNG states, checkpoint=full's model.pt and optim.pt): read
  with ``weights_only=True`` (``load_plain``), which admits tensors and plain containers.

The trainer state is JSON. ``scan`` reads every one of these before any rank loads the
checkpoint (in the launcher, in ``fsdp-lab export`` and ``fsdp-lab verify``), so a tampered
checkpoint is refused in one line before launch; the ranks read through the same guards.
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from fsdp_lab.internals import torch_private
from fsdp_lab.state.integrity import CheckpointError

_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch's layouts by name
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: every global outside the allowlist is refused,
    so no callable (``os.system``, ``builtins.eval``, ``getattr``) can be reached."""

    def find_class(self, module: str, name: str):
        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _METADATA_GLOBALS or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("it holds a persistent id")


def _refused(path: Path, what: str, reason: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path}: {what} is not plain data ({reason}), which loading a checkpoint "
        "never needs: refusing to read it; it may have been tampered with, get it again from "
        "its source"
    )


def _reason(e: Exception) -> str:
    """One line out of pickle's or torch's (many-line) refusal."""
    text = str(e)
    found = re.search(r"GLOBAL ([\w.]+)", text)
    if found:
        return f"it refers to {found.group(1)}"
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def read_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` of checkpoint ``path``, through the restricted unpickler."""
    try:
        with open(path / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: cannot read .metadata ({e})") from None
    except Exception as e:  # noqa: BLE001 - any failure to unpickle is a refusal
        raise _refused(path, ".metadata", _reason(e)) from None
    if not isinstance(metadata, Metadata):
        raise _refused(path, ".metadata", f"it is a {type(metadata).__name__}")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or "/" in name or "\\" in name or name.startswith("."):
            raise _refused(path, ".metadata", f"it points at a file {name!r} outside it")
    return metadata


class Reader(dcp.FileSystemReader):
    """torch's file reader, with the metadata read by the restricted unpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_bytes(value: io.BytesIO, what: str, path: Path | str = "") -> object:
    """A BYTE_IO item (a pickled Python value), admitting only plain data."""
    try:
        return torch.load(value, weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise _refused(Path(path), what, _reason(e)) from None


class LoadPlanner(DefaultLoadPlanner):
    """torch's default load planner, reading BYTE_IO items with ``weights_only=True`` (its own
    ``load_bytes`` is DefaultLoadPlanner's with that one change)."""

    def __init__(self, checkpoint: Path | str = "", **kwargs) -> None:
        super().__init__(**kwargs)
        self.checkpoint = checkpoint

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_bytes(value, f"the item {fqn}", self.checkpoint)
        if self.flatten_state_dict:
            torch_private.set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load_plain(path: Path, *, mmap: bool = False) -> object:
    """A torch file of tensors and plain containers (``weights_only=True``)."""
    try:
        return torch.load(path, map_location="cpu", mmap=mmap, weights_only=True)
    except OSError as e:
        raise CheckpointError(f"checkpoint {path.parent}: cannot read {path.name} ({e})") from None
    except Exception as e:  # noqa: BLE001
        raise _refused(path.parent, path.name, _reason(e)) from None


def scan(path: Path, marker: dict) -> None:
    """Read every pickle of checkpoint ``path`` through its guard, before any rank loads it:
    the metadata, each BYTE_IO item, the torch files. Tensors' bytes are not read (mmap)."""
    names = set(marker["files"])
    if ".metadata" in names:
        metadata = read_metadata(path)
        byte_items = [
            (index, info)
            for index, info in metadata.storage_data.items()
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata)
        ]
        for index, info in sorted(byte_items, key=lambda x: (x[1].relative_path, x[1].offset)):
            if info.relative_path not in names:
                raise _refused(path, ".metadata", f"it names {info.relative_path}, not listed")
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(
                    f"checkpoint {path}: {index.fqn} was written with DCP storage extensions "
                    f"({info.transform_descriptors}), which fsdp_lab does not read"
                )
            with open(path / info.relative_path, "rb") as f:
                f.seek(info.offset)
                blob = io.BytesIO(f.read(info.length))
            load_bytes(blob, f"the item {index.fqn} in {info.relative_path}", path)
    for name in sorted(names):
        if name.endswith(".pt"):
            load_plain(path / name, mmap=True)
