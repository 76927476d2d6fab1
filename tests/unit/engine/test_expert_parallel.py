"""Expert parallelism's layout on large meshes, in one process (a fake process group): which
rank holds which experts, their shapes and placements, and what the model check refuses."""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import LlamaConfig, Qwen3MoeConfig

from fsdp_lab.config import ConfigError, HardwareKind, PrefetchConfig, ShardingConfig
from fsdp_lab.config.topology import Topology
from fsdp_lab.engine import expert_parallel, fsdp
from fsdp_lab.engine import mesh as engine_mesh
from fsdp_lab.engine.model import build_meta_model

E, H, WIDTH = 8, 64, 32  # experts, hidden size, expert width


def tiny_moe(num_experts: int = E) -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=H,
        intermediate_size=128,
        moe_intermediate_size=WIDTH,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=num_experts,
        num_experts_per_tok=2,
    )


def shard_with_ep(world: int, ep: int):
    """The tiny MoE on meta, experts split ``ep`` ways and every unit sharded, as this rank."""
    topo = Topology(world, world, 1, HardwareKind.cpu)
    sharding = ShardingConfig()
    mesh = engine_mesh.build_mesh(sharding, topo, device_type="cpu")
    expert_mesh = engine_mesh.build_expert_mesh(sharding, topo, mesh, expert=ep)
    model = build_meta_model(tiny_moe())
    modules = expert_parallel.apply(model, expert_mesh)
    fsdp.apply_fsdp(
        model,
        list(model.model.layers),
        mesh=mesh,
        reshard_after_forward=True,
        mp_policy=MixedPrecisionPolicy(),
        offload_policy=None,
        prefetch=PrefetchConfig(),
        experts=fsdp.ExpertUnits(modules, expert_mesh["efsdp"], world),
    )
    return model, expert_mesh


@pytest.mark.parametrize(
    "world,ep,rank,fsdp_dim",
    [
        (16, 4, 9, 1),  # 2 experts a rank over 4 efsdp ranks: dim 1, no empty shard
        (16, 8, 15, 1),  # 1 expert a rank, 2 efsdp ranks
        (16, 2, 6, 1),  # 4 experts a rank, 8 efsdp ranks
        (4, 2, 3, 0),  # 4 experts a rank over 2 efsdp ranks: whole experts (dim 0)
        (8, 8, 5, None),  # EP over the whole shard axis: efsdp 1
    ],
)
def test_which_rank_holds_which_experts(fake_group, world, ep, rank, fsdp_dim):
    """Each case has a mesh of its own: torch caches meshes that compare equal, and two ranks'
    equal meshes differ only in the rank (a one-process fake group's artifact)."""
    fake_group(rank, world)
    model, expert_mesh = shard_with_ep(world, ep)
    # ep innermost: an all-to-all group is contiguous ranks, an efsdp group strided by ep
    first = rank - rank % ep
    assert expert_mesh["ep"].mesh.tolist() == list(range(first, first + ep))
    assert expert_mesh["efsdp"].mesh.tolist() == list(range(rank % ep, world, ep))
    local = E // ep
    experts = model.model.layers[1].mlp.experts
    assert experts.num_experts == local
    efsdp = world // ep
    for name, global_shape in (("gate_up_proj", (E, 2 * WIDTH, H)), ("down_proj", (E, H, WIDTH))):
        p = getattr(experts, name)
        assert tuple(p.shape) == global_shape
        assert p.device_mesh.mesh_dim_names == ("efsdp", "ep")
        assert p.placements[1] == Shard(0)
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        assert tuple(p.to_local().shape) == tuple(shape)
        # this rank's experts: the ep coordinate's slice of E, cut further by FSDP
        ep_rank, efsdp_rank = rank % ep, rank // ep
        if fsdp_dim == 1:
            assert p.placements[0] == Shard(1)
            rows = global_shape[1] // efsdp
            assert tuple(shape) == (local, rows, global_shape[2])
            assert tuple(offset) == (ep_rank * local, efsdp_rank * rows, 0)
        elif fsdp_dim == 0:
            per = local // efsdp
            assert tuple(shape) == (per, *global_shape[1:])
            assert tuple(offset) == (ep_rank * local + efsdp_rank * per, 0, 0)
        else:
            assert tuple(shape) == (local, *global_shape[1:])
            assert tuple(offset) == (ep_rank * local, 0, 0)
    # the router and the dense layers stay on the whole data-parallel mesh
    gate = model.model.layers[1].mlp.gate.weight
    assert gate.device_mesh.mesh_dim_names == ("shard",) and gate.placements == (Shard(0),)


def test_dense_models_and_uneven_degrees_are_refused():
    llama = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4
    )
    with pytest.raises(ConfigError, match="has no mixture-of-experts layers"):
        expert_parallel.check(build_meta_model(llama), 2)
    with pytest.raises(ConfigError, match=r"parallel.expert=3 does not divide the model's 8"):
        expert_parallel.check(build_meta_model(tiny_moe()), 3)
    expert_parallel.check(build_meta_model(tiny_moe()), 4)
    assert expert_parallel.num_experts(build_meta_model(tiny_moe(6))) == 6
    assert expert_parallel.num_experts(build_meta_model(llama)) == 0
