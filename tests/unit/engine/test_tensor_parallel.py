"""Tensor parallelism's layout on a fake process group, its plan from the model, the clip over
two meshes, and the refusals; the numbers against the unsharded reference are in
tests/integration/test_parity.py."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_lab.config import (
    ConfigError,
    HardwareKind,
    ModelArch,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    PrefetchConfig,
    ShardingConfig,
    WrapConfig,
    strategies,
    topology,
)
from fsdp_lab.config import ShardingStrategy as S
from fsdp_lab.config.topology import Topology
from fsdp_lab.engine import fsdp, precision, tensor_parallel, wrap
from fsdp_lab.engine import mesh as engine_mesh
from fsdp_lab.engine.model import build_hf_config, build_meta_model


def topo(world: int) -> Topology:
    return Topology(world_size=world, nproc_per_node=world, num_nodes=1, device=HardwareKind.cpu)


@pytest.mark.parametrize(
    "strategy,shape,axes",
    [
        (S.full, (4, 2), ("shard", "tp")),
        (S.grad_op, (4, 2), ("shard", "tp")),
        (S.no_shard, (4, 1, 2), ("replicate", "shard", "tp")),
        (S.hybrid, (2, 2, 2), ("replicate", "shard", "tp")),
        (S.hybrid_zero2, (2, 2, 2), ("replicate", "shard", "tp")),
    ],
)
def test_the_tp_axis_is_innermost_and_strategies_keep_their_meaning(strategy, shape, axes):
    """8 ranks, tensor=2: the strategy lays its mesh over the 4 data-parallel ranks."""
    cfg = ShardingConfig(strategy=strategy)
    assert topology.mesh_shape(cfg, topo(8), tensor=2) == shape
    assert topology.mesh_axes(cfg, tensor=2) == axes


def _llama(**kw):
    return build_meta_model(
        build_hf_config(
            ModelConfig(
                arch=ModelArch.llama,
                vocab_size=1024,
                hidden_size=256,
                num_heads=8,
                num_kv_heads=4,
                intermediate_size=512,
                **kw,
            )
        )
    )


def test_hybrid_with_tp_on_8_fake_ranks(fake_group):
    """(replicate 2, shard 2, tp 2): q/k/v/gate/up split on their outputs over tp, o/down on
    their inputs, then sharded on dp; embeddings, norms and the head on dp only."""
    rank = 5  # replicate 1, shard 0, tp 1
    fake_group(rank, 8)
    cfg = ShardingConfig(strategy=S.hybrid)
    mesh = engine_mesh.build_mesh(cfg, topo(8), device_type="cpu", tensor=2)
    assert mesh.mesh_dim_names == ("replicate", "shard", "tp")
    assert mesh["tp"].get_local_rank() == 1 and mesh["shard"].get_local_rank() == 0
    model = _llama()
    tensor_parallel.apply(model, mesh["tp"], ParallelConfig(tensor=2))
    fsdp.apply_fsdp(
        model,
        wrap.select_units(model, WrapConfig()),
        mesh=engine_mesh.data_parallel_mesh(mesh, cfg, topo(8)),
        reshard_after_forward=strategies.reshard_after_forward(cfg),
        mp_policy=precision.build_mp_policy(PrecisionConfig()),
        offload_policy=None,
        prefetch=PrefetchConfig(),
    )
    params = dict(model.named_parameters())
    q = params["model.layers.0.self_attn.q_proj.weight"]  # [256, 256]: rows over tp, then dp
    assert q.device_mesh.mesh_dim_names == ("replicate", "shard", "tp")
    # FSDP's dp shard of a TP shard is strided (rows of each TP shard, interleaved): still dim 0.
    assert q.placements[0] == Replicate() and q.placements[2] == Shard(0)
    assert q.placements[1].dim == 0
    assert q.to_local().shape == (64, 256)
    o = params["model.layers.0.self_attn.o_proj.weight"]  # columns over tp, rows over dp
    assert o.placements[1].dim == 0 and o.placements[2] == Shard(1)
    assert o.to_local().shape == (128, 128)
    k = params["model.layers.0.self_attn.k_proj.weight"]  # 4 kv heads x 32: [128, 256]
    assert k.to_local().shape == (32, 256)
    emb = params["model.embed_tokens.weight"]
    assert emb.device_mesh.mesh_dim_names == ("replicate", "shard")
    assert emb.placements == (Replicate(), Shard(0)) and emb.to_local().shape == (512, 256)
    assert all(isinstance(p, DTensor) for p in params.values())


def test_sequence_parallel_splits_the_norms_rows_on_tp(fake_group):
    """With sequence parallelism the layer norms become TP-replicated DTensors (they run on
    the sequence rows each TP rank holds); without it they are left to FSDP alone."""
    fake_group(0, 4)
    mesh = engine_mesh.build_mesh(ShardingConfig(), topo(4), device_type="cpu", tensor=2)
    for sp in (False, True):
        model = _llama()
        tensor_parallel.apply(model, mesh["tp"], ParallelConfig(tensor=2, sequence_parallel=sp))
        norm = model.model.layers[0].input_layernorm.weight
        assert isinstance(norm, DTensor) is sp
        if sp:
            assert norm.placements == (Replicate(),)
        assert not isinstance(model.model.norm.weight, DTensor)  # gathered before it


def test_the_plan_comes_from_the_model_and_a_model_without_one_is_refused():
    plan = tensor_parallel.model_plan(_llama(), ParallelConfig(tensor=2))
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    gpt2 = build_meta_model(build_hf_config(ModelConfig(arch=ModelArch.gpt2, vocab_size=256)))
    with pytest.raises(
        ConfigError, match=r"GPT2LMHeadModel has no tensor-parallel plan.*parallel\.plan"
    ):
        tensor_parallel.check(gpt2, ParallelConfig(tensor=2))
    own = ParallelConfig(tensor=2, plan={"h.*.mlp.c_fc": "colwise"})
    with pytest.raises(ConfigError, match=r"c_fc is a Conv1D; only nn.Linear"):
        tensor_parallel.check(gpt2, own)


@pytest.mark.parametrize(
    "parallel,fragment",
    [
        (ParallelConfig(tensor=16), "does not divide the model's num_attention_heads=8"),
        (ParallelConfig(tensor=2, plan={"layers.*.attn.q": "colwise"}), "matches no module"),
        (ParallelConfig(tensor=2, plan={"layers.*.mlp.up_proj": "diagonal"}), "style 'diagonal'"),
    ],
)
def test_a_plan_the_model_cannot_take_is_one_line(parallel, fragment):
    with pytest.raises(ConfigError, match=fragment) as e:
        tensor_parallel.check(_llama(), parallel)
    assert "\n" not in str(e.value)


def test_clipping_without_meshes_is_the_stock_clip():
    """Plain tensors (no mesh) take torch's own path (the grouped one runs in the parity
    runs: tests/integration/test_parity.py)."""
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(4))]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    total = tensor_parallel.clip_grad_norm(params, 1.0)
    assert torch.isclose(total, torch.tensor(2.0 * 7**0.5))
    assert torch.isclose(torch.cat([p.grad for p in params]).norm(), torch.tensor(1.0), atol=1e-5)
