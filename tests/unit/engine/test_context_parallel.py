"""Context parallelism's layout on a fake process group (any world size, one process), and its
attention's contract with transformers: registered through AttentionInterface, refusing a
forward that does not say it is split, switched to SDPA for whole sequences. Its numbers are
checked on real gloo ranks (tests/integration/test_context_parallel_runs.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from fsdp_lab.config import ConfigError, HardwareKind, ShardingConfig, ShardingStrategy
from fsdp_lab.config.topology import Topology
from fsdp_lab.engine import context_parallel
from fsdp_lab.engine import mesh as engine_mesh

S = ShardingStrategy


def topo(world: int) -> Topology:
    return Topology(world_size=world, nproc_per_node=world, num_nodes=1, device=HardwareKind.cpu)


@pytest.mark.parametrize(
    "strategy,tensor,fsdp_shape,shard_group,cp_group",
    [
        # rank 5 of 8: (replicate 1, shard 0, context 0, tp 1) with tp 2; FSDP shards over
        # shard x context: ranks 5 and 7 (its replica), replicates across 1 and 3
        (S.hybrid, 2, (2, 2), [5, 7], [5, 7]),
        # no TP: full shards every rank; the CP group is 4 and 5
        (S.full, 1, (8,), list(range(8)), [4, 5]),
        # no_shard: every element on every rank, replicated over data x context
        (S.no_shard, 1, (8, 1), [5], [4, 5]),
    ],
)
def test_fsdp_shards_over_shard_x_context_on_8_fake_ranks(
    fake_group, strategy, tensor, fsdp_shape, shard_group, cp_group
):
    fake_group(5, 8)
    cfg = ShardingConfig(strategy=strategy)
    mesh = engine_mesh.build_mesh(cfg, topo(8), device_type="cpu", tensor=tensor, context=2)
    dp_mesh = engine_mesh.data_parallel_mesh(mesh, cfg, topo(8))
    assert tuple(dp_mesh.shape) == fsdp_shape
    shard_axis = dp_mesh.ndim - 1
    row = dp_mesh.mesh.view(-1, dp_mesh.shape[shard_axis])
    (mine,) = [r.tolist() for r in row if 5 in r.tolist()]
    assert mine == shard_group
    assert mesh["context"].mesh.tolist() == cp_group


def test_the_attention_is_transformers_own_extension_and_refuses_an_unsplit_forward(fake_group):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AttentionInterface

    fake_group(0, 2)
    model = tiny_llama()
    context_parallel.apply(model, init_device_mesh("cpu", (2,), mesh_dim_names=("context",)))
    name = model.config._attn_implementation
    assert name.startswith(context_parallel.ATTENTION_PREFIX) and name in AttentionInterface()
    assert all(layer.self_attn.config._attn_implementation == name for layer in model.model.layers)
    ids = torch.arange(16).reshape(1, 16)
    with pytest.raises(RuntimeError, match="without context_split"):
        model(input_ids=ids)
    with context_parallel.whole_sequences(model):  # generation, scoring: SDPA, every rank
        assert model.config._attn_implementation == "sdpa"
        whole = model(input_ids=ids).logits
    assert model.config._attn_implementation == name
    reference = tiny_llama()  # the same seed: the same weights
    assert torch.equal(whole, reference(input_ids=ids).logits)


@pytest.mark.parametrize("model_type", ["gpt2", "bert", "gemma2"])
def test_a_model_whose_attention_cp_does_not_reproduce_is_named(model_type):
    config = type("Config", (), {"model_type": model_type})()
    with pytest.raises(ConfigError, match=f"model_type={model_type} .* set parallel.context=1"):
        context_parallel.check(config, 2)
    context_parallel.check(config, 1)  # no CP: nothing to check
    context_parallel.check(type("Config", (), {"model_type": "qwen2"})(), 4)


def test_every_layer_finds_the_masks_the_first_one_built():
    """FSDP2 maps each unit's inputs, rebuilding dataclasses and dicts: the forward's masks
    must reach every layer as the same object, or each layer builds (and SDPA keeps) its own."""
    from torch.distributed.utils import _apply_to_tensors

    documents = torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2]])
    split = context_parallel.ContextSplit(documents)
    like = torch.zeros(1, dtype=torch.float32)
    first = split.mask(1, 2, keys=(0, 4), window=None, like=like)
    mapped = _apply_to_tensors(lambda t: t.clone(), split)  # as a unit's pre-forward hook does
    assert mapped is not split
    assert mapped.mask(1, 2, keys=(0, 4), window=None, like=like) is first
    # queries 2, 3 (document 1) see keys 2..3 of their own document, causally
    assert (first[0, 0] == 0).tolist() == [[False, False, True, False], [False, False, True, True]]
