"""Each rank's batches: the loader's order across ranks, epochs and resumes, validation
batches, masking; the tokenizer a run uses. Preparing corpora is tested in test_corpus.py."""

from __future__ import annotations

import functools
import operator

import numpy as np
import pytest
import torch

from fsdp_lab.config import Config, ConfigError, DataKind, ModelTask, to_typed
from fsdp_lab.data import corpus as corpus_lib
from fsdp_lab.data.loader import IGNORE_INDEX, Masking, PackedData, SyntheticData, build_data
from fsdp_lab.engine.model import resolve_vocab_size


def make_cfg(tmp_path, **data) -> Config:
    data = {"kind": "text", "cache_dir": str(tmp_path / "cache"), **data}
    return to_typed({"data": data, "trainer": {"seq_len": 16}, "model": {"arch": "llama"}})


def packed(train_blocks=37, *, dp_size=1, dp_rank=0, micro=2, accum=1, seed=0):
    train = np.arange(train_blocks * 4, dtype=np.int32).reshape(train_blocks, 4)
    return PackedData(
        train=train,
        val=train[:5],
        fingerprint="f",
        seed=seed,
        micro_batch_size=micro,
        grad_accum_steps=accum,
        dp_size=dp_size,
        dp_rank=dp_rank,
        masking=None,
    )


def block_ids(batch) -> list[int]:
    return (batch["input_ids"][:, 0] // 4).tolist()


def global_ids(data, step, micro) -> list[int]:
    return (data.global_rows(step, micro)[:, 0] // 4).tolist()


def test_each_epoch_visits_every_block_once_in_a_new_order():
    data = packed(37, micro=1)
    seen = [block_ids(data.batch(step, 0))[0] for step in range(74)]
    assert sorted(seen[:37]) == sorted(seen[37:]) == list(range(37))
    assert seen[:37] != seen[37:]


def test_ranks_split_the_global_batch_whatever_the_world_size():
    one = packed(dp_size=1, micro=4)
    two = [packed(dp_size=2, dp_rank=r, micro=2) for r in range(2)]
    for step in range(20):
        whole = block_ids(one.batch(step, 0))
        assert block_ids(two[0].batch(step, 0)) + block_ids(two[1].batch(step, 0)) == whole


def test_restore_continues_at_the_saved_row_even_on_another_world_size():
    straight = packed(dp_size=2, micro=2, accum=2)
    rows = [global_ids(straight, s, m) for s in range(10) for m in range(2)]
    resumed = packed(dp_size=2, micro=2, accum=2)
    resumed.restore(straight.state(4), 4)
    assert [global_ids(resumed, s, m) for s in range(4, 10) for m in range(2)] == rows[8:]
    # 4 ranks of 1 row after a 2-rank run: the same global rows, dealt differently.
    wider = [packed(dp_size=4, dp_rank=r, micro=1, accum=2) for r in range(4)]
    for w in wider:
        w.restore(straight.state(4), 4)
    got = [
        functools.reduce(operator.iadd, (block_ids(w.batch(s, m)) for w in wider), [])
        for s in range(4, 10)
        for m in range(2)
    ]
    assert got == rows[8:]
    other = packed(dp_size=2, micro=2, accum=2)
    other.restore({**straight.state(4), "fingerprint": "other data"}, 4)
    assert global_ids(other, 4, 0) == rows[0]  # new data starts from its beginning


def test_validation_batches_cover_the_split_once_with_padding_ignored():
    data = packed(dp_size=2, dp_rank=1, micro=2)  # 5 validation blocks, 4 rows per micro-batch
    assert data.num_val_batches(10) == 2 and data.num_val_batches(1) == 1
    last = data.val_batch(1)  # global rows 4..7 of which only row 4 exists: rank 1 gets 6, 7
    assert (last["labels"] == IGNORE_INDEX).all()


def test_masking_follows_bert_and_never_masks_special_tokens():
    ids = torch.randint(3, 100, (64, 128))
    ids[:, ::10] = 1  # EOS
    masking = Masking(mask_id=103, vocab_size=100, probability=0.15, special_ids=(1,))
    inputs, labels = masking(ids, torch.Generator().manual_seed(0))
    chosen = labels != IGNORE_INDEX
    assert abs(chosen.float().mean().item() - 0.15 * 0.9) < 0.01
    assert not chosen[ids == 1].any()
    assert torch.equal(labels[chosen], ids[chosen]) and torch.equal(inputs[~chosen], ids[~chosen])
    masked = (inputs == 103)[chosen].float().mean().item()
    kept = (inputs == ids)[chosen].float().mean().item()
    assert abs(masked - 0.8) < 0.03 and abs(kept - 0.1) < 0.03
    again = masking(ids, torch.Generator().manual_seed(0))
    assert torch.equal(again[0], inputs)  # a pure function of the generator's seed
    # A row the draw left empty still predicts one token: its first non-special one.
    rare = Masking(mask_id=103, vocab_size=100, probability=1e-9, special_ids=(1,))
    row = torch.tensor([[1, 1, 7, 8]])
    _, labels = rare(row, torch.Generator().manual_seed(0))
    assert labels.tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 7, IGNORE_INDEX]]


def test_synthetic_masked_lm_reserves_the_last_id_for_mask():
    cfg = to_typed({"model": {"arch": "bert", "task": "masked_lm"}})
    assert cfg.model.task is ModelTask.masked_lm and cfg.data.kind is DataKind.synthetic
    data = build_data(cfg, corpus=None, tokenizer=None, vocab_size=256, dp_size=1, dp_rank=0)
    assert isinstance(data, SyntheticData)
    batch = data.batch(0, 0)
    chosen = batch["labels"] != IGNORE_INDEX
    assert chosen.any() and (batch["labels"][chosen] < 255).all()
    assert (batch["input_ids"] == 255).any()


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "masked-lm"])
def test_every_layout_of_a_global_batch_trains_on_the_same_rows(masked):
    # 4 rows a step dealt as 4 micro-batches of 1, 1 of 4, or 4 ranks of 1: the same rows and
    # (masked LM) the same masks, so accumulation and data parallelism are checkable as equal.
    masking = Masking(mask_id=63, vocab_size=63, probability=0.3) if masked else None

    def synthetic(accum, dp, rank, micro):
        return SyntheticData(
            vocab_size=64,
            seq_len=8,
            seed=3,
            micro_batch_size=micro,
            grad_accum_steps=accum,
            dp_size=dp,
            dp_rank=rank,
            masking=masking,
        )

    def step_rows(loaders, step):
        steps = [data.step_batches(step) for data in loaders]
        assert len({targets for _, targets in steps}) == 1  # every rank counts the whole batch
        rows = [b for m in range(len(steps[0][0])) for batches, _ in steps for b in [batches[m]]]
        return {k: torch.cat([b[k] for b in rows]) for k in rows[0]}, steps[0][1]

    layouts = [
        [synthetic(4, 1, 0, 1)],
        [synthetic(1, 1, 0, 4)],
        [synthetic(1, 4, r, 1) for r in range(4)],
        [synthetic(2, 2, r, 1) for r in range(2)],
    ]
    for step in (0, 5):
        want, targets = step_rows(layouts[0], step)
        for loaders in layouts[1:]:
            got, count = step_rows(loaders, step)
            assert count == targets
            assert all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(step_rows(layouts[0], 0)[0]["input_ids"], want["input_ids"])


def test_preset_vocabulary_follows_the_tokenizer(tmp_path):
    cfg = make_cfg(tmp_path, files=["x"])
    tok = corpus_lib.load_tokenizer(cfg)
    assert resolve_vocab_size(cfg.model, tok).vocab_size == len(tok) == 259
    assert resolve_vocab_size(cfg.model, None).vocab_size == 256
    bert = to_typed(
        {"model": {"arch": "bert", "task": "masked_lm"}, "data": {"kind": "shakespeare"}}
    )
    assert len(corpus_lib.load_tokenizer(bert)) == 260  # byte-level plus a mask token


def test_the_model_directory_tokenizer_is_used(tmp_path):
    from transformers import ByT5Tokenizer

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama"}')
    ByT5Tokenizer(extra_ids=5).save_pretrained(model_dir)
    cfg = to_typed({"model": {"name_or_path": str(model_dir)}, "data": {"kind": "shakespeare"}})
    assert len(corpus_lib.load_tokenizer(cfg)) == 259 + 5
    # Pretrained weights without their tokenizer would be fed the wrong ids: refused.
    for f in model_dir.iterdir():
        if f.name != "config.json":
            f.unlink()
    pretrained = to_typed(
        {
            "model": {"name_or_path": str(model_dir), "pretrained": True},
            "data": {"kind": "shakespeare"},
        }
    )
    with pytest.raises(ConfigError, match=r"has no tokenizer.*data\.tokenizer="):
        corpus_lib.load_tokenizer(pretrained)


def test_paths_are_made_absolute_for_later_use(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    cfg = to_typed(
        {
            "model": {"name_or_path": "model"},
            "data": {"kind": "text", "files": ["docs/*.txt"], "tokenizer": "model"},
        }
    )
    out = corpus_lib.absolute_paths(cfg)
    assert out.model.name_or_path == str(tmp_path / "model") == out.data.tokenizer
    assert out.data.files == [str(tmp_path / "docs" / "*.txt")]
    hub = to_typed({"model": {"name_or_path": "HuggingFaceTB/SmolLM2-135M"}})
    assert corpus_lib.absolute_paths(hub).model.name_or_path == "HuggingFaceTB/SmolLM2-135M"


def test_an_encoder_is_not_trained_as_a_causal_lm():
    from transformers import BertConfig, LlamaConfig

    from fsdp_lab.engine.model import check_task

    with pytest.raises(ConfigError, match=r"encoder.*model\.task=masked_lm"):
        check_task(BertConfig(), ModelTask.causal_lm)
    check_task(BertConfig(), ModelTask.masked_lm)
    check_task(BertConfig(is_decoder=True), ModelTask.causal_lm)
    check_task(LlamaConfig(), ModelTask.causal_lm)
