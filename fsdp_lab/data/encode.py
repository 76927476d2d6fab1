"""Text -> token ids inside a preparing process, without importing transformers.

The launcher's tokenizer travels to the preparing processes as a file: a fast tokenizer as its
JSON definition (read back by the `tokenizers` library in milliseconds), a byte-level one as its
id offset, anything else pickled. A fast tokenizer is used raw only where it gives the ids the
transformers tokenizer gives on a probe text; otherwise the pickled tokenizer is used as it is.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np

# Spaces, newlines, tabs, punctuation, digits, accents, CJK, emoji, a special token's text.
PROBE = (
    "The  quick\tbrown fox --\n\n  jumped 1234567 times!\r\nÜber café, 東京 🙂 <|endoftext|> </s>"
    "\n\nindented\n    code(x) {return x**2;}"
)


def token_dtype(num_ids: int) -> np.dtype:
    """2 bytes a token where every id fits, else 4."""
    return np.dtype(np.uint16 if num_ids <= 1 << 16 else np.uint32)


def write_spec(tok, path: Path) -> str:
    """Save what a preparing process needs to encode as ``tok`` does; returns the spec's kind."""
    if type(tok).__name__ == "ByT5Tokenizer":  # its Python loop takes minutes on a few MB
        spec = {"kind": "bytes", "offset": getattr(tok, "offset", 3)}
    else:
        spec = _fast_spec(tok) or {"kind": "python", "pickle": pickle.dumps(tok).hex()}
    path.write_text(json.dumps(spec))
    return spec["kind"]


def _fast_spec(tok) -> dict | None:
    """The raw `tokenizers` definition, where it gives transformers' ids on the probe text."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = {"kind": "fast", "json": backend.to_str()}
    raw = _encoder(spec, np.dtype(np.int64)).encode([PROBE])[0].tolist()
    return spec if raw == _hf_ids(tok) else None


def read_spec(path: Path, dtype: np.dtype):
    return _encoder(json.loads(path.read_text()), dtype)


def _hf_ids(tok) -> list[int]:
    return list(tok(PROBE, add_special_tokens=False, verbose=False)["input_ids"])


def _encoder(spec: dict, dtype: np.dtype):
    match spec["kind"]:
        case "bytes":
            return ByteEncoder(spec["offset"], dtype)
        case "fast":
            return FastEncoder(spec["json"], dtype)
        case "python":
            return PythonEncoder(pickle.loads(bytes.fromhex(spec["pickle"])), dtype)
        case _:
            raise ValueError(f"unknown encoder kind {spec['kind']}")


class ByteEncoder:
    """UTF-8 bytes shifted past the special ids (ByT5), exactly as its tokenizer does."""

    def __init__(self, offset: int, dtype: np.dtype) -> None:
        self.offset, self.dtype = offset, dtype

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        return [
            np.frombuffer(t.encode("utf-8"), np.uint8).astype(self.dtype) + self.offset
            for t in texts
        ]


class FastEncoder:
    """A `tokenizers` tokenizer, raw: ``encode_batch_fast`` (no offsets), no special tokens."""

    def __init__(self, definition: str, dtype: np.dtype) -> None:
        from tokenizers import Tokenizer

        self.tokenizer, self.dtype = Tokenizer.from_str(definition), dtype

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self.dtype) for e in encodings]


class PythonEncoder:
    """Any other tokenizer, called as transformers calls it (whole documents, no specials)."""

    def __init__(self, tok, dtype: np.dtype) -> None:
        self.tok, self.dtype = tok, dtype

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        ids = self.tok(texts, add_special_tokens=False, verbose=False)["input_ids"]
        return [np.asarray(i, dtype=self.dtype) for i in ids]
