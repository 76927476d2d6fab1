"""FSDP unit selection on real (meta) Hugging Face models: no process group needed."""

from __future__ import annotations

import pytest

from fsdp_lab.config import ConfigError, ModelArch, ModelConfig, WrapConfig, WrapPolicy
from fsdp_lab.engine.model import build_hf_config, build_meta_model
from fsdp_lab.engine.wrap import select_units


def meta_model(arch: ModelArch, **kw):
    tied = arch is not ModelArch.llama
    return build_meta_model(build_hf_config(ModelConfig(arch=arch, tie_word_embeddings=tied, **kw)))


@pytest.mark.parametrize(
    "arch,block",
    [
        (ModelArch.llama, "LlamaDecoderLayer"),
        (ModelArch.qwen2, "Qwen2DecoderLayer"),
        (ModelArch.gpt2, "GPT2Block"),
    ],
)
def test_transformer_policy_takes_no_split_modules(arch, block):
    model = meta_model(arch, num_layers=3)
    units = select_units(model, WrapConfig(policy=WrapPolicy.transformer))
    assert [type(u).__name__ for u in units] == [block] * 3


def test_named_classes_and_unknown_class_lists_the_models_classes():
    model = meta_model(ModelArch.llama)
    units = select_units(model, WrapConfig(classes=["LlamaMLP"]))
    assert [type(u).__name__ for u in units] == ["LlamaMLP", "LlamaMLP"]
    with pytest.raises(ConfigError) as e:
        select_units(model, WrapConfig(classes=["LlamaBlock"]))
    assert "LlamaBlock" in str(e.value) and "LlamaDecoderLayer" in str(e.value)


def test_none_policy_is_root_only():
    assert select_units(meta_model(ModelArch.llama), WrapConfig(policy=WrapPolicy.none)) == []


def test_size_policy_is_bottom_up_and_never_splits_tied_embeddings():
    # vocab 512 x hidden 64: the embedding (32k) outweighs one Linear (16k), not an MLP (49k).
    model = meta_model(ModelArch.qwen2, num_layers=2, vocab_size=512)
    emb = model.get_input_embeddings()
    bar = emb.weight.numel()
    units = select_units(model, WrapConfig(policy=WrapPolicy.size, min_num_params=bar))
    assert model.model.layers[0].mlp in units  # the MLP alone passes the bar
    # The tied embedding passes the bar too, but its twin is the head: both are left to the root.
    assert emb not in units and model.get_output_embeddings() not in units
    # Untied: the embedding may be a unit of its own.
    llama = meta_model(ModelArch.llama)
    units = select_units(
        llama,
        WrapConfig(policy=WrapPolicy.size, min_num_params=llama.model.embed_tokens.weight.numel()),
    )
    assert llama.model.embed_tokens in units


def test_size_policy_counts_only_unwrapped_params():
    model = meta_model(ModelArch.llama, num_layers=2)
    mlp = sum(p.numel() for p in model.model.layers[0].mlp.parameters())
    units = select_units(model, WrapConfig(policy=WrapPolicy.size, min_num_params=mlp))
    assert model.model.layers[0].mlp in units
    # The layer's attention alone is below an MLP's size, so the layer is not a unit too.
    assert model.model.layers[0] not in units
