"""Strategy -> mesh/reshard/dtype mappings, and a 64-rank hybrid mesh on a fake process group."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_lab.config import (
    Dtype,
    HardwareKind,
    ModelArch,
    ModelConfig,
    PrecisionConfig,
    PrefetchConfig,
    ShardingConfig,
    WrapConfig,
    strategies,
    topology,
)
from fsdp_lab.config import (
    ShardingStrategy as S,
)
from fsdp_lab.config.topology import Topology
from fsdp_lab.engine import fsdp, precision, wrap
from fsdp_lab.engine import mesh as engine_mesh
from fsdp_lab.engine.model import build_hf_config, build_meta_model


def topo(world: int, nodes: int = 1) -> Topology:
    return Topology(
        world_size=world, nproc_per_node=world // nodes, num_nodes=nodes, device=HardwareKind.cpu
    )


@pytest.mark.parametrize(
    "strategy,world,shape,reshard",
    [
        (S.full, 8, (8,), True),
        (S.grad_op, 8, (8,), False),
        (S.no_shard, 8, (8, 1), False),
        (S.hybrid, 8, (2, 4), True),
        (S.hybrid_zero2, 8, (2, 4), False),
    ],
)
def test_strategy_maps_to_mesh_and_reshard(strategy, world, shape, reshard):
    cfg = ShardingConfig(strategy=strategy)
    assert topology.mesh_shape(cfg, topo(world)) == shape
    assert strategies.reshard_after_forward(cfg) is reshard


def test_hybrid_across_nodes_replicates_over_nodes_and_override_wins():
    assert topology.mesh_shape(ShardingConfig(strategy=S.hybrid), topo(32, nodes=4)) == (4, 8)
    cfg = ShardingConfig(strategy=S.full, reshard_after_forward=4)
    assert strategies.reshard_after_forward(cfg) == 4


@pytest.mark.parametrize(
    "cfg,dtypes",
    [
        (PrecisionConfig(), (torch.float32, torch.float32, None)),
        (PrecisionConfig(param_dtype=Dtype.bf16), (torch.bfloat16, torch.float32, None)),
        (
            PrecisionConfig(
                param_dtype=Dtype.bf16, reduce_dtype=Dtype.bf16, output_dtype=Dtype.fp32
            ),
            (torch.bfloat16, torch.bfloat16, torch.float32),
        ),
    ],
)
def test_precision_maps_to_mp_policy(cfg, dtypes):
    policy = precision.build_mp_policy(cfg)
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == dtypes


def test_fp16_gets_a_sharded_grad_scaler():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    assert precision.build_grad_scaler(PrecisionConfig(), torch.device("cpu")) is None
    scaler = precision.build_grad_scaler(
        PrecisionConfig(param_dtype=Dtype.fp16, grad_scaler_enabled=True), torch.device("cpu")
    )
    assert isinstance(scaler, ShardedGradScaler)


@pytest.mark.parametrize(
    "strategy,placements,rows_div",
    [
        (S.hybrid, (Replicate(), Shard(0)), 8),
        (S.hybrid_zero2, (Replicate(), Shard(0)), 8),
        (S.no_shard, (Replicate(), Shard(0)), 1),
        (S.full, (Shard(0),), 64),
        (S.grad_op, (Shard(0),), 64),
    ],
)
def test_64_ranks_on_a_fake_process_group(fake_group, strategy, placements, rows_div):
    """8 nodes x 8 ranks: hybrid shards each param 8 ways inside a node and replicates across."""
    rank = 13
    fake_group(rank, 64)
    t = topo(64, nodes=8)
    cfg = ShardingConfig(strategy=strategy)
    mesh = engine_mesh.build_mesh(cfg, t, device_type="cpu")
    model = build_meta_model(
        build_hf_config(
            ModelConfig(
                arch=ModelArch.llama, vocab_size=1024, hidden_size=256, num_heads=8, num_kv_heads=4
            )
        )
    )
    units = wrap.select_units(model, WrapConfig())
    fsdp.apply_fsdp(
        model,
        units,
        mesh=mesh,
        reshard_after_forward=strategies.reshard_after_forward(cfg),
        mp_policy=precision.build_mp_policy(PrecisionConfig()),
        offload_policy=None,
        prefetch=PrefetchConfig(),
    )
    # Each decoder layer reshards after forward as its strategy says (ZeRO-3) or keeps its
    # parameters gathered until backward (ZeRO-2, no_shard); the last one, where backward
    # starts, is never resharded.
    reshards = [
        layer._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None
        for layer in model.model.layers
    ]
    assert set(reshards[:-1]) == {strategies.strategy_of(strategy).reshard_after_forward}
    assert reshards[-1] is False
    if len(placements) == 2:
        assert mesh.mesh_dim_names == ("replicate", "shard")
        assert mesh.shape == (64 // rows_div, rows_div)
        # Replicate-major layout: rank 13 is the 6th rank of node 1.
        assert mesh["shard"].get_local_rank() == 13 % rows_div
    params = dict(model.named_parameters())
    assert all(isinstance(p, DTensor) for p in params.values())
    for name, p in params.items():
        assert p.placements == placements, name
        # Every dim 0 here divides by 64, so every shard is exactly 1/rows_div of the rows.
        assert p.to_local().shape[0] == p.shape[0] // rows_div, name
        assert p.to_local().shape[1:] == p.shape[1:]
    emb = params["model.embed_tokens.weight"]
    assert emb.to_local().shape == (1024 // rows_div, 256)


@pytest.mark.parametrize(
    "prefetch,forward,backward",
    [
        (PrefetchConfig(), [[], [], [], []], [[], [], [], []]),  # FSDP2's implicit defaults
        (
            PrefetchConfig(forward=2, backward=2),
            [[1, 2], [2, 3], [3], []],
            [[], [0], [1, 0], [2, 1]],
        ),
        (PrefetchConfig(forward=1, backward=1), [[1], [2], [3], []], [[], [], [], []]),
    ],
)
def test_prefetch_and_the_last_unit_on_a_fake_group(fake_group, prefetch, forward, backward):
    """sharding.prefetch becomes each unit's explicit prefetch list (units ahead in forward,
    behind in backward, nearest first); the last unit keeps its parameters after forward."""
    fake_group(1, 4)
    mesh = engine_mesh.build_mesh(ShardingConfig(), topo(4), device_type="cpu")
    model = build_meta_model(
        build_hf_config(ModelConfig(arch=ModelArch.llama, vocab_size=256, num_layers=4))
    )
    units = wrap.select_units(model, WrapConfig())
    fsdp.apply_fsdp(
        model,
        units,
        mesh=mesh,
        reshard_after_forward=True,
        mp_policy=precision.build_mp_policy(PrecisionConfig()),
        offload_policy=None,
        prefetch=prefetch,
    )
    states = [u._get_fsdp_state() for u in units]

    def indices(targets):
        return [states.index(t) for t in targets]

    assert [indices(s._states_to_forward_prefetch) for s in states] == forward
    assert [indices(s._states_to_backward_prefetch) for s in states] == backward
    # Resharding after forward shows as a mesh to reshard onto; the last unit has none.
    resharded = [s._fsdp_param_group.post_forward_mesh_info is not None for s in states]
    assert resharded == [True, True, True, False]


def test_master_weights_are_fp32_whatever_the_configs_dtype(tmp_path):
    """Hub configs name their checkpoint's dtype (SmolLM2: bfloat16) and from_config builds in
    it; the shards, their gradients and AdamW's state must still be fp32 master weights."""
    from transformers import LlamaConfig

    from fsdp_lab.config import ModelConfig

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1)
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp_path)
    assert '"dtype": "bfloat16"' in (tmp_path / "config.json").read_text()
    hf = build_hf_config(ModelConfig(name_or_path=str(tmp_path)))
    assert {p.dtype for p in build_meta_model(hf).parameters()} == {torch.float32}


def test_an_engine_is_a_class_with_methods():
    # Go-to-definition on sharded.place_batch lands on code: each engine implements the
    # ShardedModel methods (engine.xla.XlaModel too; it needs torch_xla to import).
    import inspect

    from fsdp_lab.engine.sharded import ShardedModel

    assert inspect.isabstract(ShardedModel)
    assert not inspect.isabstract(fsdp.Fsdp2Model)
    model = torch.nn.Linear(2, 3)
    sharded = fsdp.Fsdp2Model(
        model=model,
        mesh_shape=[1],
        mesh_axes=["shard"],
        units_desc="root Linear",
        num_units=1,
        recomputed_units=[],
        device=torch.device("cpu"),
    )
    assert sharded.place_batch({"x": torch.ones(1)})["x"].device.type == "cpu"
    assert fsdp.local_numel(model) == 9
