"""finetune.apply on meta and CPU models: what freezes, what PEFT adds, what is refused."""

from __future__ import annotations

import pytest
import torch

from fsdp_lab.config import (
    ConfigError,
    FinetuneConfig,
    FinetuneMethod,
    HardwareKind,
    ModelArch,
    ModelConfig,
    ModelTask,
    to_typed,
)
from fsdp_lab.config.rules import refuse_for_hardware
from fsdp_lab.engine import finetune
from fsdp_lab.engine import model as model_lib

LORA = FinetuneMethod.lora


def meta(arch: ModelArch = ModelArch.llama, **kw):
    task = ModelTask.masked_lm if arch is ModelArch.bert else ModelTask.causal_lm
    hf = model_lib.build_hf_config(ModelConfig(arch=arch, task=task, **kw))
    return model_lib.build_meta_model(hf, task)


@pytest.mark.parametrize(
    "arch,targets",
    [
        (ModelArch.llama, {"q_proj", "v_proj"}),
        (ModelArch.qwen2, {"q_proj", "v_proj"}),
        (ModelArch.bert, {"query", "value"}),
        (ModelArch.gpt2, {"c_attn"}),  # GPT-2's Conv1D
    ],
)
def test_lora_defaults_to_pefts_targets_and_freezes_the_base(arch, targets):
    model = meta(arch)
    base = {n for n, _ in model.named_parameters()}
    finetune.apply(model, FinetuneConfig(method=LORA, r=4))
    trainable = finetune.trainable_names(model)
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == targets
    frozen = {
        n.replace(".base_layer", "") for n, p in model.named_parameters() if not p.requires_grad
    }
    assert frozen == base  # the whole base, nothing else
    r = {p.shape[0] for n, p in model.named_parameters() if ".lora_A." in n}
    assert r == {4} and all(p.is_meta for p in model.parameters())


def test_freeze_patterns_and_blocks():
    model = meta(num_layers=3)
    cfg = FinetuneConfig(
        method=FinetuneMethod.freeze, freeze=["model.embed_tokens", "*.post_attention_layernorm.*"]
    )
    finetune.apply(model, FinetuneConfig(**{**cfg.__dict__, "freeze_blocks": 2}))
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert "model.embed_tokens.weight" in frozen
    assert {n for n in frozen if n.startswith("model.layers.0.")} == {
        n for n, _ in model.named_parameters() if n.startswith("model.layers.0.")
    }
    assert "model.layers.2.post_attention_layernorm.weight" in frozen
    assert "model.layers.2.mlp.up_proj.weight" not in frozen and "lm_head.weight" not in frozen
    trainable, total = finetune.counts(model)
    assert 0 < trainable < total


@pytest.mark.parametrize(
    "cfg,fragment",
    [
        (FinetuneConfig(method=LORA, target_modules=["qproj"]), "its linear layers are down_proj"),
        (FinetuneConfig(method=FinetuneMethod.freeze, freeze=["nothing.here"]), "matches no"),
        (FinetuneConfig(method=FinetuneMethod.freeze, freeze=["*"]), "freezes every parameter"),
        (FinetuneConfig(method=FinetuneMethod.freeze, freeze_blocks=3), "has 2 blocks"),
    ],
)
def test_what_cannot_train_is_refused_naming_the_setting(cfg, fragment):
    with pytest.raises(ConfigError, match=fragment):
        finetune.apply(meta(), cfg)


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        ({"r": 0}, "finetune.r=0 must be > 0"),
        ({"dropout": 1.0}, "finetune.dropout=1.0"),
        ({"target_modules": []}, "names no module"),
        ({"method": "full", "r": 16}, "finetune.r applies only to finetune=lora"),
        ({"method": "lora", "freeze_blocks": 1}, "applies only to finetune=freeze"),
        ({"method": "freeze"}, "freezes nothing"),
    ],
)
def test_bad_finetune_settings_are_one_line(overrides, fragment):
    settings = {"method": "lora", **overrides}
    with pytest.raises(ConfigError, match=fragment):
        to_typed({"model": {"arch": "llama"}, "finetune": settings})


def test_lora_is_refused_on_tpu():
    cfg = to_typed({"model": {"arch": "llama"}, "finetune": {"method": "lora"}})
    with pytest.raises(ConfigError, match="finetune=lora: frozen parameters"):
        refuse_for_hardware(cfg, HardwareKind.tpu)


def test_adapters_are_seeded_and_the_fingerprint_is_of_the_frozen_base():
    hf = model_lib.build_hf_config(ModelConfig(arch=ModelArch.llama))
    cfg = FinetuneConfig(method=LORA)

    def full(seed: int):
        model = model_lib.build_full_model(hf, seed=seed, task=ModelTask.causal_lm)
        finetune.apply(model, cfg, seed=0)
        return model

    a, b, other = full(1), full(1), full(2)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    assert all(torch.equal(sd_a[k], sd_b[k]) for k in sd_a)
    lora_a = [v for k, v in sd_a.items() if ".lora_A." in k]
    assert all(v.abs().sum() > 0 for v in lora_a)  # Kaiming-uniform, not zeros
    assert all(v.abs().sum() == 0 for k, v in sd_a.items() if ".lora_B." in k)  # zeros
    assert finetune.frozen_fingerprint(a) == finetune.frozen_fingerprint(b)
    assert finetune.frozen_fingerprint(a) != finetune.frozen_fingerprint(other)
    with torch.no_grad():  # training the adapters does not change it; touching the base does
        next(p for n, p in a.named_parameters() if ".lora_B." in n).add_(1.0)
        assert finetune.frozen_fingerprint(a) == finetune.frozen_fingerprint(b)
        a.model.norm.weight.add_(1e-7)
        assert finetune.frozen_fingerprint(a) != finetune.frozen_fingerprint(b)
    nothing_frozen = model_lib.build_full_model(hf, seed=0, task=ModelTask.causal_lm)
    assert finetune.frozen_fingerprint(nothing_frozen) is None
