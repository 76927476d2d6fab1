"""A CP group's batches: the same rows on every rank of the group, each rank its head-tail
chunks, labels shifted before the split, positions the row's own, packed documents whole; the
global batch's count of targets unchanged."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from fsdp_lab.config import Overlong, Packing
from fsdp_lab.data.context import CONTEXT_DOCUMENTS, ContextShare, keep_chunks, split_sequences
from fsdp_lab.data.labels import IGNORE_INDEX, shifted_targets
from fsdp_lab.data.loader import ChatData, SyntheticData
from fsdp_lab.data.packing import ChatSplit


def rows(batch: int = 3, length: int = 16) -> dict[str, torch.Tensor]:
    ids = torch.arange(batch * length).reshape(batch, length) + 1000
    labels = torch.where(ids % 5 == 0, IGNORE_INDEX, ids)
    positions = (torch.arange(length) % 6).expand(batch, length)  # documents of 6 tokens
    documents = (torch.arange(length) // 6).expand(batch, length)
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "sequence_index": documents,
    }


@pytest.mark.parametrize("size", [2, 4])
def test_the_group_holds_each_position_once_with_its_target_and_position(size):
    whole = rows()
    targets = shifted_targets(whole["labels"])
    seen = torch.zeros(16, dtype=torch.int64)
    for rank in range(size):
        part = split_sequences(whole, context=size, rank=rank, causal=True)
        where = keep_chunks(torch.arange(16).expand(3, 16), context=size, rank=rank)[0]
        seen[where] += 1
        assert part["input_ids"].shape == (3, 16 // size)
        assert torch.equal(part["input_ids"], whole["input_ids"][:, where])
        # shifted before the split: a chunk's last token predicts the next chunk's first
        assert torch.equal(part["labels"], targets[:, where])
        assert torch.equal(part["position_ids"], whole["position_ids"][:, where])
        assert torch.equal(part[CONTEXT_DOCUMENTS], whole["sequence_index"])  # whole rows
        assert "sequence_index" not in part
    assert seen.tolist() == [1] * 16
    # rank 0 keeps the first and the last chunk: the row's last position predicts nothing
    last = split_sequences(whole, context=size, rank=0, causal=True)["labels"][:, -1]
    assert (last == IGNORE_INDEX).all()


def test_unpacked_rows_get_their_positions_and_no_documents():
    whole = {k: v for k, v in rows().items() if k in ("input_ids", "labels")}
    part = split_sequences(whole, context=2, rank=1, causal=True)
    assert part["position_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert CONTEXT_DOCUMENTS not in part


def test_a_cp_group_reads_the_rows_of_its_data_parallel_rank():
    """dp 2 x cp 2: ranks (dp r, cp 0/1) hold the chunks of the rows a 2-rank run's rank r
    holds whole; the step's count of targets is the global batch's, as without CP."""

    def synthetic(dp_rank, context=None):
        kw = dict(seed=3, micro_batch_size=2, grad_accum_steps=2, dp_size=2, masking=None)
        return SyntheticData(vocab_size=64, seq_len=16, dp_rank=dp_rank, context=context, **kw)

    for dp_rank in range(2):
        plain = synthetic(dp_rank)
        split = [synthetic(dp_rank, ContextShare(2, r)) for r in range(2)]
        want, want_targets = plain.step_batches(5)
        for rank, data in enumerate(split):
            got, targets = data.step_batches(5)
            assert targets == want_targets
            for g, w in zip(got, want, strict=True):
                assert torch.equal(
                    g["input_ids"], keep_chunks(w["input_ids"], context=2, rank=rank)
                )
        assert split[0].context == 2 and plain.context == 1


def test_packed_chat_rows_split_with_their_documents():
    lengths = [5, 7, 3, 9, 4, 6, 2, 8]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.arange(100, 100 + offsets[-1], dtype=np.uint16)
    learned = np.ones(offsets[-1], np.uint8)
    counts = np.array([learned[a + 1 : b].sum() for a, b in itertools.pairwise(offsets)])
    split = ChatSplit(tokens, learned, offsets, counts, 16, Packing.documents, Overlong.truncate)

    def chat(context=None):
        kw = dict(seed=0, micro_batch_size=2, grad_accum_steps=1, dp_size=1, dp_rank=0)
        return ChatData(
            train=split, val=split, fingerprint="f", pad_id=0, masking=None, context=context, **kw
        )

    want, want_targets = chat().step_batches(0)
    got, targets = chat(ContextShare(2, 1)).step_batches(0)
    assert targets == want_targets
    w, g = want[0], got[0]
    assert torch.equal(g[CONTEXT_DOCUMENTS], w["sequence_index"])
    assert torch.equal(g["position_ids"], keep_chunks(w["position_ids"], context=2, rank=1))
    assert torch.equal(g["labels"], keep_chunks(shifted_targets(w["labels"]), context=2, rank=1))
