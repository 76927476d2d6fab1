"""The format table: a row per input format, no other place that dispatches on one, and a new
format that is one row and its reader, read end to end by the real preparing processes."""

from __future__ import annotations

import importlib
import json
import os
import re
import textwrap

import pytest
from conftest import assert_only_named_in

from fsdp_lab.config import ConfigError, DataKind, to_typed
from fsdp_lab.data import corpus as corpus_lib
from fsdp_lab.data import formats


def test_every_row_is_whole_and_every_suffix_names_one_format():
    suffixes = [s for row in formats.INPUT_FORMATS.values() for s in row.suffixes]
    assert len(suffixes) == len(set(suffixes))
    assert all(s.startswith(".") and s == s.lower() for s in suffixes)
    for name, row in formats.INPUT_FORMATS.items():
        assert row.name == name
        assert (row.texts is None) != (row.ids is None), f"{name} reads texts or ids"
        assert row.cut is not None or row.streamed, f"{name} has no cutter"
    assert {formats.HUB_FILES.name, formats.HUB_STREAM.name} <= set(formats.INPUT_FORMATS)
    with pytest.raises(ValueError, match="no input format 'docx'"):
        formats.input_format("docx")


@pytest.mark.parametrize(
    "kind,suffixes",
    [
        (DataKind.text, {".txt", ".text", ".md", ".json", ".jsonl", ".parquet", ".csv"}),
        (DataKind.shakespeare, {".txt", ".text", ".md", ".json", ".jsonl", ".parquet", ".csv"}),
        (DataKind.chat, {".json", ".jsonl", ".parquet"}),
        (DataKind.tokens, {".bin", ".npy"}),
    ],
)
def test_each_kind_reads_the_formats_its_column_says(kind, suffixes):
    assert {s for row in formats.read_by(kind) for s in row.suffixes} == suffixes


def test_which_formats_may_come_compressed_is_a_column(tmp_path):
    assert {r.name for r in formats.INPUT_FORMATS.values() if r.compressible} == {"json", "csv"}
    for name in ("a.jsonl.gz", "b.csv.zst", "c.txt.gz"):
        (tmp_path / name).write_bytes(b"")
    for name, fmt in [("a.jsonl.gz", "json"), ("b.csv.zst", "csv")]:
        assert formats.file_format([tmp_path / name], DataKind.text).name == fmt
    with pytest.raises(ConfigError, match=r"c\.txt\.gz is compressed text"):
        formats.file_format([tmp_path / "c.txt.gz"], DataKind.text)


def _dispatch_on_a_format() -> re.Pattern:
    """A format's name compared, matched or put in a segment, or one of its suffixes named: from
    the table itself, so a new row is guarded too."""
    names = "|".join(map(re.escape, formats.INPUT_FORMATS))
    suffixes = "|".join(re.escape(s) for r in formats.INPUT_FORMATS.values() for s in r.suffixes)
    return re.compile(
        rf"""(\bcase\s+|[!=]=\s*|\bin\s*[(\[{{]\s*)["']({names})["']"""
        rf"""|["']({suffixes})["']"""
        rf"""|\bSegment\([^,\n]+,\s*["']({names})["']"""
    )


def test_no_other_module_dispatches_on_a_format():
    named = _dispatch_on_a_format()
    seen = [
        'if seg.format == "stream":',
        'case "json":',
        'if fmt not in ("json", "csv"):',
        'if path.suffix.lower() == ".npy":',
        'Segment(str(path), "parquet", g, g + 1)',
    ]
    assert_only_named_in({"data/formats.py"}, named, seen, "format dispatch outside data.formats")
    assert not named.search('IDS = "bin"') and not named.search('f"{s}.{kind}"')


# -- a new format: one row and its reader ---------------------------------------------------------

# A made-up format: "|"-separated rows under a header, one document a row. Its module is all a
# new format needs besides the row; ``sitecustomize`` registers the row in each preparing process
# (a fresh interpreter) as it starts, the way the table's own rows exist there.
PSV_MODULE = """
from pathlib import Path

from fsdp_lab.data import formats, readers
from fsdp_lab.data.segment import Segment


def cut_psv(path, how):
    header = path.read_text(encoding="utf-8").split("\\n", 1)[0].split("|")
    if how.column not in header:
        raise readers.missing_column(how.column, str(path), header)
    return [Segment(str(path), how.format, 0, 0, path.stat().st_size)]


def read_psv(seg, column):
    header, *lines = Path(seg.path).read_text(encoding="utf-8").splitlines()
    index = header.split("|").index(column)
    for n, line in enumerate(lines, start=2):
        where = lambda n=n: f"{seg.path} line {n}"
        yield readers.text_value(line.split("|")[index], column, where)


ROW = formats.Format("psv", (".psv",), cut_psv, read_psv)
"""


@pytest.fixture
def psv_format(tmp_path, monkeypatch):
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    (plugin / "fsdp_lab_psv_format.py").write_text(textwrap.dedent(PSV_MODULE))
    (plugin / "sitecustomize.py").write_text(
        "import fsdp_lab_psv_format as psv\npsv.formats.INPUT_FORMATS['psv'] = psv.ROW\n"
    )
    monkeypatch.syspath_prepend(str(plugin))
    row = importlib.import_module("fsdp_lab_psv_format").ROW
    monkeypatch.setitem(formats.INPUT_FORMATS, "psv", row)
    path = os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    yield row
    monkeypatch.delitem(__import__("sys").modules, "fsdp_lab_psv_format", raising=False)


def _prepare(tmp_path, files: list[str], **data):
    data = {"kind": "text", "cache_dir": str(tmp_path / "cache"), "files": files, **data}
    cfg = to_typed({"data": data, "trainer": {"seq_len": 16}, "model": {"arch": "llama"}})
    return corpus_lib.prepare(cfg, corpus_lib.load_tokenizer(cfg), vocab_size=1 << 16)


def test_a_new_format_is_one_row_and_its_reader(tmp_path, psv_format):
    docs = [f"row {i}: " + "to be or not to be, " * (i % 9 + 1) for i in range(80)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    (tmp_path / "d.psv").write_text("id|body\n" + "".join(f"{i}|{d}\n" for i, d in enumerate(docs)))
    reference = _prepare(tmp_path, [str(tmp_path / "d.jsonl")], text_column="body")
    # Cut, read and tokenised by the preparing processes, into the cache and back as blocks:
    # the same documents give the same tokens as from JSON lines, under a key of their own.
    got = _prepare(tmp_path, [str(tmp_path / "d.psv")], text_column="body", num_proc=2)
    assert got.num_documents == len(docs) and got.fingerprint == reference.fingerprint
    assert got.path != reference.path
    with pytest.raises(ConfigError, match=r"data\.text_column='text' is not a column of .*d\.psv"):
        _prepare(tmp_path, [str(tmp_path / "d.psv")])
    # data=chat reads rows, which this row does not give: refused in one line.
    with pytest.raises(ConfigError, match=r"d\.psv has an extension data=chat does not read"):
        formats.file_format([tmp_path / "d.psv"], DataKind.chat)
