"""Real Hugging Face models through train.py: pretrained weights, tied embeddings under every
strategy, masked-LM encoders, activation checkpointing, compile, and text data end to end."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import check_ok, train

from fsdp_lab.observe.run_logs import read_metrics

pytestmark = pytest.mark.slow


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")]


def facts(run_dir) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def save_tiny(path, *, arch: str = "llama", tied: bool = False, seed: int = 123, **sizes):
    """A small pretrained-looking directory: config, safetensors and a tokenizer (``sizes``:
    config fields that differ from the tiny ones)."""
    from transformers import (
        ByT5Tokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    cls, config_cls = {
        "llama": (LlamaForCausalLM, LlamaConfig),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config),
    }[arch]
    config = config_cls(
        vocab_size=259,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        bos_token_id=0,
        eos_token_id=1,
    )
    for key, value in sizes.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = cls(config)
    model.save_pretrained(path)
    ByT5Tokenizer(extra_ids=0).save_pretrained(path)
    return model


def hf_weights(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_pretrained_weights_reach_every_shard_exactly(tmp_path, arch, tied):
    source = tmp_path / "pretrained"
    save_tiny(source, arch=arch, tied=tied)
    want = hf_weights(source)
    run = tmp_path / "run"
    # An lr of 1e-30 moves a weight by at most 1e-30 (zero biases become +-1e-30; every other
    # fp32 weight stays bitwise the same): the export must be the loaded weights.
    check_ok(
        train(
            run,
            "model=local",
            f"model.name_or_path={source}",
            "trainer.max_steps=1",
            "optim.lr=1e-30",
            "optim.warmup_steps=0",
            "checkpoint.export_hf=true",
        )
    )
    got = hf_weights(run / "hf")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-29, msg=name)
    assert facts(run)["pretrained"] is True
    assert (run / "hf" / "tokenizer_config.json").is_file()  # the model's tokenizer comes along
    # The same directory with pretrained=false: its architecture, seeded random weights.
    check_ok(
        train(
            tmp_path / "random",
            "model=local",
            f"model.name_or_path={source}",
            "model.pretrained=false",
            "trainer.max_steps=1",
            "optim.lr=1e-30",
            "optim.warmup_steps=0",
            "checkpoint.export_hf=true",
        )
    )
    fresh = hf_weights(tmp_path / "random" / "hf")
    assert not torch.equal(
        fresh["model.layers.0.mlp.up_proj.weight"], want["model.layers.0.mlp.up_proj.weight"]
    )


def test_pretrained_without_weights_fails_before_launch(tmp_path):
    source = tmp_path / "config_only"
    save_tiny(source)
    (source / "model.safetensors").unlink()
    proc = train(tmp_path / "run", "model=local", f"model.name_or_path={source}")
    assert proc.returncode == 2 and "holds no weights" in proc.stderr
    assert "model.pretrained=false" in proc.stderr


@pytest.mark.parametrize(
    "sharding,nproc,model",
    [
        ("full", 2, "qwen2_tiny"),
        ("grad_op", 2, "qwen2_tiny"),
        ("no_shard", 2, "qwen2_tiny"),
        ("hybrid", 4, "qwen2_tiny"),
        ("hybrid_zero2", 4, "gpt2_tiny"),
        ("full", 2, "gpt2_tiny"),
    ],
)
def test_tied_embeddings_stay_tied_through_training_checkpoint_and_export(
    tmp_path, sharding, nproc, model
):
    from transformers import AutoModelForCausalLM

    from fsdp_lab.state.export_source import load_checkpoint_weights

    run = tmp_path / "run"
    check_ok(
        train(
            run,
            f"model={model}",
            f"sharding={sharding}",
            f"hardware.nproc_per_node={nproc}",
            "trainer.max_steps=4",
            "checkpoint.export_hf=true",
            # units by size: the embedding alone would qualify; it must stay with the head
            "wrap=size",
            "wrap.min_num_params=10000",
        )
    )
    sd, _, _ = load_checkpoint_weights(run)
    head, embed = (
        ("lm_head.weight", "model.embed_tokens.weight")
        if model == "qwen2_tiny"
        else ("lm_head.weight", "transformer.wte.weight")
    )
    # DCP stores the shared tensor under both names; read apart, the two copies agree, and the
    # optimizer holds one state for the one parameter.
    step_dir = sorted((run / "checkpoints").glob("step_*"))[-1]
    stored = dcp.FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    assert {f"model.{head}", f"model.{embed}"} <= stored.keys()
    assert not any(k.startswith(f"optim.state.{head}.") for k in stored)
    apart = {"model": {k: torch.empty_like(sd[k]) for k in (head, embed)}}
    dcp.load(apart, checkpoint_id=str(step_dir), no_dist=True)
    assert torch.equal(apart["model"][head], apart["model"][embed])
    exported = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert exported.lm_head.weight is exported.get_input_embeddings().weight
    assert torch.equal(exported.get_input_embeddings().weight, sd[embed])
    assert "root" in facts(run)["fsdp_units"]


def test_masked_lm_encoder_trains_on_text_and_exports(tmp_path):
    """Parity of the masked-LM path is in test_parity; here it learns and round-trips."""
    from transformers import AutoModelForMaskedLM, AutoTokenizer

    run = tmp_path / "run"
    check_ok(
        train(
            run,
            "model=bert_tiny",
            "data=shakespeare",
            "trainer.seq_len=128",
            "trainer.max_steps=40",
            "trainer.eval_every=20",
            "checkpoint.export_hf=true",
        )
    )
    got = losses(run)
    assert got[-1] < 0.7 * got[0], got  # 5.6 (uniform over 260 ids) -> byte statistics
    val = read_metrics(run / "metrics.jsonl", split="val")
    assert [r["step"] for r in val] == [0, 20, 40] and val[2]["val_loss"] < 0.7 * val[0]["val_loss"]
    f = facts(run)
    assert f["task"] == "masked_lm" and f["fsdp_units"].startswith("BertLayer x2")
    assert f["data"]["tokenizer"] == "ByT5Tokenizer"
    assert "vocab_size: 260" in (run / "config.yaml").read_text()  # 259 bytes+specials, [MASK]
    model = AutoModelForMaskedLM.from_pretrained(run / "hf")
    assert type(model).__name__ == "BertForMaskedLM"
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    tok = AutoTokenizer.from_pretrained(run / "hf")
    ids = tok("To be, or not to <mask> be", return_tensors="pt")["input_ids"]
    assert ids.max() < model.config.vocab_size and tok.mask_token_id == 259


def test_activation_checkpointing_leaves_the_loss_unchanged(tmp_path):
    common = ("trainer.max_steps=5", "model.num_layers=4", "hardware=cpu", "checkpoint=none")
    check_ok(train(tmp_path / "none", *common))
    for mode, chosen in [("full", [0, 1, 2, 3]), ("selective", [0, 3])]:
        check_ok(
            train(
                tmp_path / mode,
                *common,
                f"activation_checkpointing={mode}",
                "activation_checkpointing.every=3",
            )
        )
        assert losses(tmp_path / mode) == losses(tmp_path / "none"), mode
        assert facts(tmp_path / mode)["activation_checkpointing"] == chosen


def test_activation_checkpointed_run_resumes_from_a_plain_checkpoint(tmp_path):
    """Wrappers add `_checkpoint_wrapped_module.` to parameter names; checkpoints must not."""
    first = tmp_path / "first"
    check_ok(train(first, "trainer.max_steps=6", "checkpoint.every_n_steps=3"))
    resumed = tmp_path / "resumed"
    check_ok(
        train(
            resumed,
            "trainer.max_steps=6",
            "activation_checkpointing=full",
            f"resume={first / 'checkpoints' / 'step_00000003'}",
        )
    )
    assert losses(resumed) == losses(first)[3:]


def test_compile_matches_eager(tmp_path):
    common = ("trainer.max_steps=4", "hardware=cpu", "checkpoint=none")
    check_ok(train(tmp_path / "eager", *common))
    check_ok(
        train(
            tmp_path / "compiled",
            *common,
            "compile=true",
            "activation_checkpointing=full",
            timeout=900,
        )
    )
    assert facts(tmp_path / "compiled")["compiled"] is True
    diffs = [
        abs(a - b)
        for a, b in zip(losses(tmp_path / "compiled"), losses(tmp_path / "eager"), strict=True)
    ]
    assert len(diffs) == 4 and max(diffs) < 1e-4, diffs


def test_text_data_resumes_on_exactly_the_batches_of_an_uninterrupted_run(tmp_path):
    common = (
        "data=shakespeare",
        "trainer.seq_len=32",
        "trainer.max_steps=8",
        "trainer.eval_every=4",
    )
    straight = tmp_path / "straight"
    check_ok(train(straight, *common, "checkpoint.every_n_steps=4"))
    step4 = straight / "checkpoints" / "step_00000004"
    resumed = tmp_path / "resumed"
    check_ok(train(resumed, *common, f"resume={step4}"))
    assert losses(resumed) == losses(straight)[4:]

    def val(run):
        return [(r["step"], r["val_loss"]) for r in read_metrics(run / "metrics.jsonl", "val")]

    assert val(resumed) == val(straight)[2:]  # steps 0 and 4 were before the checkpoint
    # On one rank with twice the micro-batch: the same global rows (the loader continues at
    # the rows consumed), so the same losses but for the order of the sums.
    wider = tmp_path / "one_rank"
    one = ("hardware.nproc_per_node=1", "trainer.micro_batch_size=8", f"resume={step4}")
    check_ok(train(wider, *common, *one))
    assert facts(wider)["data"]["fingerprint"] == facts(straight)["data"]["fingerprint"]
    diffs = [abs(a - b) for a, b in zip(losses(wider), losses(straight)[4:], strict=True)]
    assert max(diffs) < 1e-5, diffs
