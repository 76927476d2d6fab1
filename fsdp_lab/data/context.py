"""A context-parallel rank's share of a batch: the ranks of a CP group read the same rows, and
each keeps 2 of the 2N equal chunks of every row (``config.topology.context_chunks``: chunks
r and 2N-1-r, so the causal work is balanced).

What the split keeps exact:

- **Labels are shifted before the split.** Position t predicts token t+1; cut first, the last
  position of a chunk would lose its target (the next chunk's first token lives on another
  rank). So ``labels`` of a split batch are already the targets (the loss does not shift
  again), and the last position of a row (on rank 0: chunk 2N-1) predicts nothing.
- **Positions stay the row's own.** ``position_ids`` are the unsplit row's (0..T-1, or
  restarting at each packed document), cut like the tokens: the rotary embedding of a token is
  the one it has in the whole row.
- **Documents.** A packed row's ``sequence_index`` (which document each token belongs to) is
  kept whole, under ``CONTEXT_DOCUMENTS``: the attention masks the gathered keys by it, so a
  query sees only its own document across chunk boundaries.

"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_lab.config.topology import context_chunks
from fsdp_lab.data.labels import shifted_targets

CONTEXT_DOCUMENTS = "context_documents"  # a split batch's whole-row document index (packed)


@dataclass(frozen=True)
class ContextShare:
    """A rank's place in its CP group: the group's size (parallel.context) and its rank there
    (which chunks it keeps)."""

    size: int
    rank: int

    def split(self, batch: dict[str, torch.Tensor], *, causal: bool) -> dict[str, torch.Tensor]:
        """This rank's chunks of a batch of whole rows (``split_sequences``)."""
        return split_sequences(batch, context=self.size, rank=self.rank, causal=causal)


def keep_chunks(x: torch.Tensor, *, context: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s two chunks of each row of ``x`` ([rows, T, ...]), in order:
    [rows, T / context, ...]."""
    rows, length = x.shape[:2]
    chunk = length // (2 * context)
    if chunk * 2 * context != length:
        raise RuntimeError(f"a row of {length} tokens does not split into {2 * context} chunks")
    parts = x.reshape(rows, 2 * context, chunk, *x.shape[2:])
    return parts[:, list(context_chunks(context, rank))].reshape(rows, 2 * chunk, *x.shape[2:])


def split_sequences(
    batch: dict[str, torch.Tensor], *, context: int, rank: int, causal: bool
) -> dict[str, torch.Tensor]:
    """This rank's chunks of a batch of whole rows (``input_ids``, ``labels``, and for packed
    rows ``position_ids`` and ``sequence_index``): ids, targets (shifted first, for a causal
    LM) and positions cut, the document index kept whole."""
    unknown = set(batch) - {"input_ids", "labels", "position_ids", "sequence_index"}
    if unknown:  # a field the split would leave behind: it must say how to cut it
        raise RuntimeError(f"split_sequences: no rule to split the batch's {sorted(unknown)}")
    ids = batch["input_ids"]
    rows, length = ids.shape
    labels = shifted_targets(batch["labels"]) if causal else batch["labels"]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(length).expand(rows, length)
    out = {
        name: keep_chunks(value, context=context, rank=rank)
        for name, value in (("input_ids", ids), ("labels", labels), ("position_ids", positions))
    }
    documents = batch.get("sequence_index")
    if documents is not None:
        out[CONTEXT_DOCUMENTS] = documents
    return out
