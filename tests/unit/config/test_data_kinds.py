"""The data kinds table: a row per kind, what reads it follows the row, and no other module
compares kinds; the formats a kind accepts come from the format table's columns."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import assert_only_named_in

from fsdp_lab.config import ConfigError, DataConfig, DataKind, Packing, to_typed
from fsdp_lab.config import data_kinds as kinds
from fsdp_lab.config.data import check_data
from fsdp_lab.config.data_kinds import Holds, Rows, Source
from fsdp_lab.data import formats


def test_every_kind_has_one_row_and_every_column_it_reads_has_formats():
    assert set(kinds.DATA_KINDS) == set(DataKind)
    for kind, row in kinds.DATA_KINDS.items():
        if row.reads is not None:
            assert formats.read_by(kind), kind  # some format gives what the kind reads
        assert row.prepared == (row.source is not Source.generated)
        assert row.source is not Source.files or row.reads is not None  # files read somehow


def test_the_formats_a_kind_reads_are_the_format_tables_column():
    suffixes = lambda kind: {s for row in formats.read_by(kind) for s in row.suffixes}
    assert {".txt", ".md", ".jsonl", ".parquet", ".csv"} <= suffixes(DataKind.text)
    assert suffixes(DataKind.chat) == {".json", ".jsonl", ".parquet"}
    assert suffixes(DataKind.tokens) == {".bin", ".npy"}
    with pytest.raises(ValueError, match="reads no files"):
        formats.read_by(DataKind.synthetic)


NAMED = re.compile(r"\bDataKind\.(synthetic|text|hub|shakespeare|tokens|chat)\b")


def test_no_other_module_compares_kinds():
    # The schema names the default kind; the table says what each kind is.
    assert_only_named_in(
        {"config/data_kinds.py", "config/data.py"},
        NAMED,
        ["if cfg.data.kind is DataKind.chat:"],
        "data kind dispatch outside config.data_kinds",
    )


def test_what_reads_the_rows_follows_them(monkeypatch):
    """A throwaway change to rows moves what reads them: the rules, the formats read, the
    plan's masks."""
    from fsdp_lab.planning import plan

    cp = ["data.files=[c.jsonl]", "parallel.context=2"]
    packed = plan.build_plan(["data=chat", *cp], "cpu").chosen_plan
    blocks = plan.build_plan(["data=shakespeare", "parallel.context=2"], "cpu").chosen_plan
    assert packed != blocks
    rows = dict(kinds.DATA_KINDS)
    # data=text read as token ids: the .bin/.npy formats, the vocabulary rule of token files
    rows[DataKind.text] = dataclasses.replace(rows[DataKind.text], reads=Holds.ids)
    # data=tokens as conversations: chat's settings apply to it, and it needs a causal LM
    rows[DataKind.tokens] = dataclasses.replace(rows[DataKind.tokens], rows=Rows.conversations)
    # data=chat as plain blocks: its chat-only settings are refused
    rows[DataKind.chat] = dataclasses.replace(rows[DataKind.chat], rows=Rows.blocks)
    # data=hub from files: it needs data.files, not data.name
    rows[DataKind.hub] = dataclasses.replace(
        rows[DataKind.hub], source=Source.files, reads=Holds.texts
    )
    monkeypatch.setattr(kinds, "DATA_KINDS", rows)

    assert {s for r in formats.read_by(DataKind.text) for s in r.suffixes} == {".bin", ".npy"}
    with pytest.raises(ConfigError, match=r"data=text needs data\.files=.*token ids"):
        check_data(DataConfig(kind=DataKind.text))
    with pytest.raises(ConfigError, match=r"data=text with model=llama: model\.vocab_size"):
        to_typed({"data": {"kind": "text", "files": ["a.txt"]}, "model": {"arch": "llama"}})
    check_data(DataConfig(kind=DataKind.tokens, files=["a.bin"], packing=Packing.pad))
    with pytest.raises(ConfigError, match=r"applies to data=tokens \(conversations\)"):
        check_data(DataConfig(kind=DataKind.chat, files=["c.jsonl"], packing=Packing.pad))
    masked = {
        "data": {"kind": "tokens", "files": ["a.bin"]},
        "model": {"arch": "bert", "task": "masked_lm"},
    }
    with pytest.raises(ConfigError, match="data=tokens trains a causal LM on replies"):
        to_typed(masked)
    with pytest.raises(ConfigError, match=r"data=hub needs data\.files"):
        check_data(DataConfig(kind=DataKind.hub, name="roneneldan/TinyStories"))
    # the plan's CP masks: chat's rows are no longer packed documents
    assert plan.build_plan(["data=chat", *cp], "cpu").chosen_plan == blocks


def test_a_kind_that_is_generated_is_never_prepared(monkeypatch):
    """The launcher, the ranks and `fsdp-lab data prepare` ask the row, not the name."""
    from fsdp_lab.tools import data as data_tool

    with pytest.raises(ConfigError, match="data=synthetic is made as it is read"):
        data_tool.prepare_command([])
    rows = dict(kinds.DATA_KINDS)
    rows[DataKind.shakespeare] = dataclasses.replace(
        rows[DataKind.shakespeare], source=Source.generated
    )
    monkeypatch.setattr(kinds, "DATA_KINDS", rows)
    with pytest.raises(ConfigError, match="data=shakespeare is made as it is read"):
        data_tool.prepare_command(["data=shakespeare"])
