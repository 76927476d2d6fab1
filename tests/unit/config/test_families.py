"""The model-family table: a row per Hugging Face model type, and no other place that names a
family; a new family is one row."""

from __future__ import annotations

import dataclasses
import re

import pytest
from conftest import assert_only_named_in
from torch import nn

from fsdp_lab.config import ConfigError, HardwareKind, LossConfig, LossKind, ModelArch, ModelConfig
from fsdp_lab.config import families as fam
from fsdp_lab.engine.model import build_hf_config, build_meta_model
from fsdp_lab.planning import activation_memory
from fsdp_lab.train import loss as loss_lib


def preset(arch: ModelArch) -> ModelConfig:
    row = fam.preset_family(arch)
    return ModelConfig(arch=arch, task=row.task, vocab_size=256, num_experts=4 * row.experts)


def test_every_preset_has_one_row_and_builds_its_model_type():
    for arch in ModelArch:
        row = fam.preset_family(arch)
        assert [r for r in fam.FAMILIES.values() if r.preset is arch] == [row]
        assert build_hf_config(preset(arch)).model_type == row.model_type


@pytest.mark.parametrize("arch", list(ModelArch))
def test_low_precision_linears_are_linear_layers_and_never_the_head(arch):
    row = fam.preset_family(arch)
    model = build_meta_model(build_hf_config(preset(arch)), row.task)
    leaves = {}
    for name, module in model.named_modules():
        leaves.setdefault(name.rpartition(".")[2], []).append(module)
    for leaf in row.low_precision_linears:
        assert leaves.get(leaf), f"{arch.name}: no module named {leaf}"
        assert all(isinstance(m, nn.Linear) for m in leaves[leaf]), (arch.name, leaf)
    assert "lm_head" not in row.low_precision_linears
    if row.experts:  # the router stays in full precision
        assert "gate" not in row.low_precision_linears


def test_presets_rules_come_from_the_row():
    with pytest.raises(ConfigError, match=r"a masked_lm preset; set model\.task=masked_lm"):
        fam.check_preset(ModelConfig(arch=ModelArch.bert))
    with pytest.raises(ConfigError, match="is dense; use a mixture-of-experts preset"):
        fam.check_preset(ModelConfig(arch=ModelArch.llama, num_experts=8))
    # GPT-2 has no grouped-query attention: its heads need not divide by num_kv_heads
    fam.check_preset(ModelConfig(arch=ModelArch.gpt2, num_heads=4, num_kv_heads=3))
    with pytest.raises(ConfigError, match=r"divisible by model\.num_kv_heads"):
        fam.check_preset(ModelConfig(arch=ModelArch.llama, num_heads=4, num_kv_heads=3))


NAMED = re.compile(r"\bModelArch\.\w+|model_type (==|!=|in|not in) [\"'{(]")


def test_no_other_module_names_a_family():
    allowed = {"config/families.py", "config/model.py"}
    seen = ["if m.arch is ModelArch.gpt2:", 'if hf_config.model_type in ("llama", "qwen2"):']
    assert_only_named_in(allowed, NAMED, seen, "model family named outside config.families")


def test_a_new_family_is_one_row(monkeypatch):
    """Phi-3 has no row: the fused losses refuse it and the plan guesses its layer. One row
    (as a user would add it to FAMILIES) makes loss=auto fuse it and the plan know it."""
    from transformers import Phi3Config

    hf = Phi3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    causal, cpu = ModelConfig().task, HardwareKind.cpu

    def resolve(kind: LossKind) -> LossKind:
        return loss_lib.resolve_loss(LossConfig(kind=kind), hf, causal, cpu, compiled=False)

    assert resolve(LossKind.auto) is LossKind.hf
    with pytest.raises(ConfigError, match="model_type=phi3"):
        resolve(LossKind.chunked)
    assert activation_memory.layer_shape(hf, causal)[1]  # a note: estimated as Llama's

    row = fam.Family("phi3", fam.Activations.llama, fused_loss=True)
    monkeypatch.setitem(fam.FAMILIES, "phi3", row)
    assert resolve(LossKind.auto) is LossKind.chunked
    assert resolve(LossKind.chunked) is LossKind.chunked
    assert activation_memory.layer_shape(hf, causal)[1] == []
    assert "phi3" in fam.fused_loss_types()
    # and the row is the whole of it: a copy without fused_loss turns it back off
    monkeypatch.setitem(fam.FAMILIES, "phi3", dataclasses.replace(row, fused_loss=False))
    assert resolve(LossKind.auto) is LossKind.hf
