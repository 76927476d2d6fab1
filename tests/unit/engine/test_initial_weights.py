"""engine.loading in one process: the rank-0 route a checkpoint per rank cannot read takes, the
buffers every rank recomputes, and the safetensors files an export streams."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_lab.config import ModelConfig, ModelTask
from fsdp_lab.engine import conversion, loading
from fsdp_lab.engine import model as model_lib
from fsdp_lab.state.export import StreamedSafetensors, parse_size


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_a_checkpoint_per_rank_cannot_read_goes_through_rank0_and_says_so(
    saved, gloo_group, monkeypatch, caplog
):
    def unplannable(*args):
        raise conversion.NotPerRank("transformers splits x into 2 tensors")

    monkeypatch.setattr(conversion, "plan_loading", unplannable)
    hf = model_lib.build_hf_config(ModelConfig(name_or_path=str(saved)))
    model = model_lib.build_meta_model(hf)
    source = loading.InitialWeights(
        seed=0,
        pretrained=str(saved),
        whole=lambda: model_lib.load_pretrained(str(saved), ModelTask.causal_lm),
    )
    with caplog.at_level(logging.WARNING):
        model_lib.materialize(model, device=torch.device("cpu"), source=source)
    warned = [r.getMessage() for r in caplog.records if "cannot be read per rank" in r.getMessage()]
    assert warned and "(transformers splits x into 2 tensors)" in warned[0]
    assert "rank 0 reads the whole model" in warned[0] and "GB of host memory" in warned[0]
    want = LlamaForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
    assert all(torch.equal(want[k], v) for k, v in model.state_dict().items())


def test_every_rank_recomputes_the_non_persistent_buffers(saved):
    """to_empty leaves garbage in rotary inv_freq; the model's own init recomputes it."""
    hf = model_lib.build_hf_config(ModelConfig(name_or_path=str(saved)))
    model = model_lib.build_meta_model(hf)
    model.to_empty(device="cpu")
    model.model.rotary_emb.inv_freq.fill_(float("nan"))
    loading.recompute_buffers(model)
    want = LlamaForCausalLM(hf).model.rotary_emb.inv_freq
    assert torch.equal(model.model.rotary_emb.inv_freq, want)


def test_streamed_files_are_safetensors_in_save_pretrained_layout(tmp_path):
    from safetensors.torch import load_file

    values = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "big": torch.randn(100),
        "c": torch.tensor(3, dtype=torch.int64),
        "d": torch.ones(4, dtype=torch.bfloat16),
    }
    layout = [(k, v.dtype, tuple(v.shape)) for k, v in values.items()]
    files = StreamedSafetensors(tmp_path, layout, max_bytes=64)
    for key, value in values.items():
        files.write(key, value)
    files.finish()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 24 + 400 + 8 + 8
    assert index["weight_map"]["big"] == "model-00002-of-00003.safetensors"  # a file of its own
    read = {}
    for name in sorted(set(index["weight_map"].values())):
        read.update(load_file(tmp_path / name))
    assert read.keys() == values.keys() and all(torch.equal(read[k], v) for k, v in values.items())
    again = StreamedSafetensors(tmp_path / "x", layout, max_bytes=2**30)
    with pytest.raises(RuntimeError, match="big arrived where a was due"):
        again.write("big", values["big"])
    assert parse_size("2GB") == 2 * 10**9 and parse_size("200KB") == 200_000


def test_a_fine_tune_checkpointed_before_per_rank_loading_is_still_recognised(saved):
    """Checkpoints of 2026-11-26 and before record the whole model's fingerprint
    (finetune.frozen_fingerprint); it is computed again one tensor at a time, from the files."""
    from fsdp_lab.config import FinetuneConfig, FinetuneMethod
    from fsdp_lab.engine import finetune
    from fsdp_lab.state import checkpoint as ckpt
    from fsdp_lab.state.export_source import _base_reader

    lora = FinetuneConfig(method=FinetuneMethod.lora, r=4)
    old = LlamaForCausalLM.from_pretrained(saved, dtype=torch.float32)
    finetune.apply(old, lora)
    recorded = finetune.frozen_fingerprint(old)  # what such a checkpoint holds
    assert ckpt.legacy_fingerprint(recorded) and not ckpt.legacy_fingerprint("files:0")
    hf = model_lib.build_hf_config(ModelConfig(name_or_path=str(saved)))
    whole = model_lib.full_model(hf, seed=0, finetune_cfg=lora, pretrained=str(saved))
    assert finetune.frozen_fingerprint(whole, lambda _, p: p) == recorded
    meta = model_lib.model_on_meta(hf, ModelTask.causal_lm, lora)
    _base_reader(saved, {"fingerprint": recorded}, meta, 0, str(saved))  # accepted
    with pytest.raises(ckpt.CheckpointError, match="differ from its base"):
        _base_reader(saved, {"fingerprint": "0" * 32}, meta, 0, str(saved))
