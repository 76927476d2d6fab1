"""Training batches for each rank: a pure function of (seed, step, micro-step, rank).

Being a function of the step makes every loader resumable by construction: a run resumed at
step k reads exactly the batches the uninterrupted run read after step k (packed text: the rows
that follow the rows consumed, also when the world size changed). It also makes each
rank's share of the global batch explicit: rank r takes rows [r*B, (r+1)*B) of each global
micro-batch, so an unsharded reference run on the whole global batch sees the same tokens, and
the masking of a masked-LM batch is the same whatever the world size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from fsdp_lab.config import Config
from fsdp_lab.config.data_kinds import Rows, kind_row
from fsdp_lab.config.model import task_row
from fsdp_lab.data.context import ContextShare
from fsdp_lab.data.labels import IGNORE_INDEX
from fsdp_lab.data.packing import ChatSplit

log = logging.getLogger(__name__)


def _generator(*key: int) -> torch.Generator:
    state = np.random.SeedSequence(list(key)).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & (2**63 - 1))


@dataclass
class Masking:
    """BERT's masked-LM corruption: of the tokens chosen with ``probability``, 80% become the
    mask token, 10% a random token, 10% stay; labels are IGNORE_INDEX everywhere else."""

    mask_id: int
    vocab_size: int
    probability: float
    special_ids: tuple[int, ...] = ()

    def __call__(
        self, ids: torch.Tensor, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        draw = torch.rand(ids.shape, generator=gen)
        kind = torch.rand(ids.shape, generator=gen)
        random_ids = torch.randint(0, self.vocab_size, ids.shape, generator=gen)
        eligible = torch.ones_like(ids, dtype=torch.bool)
        for special in self.special_ids:
            eligible &= ids != special
        chosen = (draw < self.probability) & eligible
        # Every row predicts something (no empty loss): its first eligible position if none.
        empty = ~chosen.any(dim=1) & eligible.any(dim=1)
        first = eligible.int().argmax(dim=1)
        chosen[empty, first[empty]] = True
        labels = torch.where(chosen, ids, IGNORE_INDEX)
        inputs = torch.where(chosen & (kind < 0.8), self.mask_id, ids)
        inputs = torch.where(chosen & (kind >= 0.8) & (kind < 0.9), random_ids, inputs)
        return inputs, labels


class Loader:
    """Rows of global micro-batches -> this rank's batches; subclasses say what row i holds."""

    def __init__(
        self,
        *,
        seed: int,
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_size: int,
        dp_rank: int,
        masking: Masking | None,
        local_ranks: int = 1,
        context: ContextShare | None = None,
    ) -> None:
        self.seed, self.micro_batch_size = seed, micro_batch_size
        # parallel.context > 1: the ranks of a CP group read the same rows, each its chunks
        self.context_share = context
        self.grad_accum_steps = grad_accum_steps
        self.dp_size, self.dp_rank, self.masking = dp_size, dp_rank, masking
        # A process that feeds several ranks (tpu: one per XLA device) takes their rows together
        self.local_ranks = local_ranks
        self.row_offset = self.start_step = 0  # moved by restore()
        self.rows_per_micro = dp_size * micro_batch_size
        self.causal = masking is None  # targets are the next tokens (masked LM: the masked)

    def first_row(self, step: int, micro: int) -> int:
        """Global index of the first row of micro-batch ``micro`` of step ``step``."""
        return (
            self.row_offset
            + ((step - self.start_step) * self.grad_accum_steps + micro) * self.rows_per_micro
        )

    def global_rows(self, step: int, micro: int) -> torch.Tensor:
        raise NotImplementedError

    def val_rows(self, index: int) -> torch.Tensor:
        """Validation micro-batch ``index`` (all ranks' rows); rows past the split are -1."""
        raise NotImplementedError

    def num_val_batches(self, limit: int) -> int:
        raise NotImplementedError

    def _global_batch(
        self, rows: torch.Tensor, gen_key: tuple[int, ...], first: int
    ) -> dict[str, torch.Tensor]:
        """All ranks' rows of one micro-batch as model inputs (``labels`` IGNORE_INDEX where
        nothing is learned: a row past the split, an unmasked masked-LM position). A masked
        LM masks row i with a generator keyed by ``gen_key`` and the row's index ``first + i``
        in its step, so how a global batch is dealt into micro-batches and ranks never
        changes the masking."""
        valid = (rows >= 0).all(dim=1, keepdim=True)
        ids = rows.clamp(min=0).long()
        if self.masking is not None:
            masked = [
                self.masking(row[None], _generator(*gen_key, first + i))
                for i, row in enumerate(ids)
            ]
            inputs = torch.cat([m[0] for m in masked])
            labels = torch.cat([m[1] for m in masked])
        else:
            inputs, labels = ids, ids  # the model shifts labels for next-token prediction
        labels = torch.where(valid, labels, IGNORE_INDEX)
        return {"input_ids": inputs, "labels": labels}

    def _to_batch(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], int]:
        """This rank's rows of a global micro-batch, and the global micro-batch's targets: the
        tokens the loss learns, counted on the host (a causal LM's labels shifted by one)."""
        labels = batch["labels"]
        if self.causal:
            labels = labels[:, 1:]
        targets = int((labels != IGNORE_INDEX).sum())
        return self._split({k: self._mine(v) for k, v in batch.items()}), targets

    def _mine(self, rows):
        """This process's rows of a global micro-batch's (rows, or their indices)."""
        lo = self.dp_rank * self.micro_batch_size
        return rows[lo : lo + self.micro_batch_size * self.local_ranks]

    @property
    def context(self) -> int:
        """The ranks that read the same rows, each its chunks of them (its CP group's)."""
        return 1 if self.context_share is None else self.context_share.size

    def _split(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's chunks of its rows under context parallelism (``data.context``); the
        rows themselves otherwise."""
        if self.context_share is None:
            return batch
        return self.context_share.split(batch, causal=self.causal)

    def global_batch_of(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        """All ranks' rows of training micro-batch ``micro`` of step ``step``."""
        first = micro * self.rows_per_micro
        return self._global_batch(self.global_rows(step, micro), (self.seed, 0, step), first)

    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        return self._to_batch(self.global_batch_of(step, micro))[0]

    def step_batches(self, step: int) -> tuple[list[dict[str, torch.Tensor]], int]:
        """This rank's micro-batches of step ``step``, and the targets of the whole global batch
        (every rank, every micro-batch): the one count the step's loss is divided by. Known on
        the host from the data alone, so the step needs no collective and no device read for
        it."""
        batches, targets = [], 0
        for micro in range(self.grad_accum_steps):
            batch, count = self._to_batch(self.global_batch_of(step, micro))
            batches.append(batch)
            targets += count
        return batches, targets

    def val_batch(self, index: int) -> dict[str, torch.Tensor]:
        rows, first = self.val_rows(index), index * self.rows_per_micro
        return self._to_batch(self._global_batch(rows, (self.seed, 1), first))[0]

    def state(self, step: int) -> dict:
        """Where the loader is after ``step`` optimizer steps (kept in checkpoints)."""
        return {"kind": type(self).__name__, "rows_consumed": self.first_row(step, 0)}

    def restore(self, state: dict | None, step: int) -> None:
        """Continue after a checkpoint of step ``step`` whose loader state was ``state``."""


class SyntheticData(Loader):
    """Random arithmetic progressions mod the vocabulary: token t of a row is (a + b*t) % V.

    Pure noise cannot be learned; these can (infer b in context), so the loss visibly falls and a
    broken step (say, a wrong gradient reduction) shows up as a curve that does not. A masked-LM
    run keeps the last id for the mask token. Validation rows come from a stream of their own.
    """

    max_stride = 16

    def __init__(self, *, vocab_size: int, seq_len: int, **kw) -> None:
        super().__init__(**kw)
        self.vocab_size, self.seq_len = vocab_size, seq_len
        self.modulus = vocab_size - 1 if self.masking is not None else vocab_size

    def _rows(self, gen: torch.Generator, total: int, lo: int) -> torch.Tensor:
        """Rows [lo, lo + dp_size * micro_batch_size) of ``total`` drawn from ``gen``."""
        start = torch.randint(0, self.modulus, (total, 1), generator=gen)
        stride = torch.randint(1, self.max_stride + 1, (total, 1), generator=gen)
        hi = lo + self.rows_per_micro
        return (start[lo:hi] + stride[lo:hi] * torch.arange(self.seq_len)) % self.modulus

    def global_rows(self, step: int, micro: int) -> torch.Tensor:
        """All ranks' rows of one micro-batch: [dp_size * micro_batch_size, seq_len] token ids.
        The step's whole global batch is drawn at once (two ids a row) and dealt into its
        micro-batches, so accumulating 4 micro-batches of 1 row trains on the rows 1 micro-batch
        of 4 does. Keyed by the step itself, so a resumed run continues the same stream."""
        total = self.grad_accum_steps * self.rows_per_micro
        return self._rows(_generator(self.seed, step), total, micro * self.rows_per_micro)

    def val_rows(self, index: int) -> torch.Tensor:
        return self._rows(_generator(self.seed, 2**32 + index), self.rows_per_micro, 0)

    def num_val_batches(self, limit: int) -> int:
        return limit


class PackedData(Loader):
    """Packed text blocks, reshuffled every epoch (a permutation seeded by (seed, epoch)).

    Global row g of training is block perm_e[g mod n] of epoch e = g // n: the order depends only
    on the seed and the number of blocks, never on the world size, and a resumed run continues
    at row step * grad_accum * dp * B of the same order.
    """

    def __init__(self, *, train: np.ndarray, val: np.ndarray, fingerprint: str, **kw) -> None:
        super().__init__(**kw)
        self.train, self.val, self.fingerprint = train, val, fingerprint
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {k: v for k, v in self._perms.items() if k >= epoch - 1}
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, 7, epoch]))
            self._perms[epoch] = rng.permutation(len(self.train))
        return self._perms[epoch]

    def row_indices(self, step: int, micro: int) -> np.ndarray:
        """The training rows (indices into ``train``) of one global micro-batch."""
        first, n = self.first_row(step, micro), len(self.train)
        return np.asarray(
            [self._perm(g // n)[g % n] for g in range(first, first + self.rows_per_micro)]
        )

    def global_rows(self, step: int, micro: int) -> torch.Tensor:
        # Fancy indexing copies; the cache's uint16/uint32 become int64 ids.
        return torch.from_numpy(self.train[self.row_indices(step, micro)].astype(np.int64))

    def val_rows(self, index: int) -> torch.Tensor:
        per_micro = self.rows_per_micro
        lo = index * per_micro
        rows = torch.full((per_micro, self.val.shape[1]), -1, dtype=torch.int64)
        chunk = np.array(self.val[lo : lo + per_micro], dtype=np.int64)
        rows[: len(chunk)] = torch.from_numpy(chunk)
        return rows

    def num_val_batches(self, limit: int) -> int:
        return min(limit, -(-len(self.val) // self.rows_per_micro))

    def state(self, step: int) -> dict:
        rows = self.first_row(step, 0)
        return {
            "kind": type(self).__name__,
            "rows_consumed": rows,
            "epoch": rows // len(self.train),
            "position": rows % len(self.train),
            "train_blocks": len(self.train),
            "fingerprint": self.fingerprint,
        }

    def restore(self, state: dict | None, step: int) -> None:
        """Continue at the saved row (also when the world size or batch size changed since)."""
        if state is None or state.get("fingerprint") != self.fingerprint:
            log.warning(
                "data: the checkpoint was trained on other data (or an older format); "
                "this data is read from its beginning"
            )
            state = {"rows_consumed": 0}
        self.row_offset, self.start_step = state["rows_consumed"], step


class ChatData(PackedData):
    """data=chat rows (``packing.ChatSplit``), reshuffled every epoch and resumed exactly as
    packed text rows are."""

    def __init__(self, *, train: ChatSplit, val: ChatSplit, fingerprint: str, pad_id: int, **kw):
        super().__init__(train=train, val=val, fingerprint=fingerprint, **kw)
        self.pad_id = pad_id

    def _rows(self, split: ChatSplit, indices) -> dict[str, torch.Tensor]:
        rows = [split.row(int(i), self.pad_id) for i in indices]
        batch = {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}
        learned = batch.pop("learned")
        batch["labels"] = torch.where(learned, batch["input_ids"], IGNORE_INDEX)
        return batch

    # Only this rank's rows are built (``_mine``): the others' targets are counted from the
    # split's per-row counts, not from their rows.
    def batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        return self._split(self._rows(self.train, self._mine(self.row_indices(step, micro))))

    def step_batches(self, step: int) -> tuple[list[dict[str, torch.Tensor]], int]:
        batches, targets = [], 0
        for micro in range(self.grad_accum_steps):
            indices = self.row_indices(step, micro)
            batches.append(self._split(self._rows(self.train, self._mine(indices))))
            targets += int(self.train.row_targets[indices].sum())
        return batches, targets

    def val_batch(self, index: int) -> dict[str, torch.Tensor]:
        lo = index * self.rows_per_micro
        return self._split(self._rows(self.val, self._mine(range(lo, lo + self.rows_per_micro))))


def _masking(cfg: Config, tokenizer, vocab_size: int) -> Masking | None:
    """A masked LM's corruption (None for a causal LM)."""
    masking = None
    if task_row(cfg.model.task).masks_tokens:
        if kind_row(cfg.data.kind).rows is Rows.generated:  # ids: the last id is [MASK]
            masking = Masking(
                mask_id=vocab_size - 1,
                vocab_size=vocab_size - 1,
                probability=cfg.data.mlm_probability,
            )
        else:
            special = tuple(
                i
                for i in (
                    tokenizer.eos_token_id,
                    tokenizer.sep_token_id,
                    tokenizer.cls_token_id,
                    tokenizer.pad_token_id,
                )
                if i is not None
            )
            masking = Masking(
                mask_id=tokenizer.mask_token_id,
                vocab_size=len(tokenizer),
                probability=cfg.data.mlm_probability,
                special_ids=special,
            )
    return masking


def build_data(
    cfg: Config,
    *,
    corpus,
    tokenizer,
    vocab_size: int,
    dp_size: int,
    dp_rank: int,
    local_ranks: int = 1,
    context: ContextShare | None = None,
) -> Loader:
    """The loader of data-parallel rank ``dp_rank`` of ``dp_size``; with a ``context`` share
    (parallel.context > 1) it keeps that rank's chunks of its rows, else whole rows (an
    unsharded reference reads those)."""
    t = cfg.trainer
    masking = _masking(cfg, tokenizer, vocab_size)
    common = dict(
        seed=cfg.seed,
        micro_batch_size=t.micro_batch_size,
        grad_accum_steps=t.grad_accum_steps,
        dp_size=dp_size,
        dp_rank=dp_rank,
        masking=masking,
        local_ranks=local_ranks,
        context=context,
    )
    match kind_row(cfg.data.kind).rows:
        case Rows.generated:
            return SyntheticData(vocab_size=vocab_size, seq_len=t.seq_len, **common)
        case Rows.blocks:
            return PackedData(
                train=corpus.train, val=corpus.val, fingerprint=corpus.fingerprint, **common
            )
        case Rows.conversations:
            pad = tokenizer.pad_token_id
            return ChatData(
                train=corpus.train,
                val=corpus.val,
                fingerprint=corpus.fingerprint,
                pad_id=pad if pad is not None else tokenizer.eos_token_id,
                **common,
            )
        case _:
            raise ValueError(f"data.kind {cfg.data.kind}: no loader builds its rows")
