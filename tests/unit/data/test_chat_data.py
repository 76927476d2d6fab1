"""data=chat from files to batches: preparation through the corpus cache (parallel, the split by
conversation), rows packed with boundaries, overlong conversations, exact resume, bad input in
one line, and ``fsdp-lab data preview``. SmolLM2's real tokenizer and chat template."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from fsdp_lab.config import ConfigError, Overlong, Packing, to_typed
from fsdp_lab.data import corpus as corpus_lib
from fsdp_lab.data.chat import ChatFormat, pieces
from fsdp_lab.data.loader import IGNORE_INDEX, build_data
from fsdp_lab.data.packing import ChatSplit, hold_out
from fsdp_lab.tools.data import CLOSE, OPEN, preview_command


def conversation(i: int, turns: int, system: bool = False) -> dict:
    messages = [{"role": "system", "content": "You speak as Shakespeare."}] if system else []
    for t in range(turns):
        messages.append({"role": "user", "content": f"Speak line {i}.{t} of the play."})
        reply = " ".join(["Shall I compare thee"] * (1 + (i * 7 + t) % 9))
        messages.append({"role": "assistant", "content": f"{reply}, reply {i}.{t}."})
    return {"messages": messages}


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config(tmp_path: Path, files: list[Path], smollm2: str, **data):
    data = {
        "kind": "chat",
        "files": [str(f) for f in files],
        "cache_dir": str(tmp_path / "cache"),
        "tokenizer": smollm2,
        **data,
    }
    trainer = {"seq_len": data.pop("seq_len", 96), "micro_batch_size": 2, "grad_accum_steps": 2}
    return to_typed({"data": data, "trainer": trainer, "model": {"arch": "llama"}})


def prepare(cfg):
    tok = corpus_lib.load_tokenizer(cfg)
    return tok, corpus_lib.prepare(cfg, tok, vocab_size=len(tok))


# -- rows -------------------------------------------------------------------------------------


def split_of(lengths: list[int], learned: list[list[int]] | None = None, **kw) -> ChatSplit:
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.arange(100, 100 + offsets[-1], dtype=np.uint16)
    mask = (
        np.concatenate([np.asarray(m, np.uint8) for m in learned])
        if learned
        else np.ones(offsets[-1], np.uint8)
    )
    args = {"seq_len": 8, "packing": Packing.documents, "overlong": Overlong.truncate} | kw
    return ChatSplit(tokens, mask, offsets, counts_of(mask, offsets), **args)


def counts_of(mask: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Each conversation's learned tokens after its first, as preparation stores them."""
    return np.array([mask[a + 1 : b].sum() for a, b in itertools.pairwise(offsets)])


def test_documents_pack_whole_conversations_in_order_and_restart_positions():
    split = split_of([3, 4, 2, 8, 1], learned=[[0, 1, 1], [0, 0, 1, 1], [1, 1], [1] * 8, [1]])
    assert split.rows.tolist() == [0, 2, 3, 4, 5]  # [3+4], [2], [8], [1]
    row = split.row(0, pad_id=0)
    assert row["input_ids"].tolist() == [100, 101, 102, 103, 104, 105, 106, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 4]  # padding continues
    assert row["sequence_index"].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    # learned as marked, except each conversation's first token (nothing before it)
    assert row["learned"].tolist() == [0, 1, 1, 0, 0, 1, 1, 0]
    assert split.learned_tokens() == 2 + 2 + 1 + 7 + 0
    assert not split.row(9, pad_id=0)["learned"].any()  # past the split: learns nothing


def test_overlong_conversations_are_truncated_or_dropped_and_counted():
    cut = split_of([3, 12, 2])
    assert (cut.truncated, cut.dropped, len(cut)) == (1, 0, 3)
    assert cut.row(1, pad_id=0)["input_ids"].tolist() == list(range(103, 111))
    assert cut.learned_tokens() == 2 + 7 + 1
    dropped = split_of([3, 12, 2], overlong=Overlong.drop)
    assert (dropped.truncated, dropped.dropped, len(dropped)) == (0, 1, 1)  # [3+2] in one row
    assert dropped.learned_tokens() == 2 + 1


def test_held_out_conversations_count_only_their_own_tokens():
    offsets = np.array([0, 3, 7, 9], dtype=np.int64)
    mask = np.ones(9, np.uint8)
    # every conversation in one split: the last held out
    train, val = hold_out(offsets, counts_of(mask, offsets), 0.3)
    args = {"seq_len": 8, "packing": Packing.documents, "overlong": Overlong.truncate}
    tokens = np.arange(9, dtype=np.uint16)
    assert ChatSplit(tokens, mask, *train, **args).learned_tokens() == 2 + 3
    assert ChatSplit(tokens, mask, *val, **args).learned_tokens() == 1


def test_pad_puts_one_conversation_a_row_without_positions():
    split = split_of([3, 4], packing=Packing.pad)
    assert len(split) == 2
    row = split.row(1, pad_id=7)
    assert row["input_ids"].tolist() == [103, 104, 105, 106, 7, 7, 7, 7]
    assert "position_ids" not in row


# -- through the cache ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chats(tmp_path_factory) -> Path:
    """About 2.5 MB of conversations: several preparation tasks."""
    rows = [conversation(i, 1 + i % 3, system=i % 4 == 0) for i in range(9000)]
    return write_rows(tmp_path_factory.mktemp("chats") / "chats.jsonl", rows)


def test_preparation_is_the_same_on_one_or_two_processes(tmp_path, chats, smollm2):
    one = prepare(config(tmp_path / "a", [chats], smollm2, num_proc=1))[1]
    tok, two = prepare(config(tmp_path / "b", [chats], smollm2, num_proc=2))
    meta = json.loads((two.path / "meta.json").read_text())
    assert meta["shards"] > 1 and one.fingerprint == two.fingerprint
    assert two.num_documents == 9000 and 0 < two.val.conversations < 900  # by conversation
    # every conversation's learned tokens are its replies, each ending with <|im_end|>
    split, im_end = two.train, tok.convert_tokens_to_ids("<|im_end|>")
    for k in range(20):
        start, n = int(split.offsets[k]), int(split.offsets[k + 1] - split.offsets[k])
        ids, learned = split.tokens[start : start + n], split.learned[start : start + n]
        text = tok.decode(ids[learned.astype(bool)])
        assert text.count("<|im_end|>") == text.count("reply") >= 1
        assert "Speak line" not in text and ids[learned.astype(bool)][-1] == im_end


def test_a_resumed_loader_gives_the_same_batches(tmp_path, chats, smollm2):
    cfg = config(tmp_path, [chats], smollm2)
    tok, c = prepare(cfg)

    def loader(rank: int):
        kw = dict(corpus=c, tokenizer=tok, vocab_size=len(tok), dp_size=2, dp_rank=rank)
        return build_data(cfg, **kw)

    first, resumed = loader(1), loader(1)
    resumed.restore(first.state(3), 3)
    for step in (3, 4):
        (a, n_a), (b, n_b) = first.step_batches(step), resumed.step_batches(step)
        assert n_a == n_b
        assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b, strict=True) for k in x)
    batch = a[0]
    assert set(batch) == {"input_ids", "labels", "position_ids", "sequence_index"}
    # the global count covers both ranks and both micro-batches
    other = loader(0).step_batches(4)[0]
    counted = sum(int((m["labels"][:, 1:] != IGNORE_INDEX).sum()) for m in [*a, *other])
    assert n_a == counted


def test_prompt_completion_learns_the_completion_and_eos(tmp_path, smollm2):
    rows = [{"prompt": f"Q{i}: the answer is", "completion": f" {i * 3}."} for i in range(8)]
    path = write_rows(tmp_path / "pc.jsonl", rows)
    tok, c = prepare(config(tmp_path, [path], smollm2, validation_fraction=0.0))
    start, n = int(c.train.offsets[2]), int(c.train.lengths[2])
    ids, learned = c.train.tokens[start : start + n], c.train.learned[start : start + n]
    assert tok.decode(ids[learned.astype(bool)]) == " 6." + tok.eos_token
    # a completion that ends with the EOS text gets no second one
    again = write_rows(
        tmp_path / "eos.jsonl", [{"prompt": "Q:", "completion": " 1." + tok.eos_token}]
    )
    tok, c = prepare(config(tmp_path / "eos", [again], smollm2, validation_fraction=0.0))
    assert c.train.tokens[-2:].tolist() == [*tok.encode(" 1.")[-1:], tok.eos_token_id]


def test_string_rows_open_with_the_bos_the_tokenizer_adds_and_skip_blank_completions():
    fmt = ChatFormat(layout="prompt_completion", template=None, bos="<s>")
    got, eos = pieces({"prompt": "Q:", "completion": " A."}, fmt, lambda: "f line 1")
    assert got == [("<s>", False), ("Q:", False), (" A.", True)] and eos
    assert pieces({"prompt": "Q:", "completion": "  "}, fmt, lambda: "f line 2") is None


@pytest.mark.parametrize(
    ("rows", "data", "message"),
    [
        ([{"text": "hi"}], {}, r"bad.jsonl has columns \['text'\], neither"),
        (
            [conversation(0, 1), {"messages": [{"role": "wizard", "content": "x"}]}],
            {},
            "line 2: unknown role 'wizard'",
        ),
        ([conversation(i, 3) for i in range(4)], {"overlong": "drop", "seq_len": 16}, "all 4"),
        ([{"messages": [{"role": "user", "content": "alone"}]}], {}, "no row of data.files"),
        (  # a string row first, then one of messages, and no chat template to render it
            [
                {"prompt": "Q", "completion": " A"},
                {
                    "prompt": [{"role": "user", "content": "Q"}],
                    "completion": [{"role": "assistant", "content": "A"}],
                },
            ],
            {"tokenizer": None},
            "line 2 holds messages, and the tokenizer has no chat template",
        ),
    ],
)
def test_bad_input_is_one_line_naming_the_file_and_row(tmp_path, smollm2, rows, data, message):
    path = write_rows(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError, match=message) as e:
        prepare(config(tmp_path, [path], smollm2, validation_fraction=0.0, **data))
    assert "\n" not in str(e.value)


def test_preview_shows_the_learned_spans_and_the_counts(tmp_path, smollm2):
    path = write_rows(tmp_path / "two.jsonl", [conversation(0, 2, system=True), conversation(1, 1)])
    out = io.StringIO()
    overrides = [
        "data=chat",
        f"data.files={path}",
        f"data.tokenizer={smollm2}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.validation_fraction=0",
        "trainer.seq_len=256",
    ]
    assert preview_command(overrides, rows=3, out=out) == 0
    text = out.getvalue()
    assert text.startswith("=== row 0 of 1: 2 conversation(s) ===\n--- conversation 0:")
    assert f"{OPEN}Shall I compare thee, reply 0.0.<|im_end|>{CLOSE}" in text
    assert text.count(OPEN) == 3  # the three replies, and nothing else
    assert "<|im_start|>system\nYou speak as Shakespeare.<|im_end|>" in text
    assert "conversations: {'train': 2, 'val': 0}" in text and "truncated: 0" in text
