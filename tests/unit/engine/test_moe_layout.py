"""Mixture-of-experts presets on meta, their FSDP units, the experts' shards on a fake process
group (even, uneven, more ranks than experts), active-parameter FLOPs and the refusals."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from fsdp_lab.config import (
    ConfigError,
    ExpertsImplementation,
    HardwareKind,
    ModelArch,
    ModelConfig,
    PrecisionConfig,
    PrefetchConfig,
    ShardingConfig,
    WrapConfig,
)
from fsdp_lab.config.families import check_preset
from fsdp_lab.config.load import compose
from fsdp_lab.config.rules import refuse_for_hardware
from fsdp_lab.config.topology import Topology
from fsdp_lab.engine import fsdp, moe, precision, wrap
from fsdp_lab.engine import mesh as engine_mesh
from fsdp_lab.engine.hardware import devices
from fsdp_lab.engine.model import build_hf_config, build_meta_model
from fsdp_lab.observe.metrics import flops_per_token

MOE = [ModelArch.qwen3_moe, ModelArch.mixtral, ModelArch.olmoe]
LAYER = {
    ModelArch.qwen3_moe: "Qwen3MoeDecoderLayer",
    ModelArch.mixtral: "MixtralDecoderLayer",
    ModelArch.olmoe: "OlmoeDecoderLayer",
}


def preset(arch: ModelArch, **kw) -> ModelConfig:
    """The conf/model/*_tiny.yaml presets' sizes (test_config composes the files themselves)."""
    sizes = dict(num_experts=8, experts_per_token=2, expert_intermediate_size=64, vocab_size=256)
    return ModelConfig(arch=arch, **{**sizes, **kw})


@pytest.mark.parametrize("arch", MOE, ids=lambda a: a.name)
def test_presets_build_on_meta_with_decoder_layer_units(arch):
    hf_config = build_hf_config(preset(arch))
    model = build_meta_model(hf_config)
    blocks = moe.moe_blocks(model)
    assert len(blocks) == 2  # every layer sparse
    experts = blocks[0].experts
    assert experts.gate_up_proj.shape == (8, 2 * 64, 64)
    assert experts.down_proj.shape == (8, 64, 64)
    assert blocks[0].gate.top_k == 2 and blocks[0].gate.weight.shape == (8, 64)
    assert getattr(hf_config, "router_jitter_noise", 0.0) == 0.0
    # FSDP units: the decoder layers (_no_split_modules), which hold router and experts.
    units = wrap.select_units(model, WrapConfig())
    assert [type(u).__name__ for u in units] == [LAYER[arch]] * 2
    assert all(any(b is m for m in u.modules()) for u, b in zip(units, blocks, strict=True))


def test_model_settings_reach_the_transformers_config():
    hf = build_hf_config(
        preset(
            ModelArch.qwen3_moe,
            router_aux_loss_coef=0.25,
            experts_implementation=ExpertsImplementation.eager,
        )
    )
    assert hf.router_aux_loss_coef == 0.25 and hf._experts_implementation == "eager"
    # null: the model's own default; auto: transformers' own choice
    assert build_hf_config(preset(ModelArch.olmoe)).router_aux_loss_coef == 0.01
    assert build_hf_config(preset(ModelArch.mixtral))._experts_implementation is None


def test_flops_count_the_active_experts():
    """6N counts the router and top_k of E experts; the rest of the model as before."""
    cfg = preset(ModelArch.qwen3_moe)
    hf = build_hf_config(cfg)
    model = build_meta_model(hf)
    counts = moe.expert_counts(model)
    # per layer: gate_up 8 x 128 x 64 + down 8 x 64 x 64
    assert counts.expert_params == 2 * 8 * (128 * 64 + 64 * 64)
    assert counts.inactive_params == counts.expert_params * 6 // 8
    embed = model.get_input_embeddings().weight.numel()
    total = sum(p.numel() for p in model.parameters())
    attention = 12 * 2 * 4 * 16 * 32
    want = 6 * (total - embed - counts.inactive_params) + attention
    assert flops_per_token(model, hf, 32) == want
    dense = build_meta_model(build_hf_config(ModelConfig(arch=ModelArch.llama, vocab_size=256)))
    assert moe.expert_counts(dense).inactive_params == 0


@pytest.mark.parametrize("world", [2, 3, 16])
def test_experts_shard_on_dim_0_padding_where_uneven(fake_group, world):
    """8 experts over 2 ranks: 4 each; over 3: 3, 3, 2 (dim 0 padded to 9); over 16: one on
    ranks 0-7, none on 8-15. FSDP2 pads uneven Shard(0); an empty shard is a (0, ...) tensor
    that still takes part in every all-gather and reduce-scatter."""
    per_rank = math.ceil(8 / world)
    for rank in sorted({0, world - 1, min(world - 1, 8 // per_rank)}):
        fake_group(rank, world)
        model = build_meta_model(build_hf_config(preset(ModelArch.qwen3_moe)))
        fsdp.apply_fsdp(
            model,
            wrap.select_units(model, WrapConfig()),
            mesh=engine_mesh.build_mesh(
                ShardingConfig(),
                Topology(
                    world_size=world, nproc_per_node=world, num_nodes=1, device=HardwareKind.cpu
                ),
                device_type="cpu",
            ),
            reshard_after_forward=True,
            mp_policy=precision.build_mp_policy(PrecisionConfig()),
            offload_policy=None,
            prefetch=PrefetchConfig(),
        )
        experts = moe.moe_blocks(model)[0].experts
        for param, rest in ((experts.gate_up_proj, (128, 64)), (experts.down_proj, (64, 64))):
            assert isinstance(param, DTensor) and param.placements == (Shard(0),)
            assert param.shape == (8, *rest)  # the global tensor is every expert
            held = max(0, min(per_rank, 8 - rank * per_rank))
            assert param.to_local().shape == (held, *rest), (world, rank)
        torch.distributed.destroy_process_group()


def test_refusals_are_one_line():
    with pytest.raises(ConfigError, match=r"model\.num_experts=8 but model\.arch=llama is dense"):
        check_preset(ModelConfig(arch=ModelArch.llama, num_experts=8))
    with pytest.raises(ConfigError, match=r"model\.num_experts=0 must be > 0"):
        check_preset(ModelConfig(arch=ModelArch.mixtral))
    with pytest.raises(ConfigError, match="experts_per_token=9"):
        check_preset(preset(ModelArch.olmoe, experts_per_token=9))
    with pytest.raises(ConfigError, match="router_aux_loss_coef=-1"):
        check_preset(preset(ModelArch.olmoe, router_aux_loss_coef=-1.0))
    tpu = compose(["hardware=tpu", "model=olmoe_tiny", "model.experts_implementation=grouped_mm"])
    with pytest.raises(ConfigError, match=r"cannot run model\.experts_implementation=grouped_mm"):
        refuse_for_hardware(tpu, HardwareKind.tpu)
    refuse_for_hardware(tpu, HardwareKind.cpu)
    devices.check_experts_implementation(ExpertsImplementation.grouped_mm)  # torch 2.13 has it
