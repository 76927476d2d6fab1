"""torchao's low precision without processes: each refusal is one line naming the setting,
the layers each format converts (and why the others stay), and the per-shard NF4 quantiser
giving torchao's own bytes."""

from __future__ import annotations

import pytest
import torch

from fsdp_lab.config import ConfigError, HardwareKind, compose
from fsdp_lab.config import low_precision as rules
from fsdp_lab.config.rules import validate
from fsdp_lab.config.topology import Topology
from fsdp_lab.engine import low_precision, nf4
from fsdp_lab.engine import model as model_lib

pytest.importorskip("torchao")


def topo(world: int = 2, kind: HardwareKind = HardwareKind.cpu) -> Topology:
    return Topology(world_size=world, nproc_per_node=world, num_nodes=1, device=kind)


QLORA = ("finetune=qlora",)
FLOAT8 = ("precision=float8",)


@pytest.mark.parametrize(
    "overrides,kind,fragment",
    [
        ((*FLOAT8, "precision.param_dtype=fp16"), None, "precision.param_dtype=bf16"),
        ((*FLOAT8, "precision.param_dtype=fp32"), None, "not fp32"),
        (
            (*FLOAT8, "precision.float8_recipe=rowwise", "precision.float8_all_gather=true"),
            None,
            "needs precision.float8_recipe=tensorwise",
        ),
        (("precision=bf16", "precision.float8_all_gather=true"), None, "applies only to float8"),
        ((*FLOAT8, "parallel.tensor=2"), None, "not verified with parallel.tensor=2"),
        ((*FLOAT8, "offload=cpu"), None, "not verified with offload=cpu"),
        ((*FLOAT8, *QLORA), None, "not verified with float8 training"),
        ((*FLOAT8,), HardwareKind.tpu, "hardware=tpu cannot run precision.float8_recipe="),
        ((*QLORA, "parallel.tensor=2"), None, "finetune.quantize_base=nf4 is not verified"),
        ((*QLORA, "offload=cpu"), None, "offload=cpu"),
        ((*QLORA, "model.loading=rank0"), None, "each rank quantises its own shards"),
        (("finetune=full", "finetune.quantize_base=nf4"), None, "applies only to finetune=lora"),
    ],
)
def test_what_is_not_verified_is_refused_in_one_line(overrides, kind, fragment):
    with pytest.raises(ConfigError) as e:
        validate(compose(list(overrides)), topo(2, kind or HardwareKind.cpu))
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_without_torchao_both_name_the_extra(monkeypatch):
    monkeypatch.setattr(rules, "find_spec", lambda name: None)
    for overrides in (FLOAT8, QLORA):
        with pytest.raises(ConfigError, match=r"needs torchao.*fsdp_lab\[torchao\]"):
            validate(compose(list(overrides)), topo())


def meta_model(*overrides: str):
    cfg = compose(list(overrides))
    hf = model_lib.build_hf_config(cfg.model)
    return model_lib.model_on_meta(hf, cfg.model.task, cfg.finetune), cfg


def test_float8_converts_the_blocks_projections_only():
    # model.intermediate_size=72: the MLP's projections are not multiples of 16.
    model, cfg = meta_model(*FLOAT8, "model.intermediate_size=72")
    record = low_precision.apply(model, cfg)
    layers = record["layers"]
    assert record["converted"] == 8 and record["kinds"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert layers["model.layers.*.self_attn.q_proj"] == "float8 (tensorwise, float8 all-gather)"
    assert "not a multiple of 16" in layers["model.layers.*.mlp.up_proj"]
    assert layers["lm_head"] == "bf16: the output head: its logits feed the loss"
    from torchao.float8.float8_linear import Float8Linear

    assert isinstance(model.model.layers[1].self_attn.o_proj, Float8Linear)
    assert type(model.lm_head) is torch.nn.Linear


def test_nf4_quantises_the_frozen_projections_and_keeps_the_adapters():
    model, cfg = meta_model(*QLORA, "model.hidden_size=128", "model.intermediate_size=128")
    record = low_precision.apply(model, cfg)
    # k_proj and v_proj are 64x128 (two kv heads): 8192 values, not a whole block of scales.
    assert record["converted"] == 10
    assert (
        "not a whole number of NF4 scale blocks"
        in record["layers"]["model.layers.*.self_attn.k_proj"]
    )
    assert "a LoRA adapter" in record["layers"]["model.layers.*.self_attn.q_proj.lora_A.default"]
    q = model.model.layers[0].self_attn.q_proj
    assert nf4.is_nf4(q.base_layer.weight) and not q.base_layer.weight.requires_grad
    assert q.lora_A["default"].weight.requires_grad and not nf4.is_nf4(model.lm_head.weight)
    model, cfg = meta_model(*QLORA, "model.intermediate_size=128")  # no 16384-value weight
    with pytest.raises(ConfigError, match="converts no layer of this model"):
        low_precision.apply(model, cfg)


def test_the_per_shard_quantiser_gives_torchaos_bytes():
    _, to_nf4 = nf4.nf4_api()
    w = torch.randn(256, 128, generator=torch.Generator().manual_seed(0)) * 0.02
    want = to_nf4(w)
    data, scales, factor, lut = nf4.nf4_quantize(w, want.scaler_mean)
    assert torch.equal(data, want.quantized_data) and torch.equal(scales, want.quantized_scalers)
    assert torch.equal(factor, want.quantization_factor) and torch.equal(lut, want.nf4)
    # Each half quantised with the whole tensor's mean is the whole tensor's half.
    top = nf4.nf4_quantize(w[:128], want.scaler_mean)
    assert torch.equal(top[0], want.quantized_data[: want.quantized_data.numel() // 2])
    # The whole tensor's dequantised values (its mean summed in float64, as the shards' is: a
    # scale may round the other way than under torchao's float32 mean, by one int8 step).
    diff = nf4.round_trip(w) - want.get_original_weight()
    assert diff.abs().max() <= w.abs().max() / 64
    # 4 bits a parameter, an int8 scale per 64 and an fp32 factor per 16384.
    assert pytest.approx(4.127, abs=1e-3) == rules.NF4_BYTES_PER_PARAM * 8
