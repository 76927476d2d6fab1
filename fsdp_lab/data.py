"""Training batches for each rank: a pure function of (seed, step, micro-step, rank).

Being a function of the step makes the loader resumable by construction and makes every rank's
share of the global batch explicit: rank r takes rows [r*B, (r+1)*B) of each global micro-batch,
so an unsharded reference run on the whole global batch sees exactly the same tokens.
"""

from __future__ import annotations

import numpy as np
import torch

from fsdp_lab.config import DataConfig, DataKind


class SyntheticData:
    """Random arithmetic progressions mod the vocabulary: token t of a row is (a + b*t) % V.

    Pure noise cannot be learned; these can (infer b in context), so the loss visibly falls and a
    broken step (say, a wrong gradient reduction) shows up as a curve that does not.
    """

    max_stride = 16

    def __init__(self, *, seed: int, vocab_size: int, seq_len: int, micro_batch_size: int,
                 dp_size: int, dp_rank: int) -> None:
        self.seed, self.vocab_size, self.seq_len = seed, vocab_size, seq_len
        self.micro_batch_size, self.dp_size, self.dp_rank = micro_batch_size, dp_size, dp_rank

    def global_batch(self, step: int, micro: int) -> torch.Tensor:
        """All ranks' rows of one micro-batch: [dp_size * micro_batch_size, seq_len] token ids."""
        state = np.random.SeedSequence([self.seed, step, micro]).generate_state(1, np.uint64)[0]
        gen = torch.Generator().manual_seed(int(state) & (2**63 - 1))
        rows = self.dp_size * self.micro_batch_size
        start = torch.randint(0, self.vocab_size, (rows, 1), generator=gen)
        stride = torch.randint(1, self.max_stride + 1, (rows, 1), generator=gen)
        return (start + stride * torch.arange(self.seq_len)) % self.vocab_size

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        rows = self.global_batch(step, micro)
        lo = self.dp_rank * self.micro_batch_size
        ids = rows[lo:lo + self.micro_batch_size]
        return {"input_ids": ids, "labels": ids}


def build_data(cfg: DataConfig, *, seed: int, vocab_size: int, seq_len: int,
               micro_batch_size: int, dp_size: int, dp_rank: int) -> SyntheticData:
    match cfg.kind:
        case DataKind.synthetic:
            return SyntheticData(seed=seed, vocab_size=vocab_size, seq_len=seq_len,
                                 micro_batch_size=micro_batch_size, dp_size=dp_size,
                                 dp_rank=dp_rank)
        case _:
            raise ValueError(f"unknown data.kind {cfg.kind}")
