"""`fsdp-lab data prepare OVERRIDES...`: a run's corpus tokenised into the cache, without a run;
`fsdp-lab data preview OVERRIDES... [-n 3]`: what a data=chat run will learn, shown as text.

Prepare before the run that needs it: on a CPU node before a GPU job, or before a job of many
nodes, whose ranks would otherwise wait for rank 0 to prepare it (at most 2 hours, the solo-work
timeout). The checks are the launcher's own, so a corpus this command prepared is the one the
run finds: the same overrides give the same cache entry.
"""

from __future__ import annotations

import logging
import sys

from fsdp_lab.config import ConfigError, compose
from fsdp_lab.config.data_kinds import kind_row, kinds_where
from fsdp_lab.config.rules import validate
from fsdp_lab.launch.prepare import check_model_and_data
from fsdp_lab.planning.plan import topology


def prepare_command(overrides: list[str]) -> int:
    """Prepare the corpus ``overrides`` describe (its progress and last line on stderr)."""
    cfg = compose(overrides)
    if not kind_row(cfg.data.kind).prepared:
        others = ", ".join(kinds_where(lambda row: row.prepared))
        raise ConfigError(
            f"data={cfg.data.kind.value} is made as it is read: nothing to prepare; set data= "
            f"to one of {others}, with its files"
        )
    _log_to_stderr()
    topo, _ = topology(cfg)
    validate(cfg, topo)
    check_model_and_data(cfg, topo)
    return 0


OPEN, CLOSE = "⟦", "⟧"  # around learned text when the output is not a terminal (colour there)


def preview_command(overrides: list[str], *, rows: int, out=None) -> int:
    """Print the first ``rows`` training rows of a data=chat corpus as text, learned spans
    marked, then the counts a run records in run.json: the check before spending GPU hours."""
    from fsdp_lab.data import corpus as corpus_lib

    out = out or sys.stdout
    cfg = compose(overrides)
    if not kind_row(cfg.data.kind).replies_only:
        chat = kinds_where(lambda row: row.replies_only)[0]
        raise ConfigError(
            f"data preview shows what a data={chat} run learns; this is "
            f"data={cfg.data.kind.value} (every token learned); add data={chat} and its data.files"
        )
    _log_to_stderr()
    validate(cfg, topology(cfg)[0])  # what the run would refuse, refused here too
    cfg = corpus_lib.absolute_paths(cfg)
    tok = corpus_lib.load_tokenizer(cfg)
    corpus = corpus_lib.prepare(cfg, tok, vocab_size=len(tok))
    colour = out.isatty()
    split = corpus.train
    for r in range(min(rows, len(split))):
        first, end = int(split.rows[r]), int(split.rows[r + 1])
        print(f"=== row {r} of {len(split):,}: {end - first} conversation(s) ===", file=out)
        for k in range(first, end):
            ids, learned = split.conversation(k)
            n, conv = len(ids), split.kept[k]
            whole = int(split.offsets[conv + 1] - split.offsets[conv])
            cut = f", cut from {whole}" if whole > n else ""
            print(f"--- conversation {k}: {n} tokens{cut}, {int(learned.sum())} learned ---",
                  file=out)  # fmt: skip
            print(_marked(tok, ids.tolist(), learned, colour), file=out)
    for key, value in corpus.summary().items():
        print(f"{key}: {value}", file=out)
    return 0


def _marked(tok, ids: list[int], learned, colour: bool) -> str:
    """The text of ``ids``, each run of learned tokens in colour or between ⟦ ⟧."""
    text, at = [], 0
    while at < len(ids):
        end = at
        while end < len(ids) and learned[end] == learned[at]:
            end += 1
        piece = tok.decode(ids[at:end], skip_special_tokens=False)
        if learned[at]:
            piece = f"\033[32m{piece}\033[0m" if colour else f"{OPEN}{piece}{CLOSE}"
        text.append(piece)
        at = end
    return "".join(text)


class _Stderr(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at each record (a command called twice in one
    process, as tests do, must not write to the first call's stream)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def _log_to_stderr() -> None:
    """The progress and last line of a preparation on stderr, unless logging is set up."""
    logger = logging.getLogger("fsdp_lab")
    if not logger.handlers:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
