"""eval.keep_gathered: inside the block each FSDP unit keeps its weights unsharded after its
forward; after it every unit is sharded again with the setting a plain forward leaves, also when
the block holds the model's very first forward (FSDP2 decides the root's setting then)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_llama
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

from fsdp_lab.engine.fsdp import Fsdp2Model


@pytest.fixture
def gloo_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def sharded_llama():
    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return Fsdp2Model(
        model=model,
        mesh_shape=[1],
        mesh_axes=["shard"],
        units_desc="",
        num_units=3,
        recomputed_units=[],
        device=torch.device("cpu"),
    )


def settings(model) -> list:
    """Each unit's resharding setting and its weights' state."""
    out = []
    for m in model.modules():
        if hasattr(m, "_get_fsdp_state"):
            state = m._get_fsdp_state()
            group = state._fsdp_param_group
            out.append(
                (
                    state._auto_reshard_after_forward,
                    group.post_forward_mesh_info is not None,
                    group.fsdp_params[0].sharded_state,
                )
            )
    return out


def test_weights_stay_gathered_in_the_block_and_settings_come_back(gloo_group):
    kept, plain = sharded_llama(), sharded_llama()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        plain.model(input_ids=ids)
        with kept.weights_kept_gathered():  # the model's first forward is inside
            out = kept.model(input_ids=ids)
            inside = settings(kept.model)
    assert all(state is ShardedState.UNSHARDED for *_, state in inside)
    # Each unit's setting as a plain forward leaves it (the root's, decided at the first
    # forward, too), and every unit sharded again (the root as well, which a plain forward
    # leaves gathered for a backward that evaluation never runs).
    assert [s[:2] for s in settings(kept.model)] == [s[:2] for s in settings(plain.model)]
    assert all(state is ShardedState.SHARDED for *_, state in settings(kept.model))
    with torch.no_grad():
        assert torch.equal(out.logits, plain.model(input_ids=ids).logits)


def test_disabled_is_a_plain_forward(gloo_group):
    kept = sharded_llama()
    with torch.no_grad(), kept.weights_kept_gathered(enabled=False):
        kept.model(input_ids=torch.tensor([[1, 2, 3]]))
        layer_states = [state for *_, state in settings(kept.model)[1:]]  # the root's first
    assert all(state is ShardedState.SHARDED for state in layer_states)
