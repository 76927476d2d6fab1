"""data=chat conversations in rows of ``trainer.seq_len`` tokens, and their batches.

The cache holds each split's conversations back to back (``{split}.bin``), which of their tokens
are learned (``{split}.mask.bin``, one byte a token), each conversation's length
(``{split}.docs.bin``) and its learned tokens (``{split}.learned.bin``); it serves every
``trainer.seq_len`` and packing. At load the conversations are laid out in rows, in corpus
order:

- ``data.packing=documents``: as many whole conversations as fit in a row. The row carries
  ``position_ids`` restarting at 0 at each conversation and ``sequence_index`` (which
  conversation a token belongs to, computed here on the host): the model attends only within a
  conversation (transformers derives the packed mask from them; ``train.loss`` hands it the
  host's answer so the step needs no device read).
- ``data.packing=pad``: one conversation a row, padded at the end (causal attention never looks
  at the padding after it, so no positions are needed).

A conversation longer than ``seq_len`` is cut to its first ``seq_len`` tokens or left out, as
``data.overlong`` says; both are counted. Labels are the learned tokens; the first token of a
conversation is never a label (nothing in it comes before), so no conversation predicts the
next one's opening.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fsdp_lab.config import Overlong, Packing


@dataclass
class ChatSplit:
    """One split's conversations, laid out in rows: ``len()`` is the number of rows."""

    tokens: np.ndarray  # every conversation's ids back to back (memory-mapped)
    learned: np.ndarray  # uint8, 1 where the token is learned (memory-mapped)
    offsets: np.ndarray  # int64 [n + 1]: conversation i is tokens[offsets[i]:offsets[i + 1]]
    counts: np.ndarray  # [n]: conversation i's learned tokens after its first (whole)
    seq_len: int
    packing: Packing
    overlong: Overlong
    kept: np.ndarray = field(init=False)  # the conversations in rows, in corpus order
    lengths: np.ndarray = field(init=False)  # their lengths in the rows (truncated)
    rows: np.ndarray = field(init=False)  # [r + 1]: row j holds kept[rows[j]:rows[j + 1]]
    row_targets: np.ndarray = field(init=False)  # [r]: the labels of each row
    truncated: int = field(init=False)
    dropped: int = field(init=False)

    def __post_init__(self) -> None:
        full = np.diff(self.offsets)
        over = full > self.seq_len
        self.truncated = int(over.sum()) if self.overlong is Overlong.truncate else 0
        self.dropped = int(over.sum()) if self.overlong is Overlong.drop else 0
        self.kept = (
            np.flatnonzero(~over) if self.overlong is Overlong.drop else np.arange(len(full))
        )
        self.lengths = np.minimum(full[self.kept], self.seq_len)
        self.rows = _row_starts(self.lengths, self.seq_len, self.packing)
        self.row_targets = self._row_targets()

    def __len__(self) -> int:
        return len(self.rows) - 1

    @property
    def conversations(self) -> int:
        return len(self.offsets) - 1

    def learned_tokens(self) -> int:
        """Tokens learned in the rows (after truncation; first tokens are never labels)."""
        return int(self.row_targets.sum())

    def _row_targets(self) -> np.ndarray:
        """Each row's labels, from the conversations' counts (prepared with them): only a
        truncated conversation's kept part is counted on its mask."""
        per = self.counts[self.kept].astype(np.int64)
        for k in np.flatnonzero(self.lengths < np.diff(self.offsets)[self.kept]).tolist():
            per[k] = int(self.conversation(k)[1].sum())
        if not len(per):
            return np.zeros(0, dtype=np.int64)
        return np.add.reduceat(per, self.rows[:-1])

    def conversation(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k``-th conversation in the rows as it is trained: its ids (truncated) and which
        are labels (its first token never is: nothing in it comes before)."""
        start, n = self.offsets[self.kept[k]], int(self.lengths[k])
        learned = self.learned[start : start + n].astype(bool)
        learned[0] = False
        return self.tokens[start : start + n], learned

    def row(self, index: int, pad_id: int) -> dict[str, np.ndarray]:
        """Row ``index``: input ids, which are learned, and (packing=documents) positions and
        sequence index. A row past the split (``index < 0`` or ``>= len``) is padding, learning
        nothing."""
        t = self.seq_len
        ids = np.full(t, pad_id, dtype=np.int64)
        labels = np.zeros(t, dtype=bool)
        positions, sequence = np.arange(t, dtype=np.int64), np.zeros(t, dtype=np.int64)
        if not 0 <= index < len(self):
            return _fields(ids, labels, positions, sequence, self.packing)
        at = 0
        for j, k in enumerate(range(self.rows[index], self.rows[index + 1])):
            conversation, learned = self.conversation(k)
            n = len(conversation)
            ids[at : at + n] = conversation
            labels[at : at + n] = learned
            positions[at : at + n] = np.arange(n)
            sequence[at : at + n] = j
            at += n
        if 0 < at < t:  # the padding continues the last conversation (after it: never seen)
            positions[at:] = positions[at - 1] + 1 + np.arange(t - at)
            sequence[at:] = sequence[at - 1]
        return _fields(ids, labels, positions, sequence, self.packing)


def _fields(ids, labels, positions, sequence, packing: Packing) -> dict[str, np.ndarray]:
    out = {"input_ids": ids, "learned": labels}
    if packing is Packing.documents:
        out |= {"position_ids": positions, "sequence_index": sequence}
    return out


def _row_starts(lengths: np.ndarray, seq_len: int, packing: Packing) -> np.ndarray:
    """Where each row starts among the conversations: one a row (pad), or greedily as many as
    fit, in order (documents). Ends with len(lengths)."""
    if packing is Packing.pad:
        return np.arange(len(lengths) + 1, dtype=np.int64)
    starts, used = [], seq_len + 1
    for i, n in enumerate(lengths.tolist()):
        if used + n > seq_len:
            starts.append(i)
            used = 0
        used += n
    starts.append(len(lengths))
    return np.asarray(starts, dtype=np.int64)


def hold_out(offsets: np.ndarray, counts: np.ndarray, fraction: float) -> tuple[tuple, tuple]:
    """(offsets, counts) of the training and validation conversations when every conversation
    fell in one split (a handful of them): the last ``fraction`` of them are held out."""
    n = len(offsets) - 1
    n_val = min(n - 1, math.ceil(n * fraction)) if fraction > 0 and n > 1 else 0
    cut = n - n_val
    return (offsets[: cut + 1], counts[:cut]), (offsets[cut:], counts[cut:])
