"""`fsdp-lab data prepare`: the corpus a run will find, prepared without the run."""

from __future__ import annotations

import json

import pytest

from fsdp_lab.config import compose
from fsdp_lab.data import cache
from fsdp_lab.data import corpus as corpus_lib
from fsdp_lab.tools import cli


def test_prepare_makes_the_entry_train_py_finds(tmp_path, monkeypatch, capsys):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " * 9}) + "\n" for i in range(80)))
    overrides = ["data=text", f"data.files={path}", f"data.cache_dir={tmp_path / 'cache'}"]
    assert cli.main(["data", "prepare", *overrides]) == 0
    assert "data: 80 documents" in capsys.readouterr().err
    (entry,) = (tmp_path / "cache").glob("tokens-*/meta.json")

    def no_rebuild(*a, **k):
        raise AssertionError("the run would prepare it again")

    monkeypatch.setattr(cache, "build", no_rebuild)
    cfg = corpus_lib.absolute_paths(compose([*overrides, "trainer.seq_len=32"]))
    tok = corpus_lib.load_tokenizer(cfg)
    assert corpus_lib.prepare(cfg, tok, vocab_size=len(tok)).path == entry.parent


@pytest.mark.parametrize(
    "overrides,expected",
    [([], "data=synthetic is made as it is read"), (["data=text"], "data.files")],
)
def test_prepare_refuses_in_one_line(overrides, expected, capsys):
    assert cli.main(["data", "prepare", *overrides]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1
