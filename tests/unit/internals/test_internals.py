"""The door to torch's and transformers' private names: every name is where it is looked for
on the installed versions, a moved one fails in one line naming it, and the door's own code
does what the private code it replaced did."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from fsdp_lab.internals import torch_private, transformers_private


def test_every_private_name_is_where_it_is_looked_for():
    # A torch or transformers upgrade that moves one fails here, naming it and what it awaits.
    assert torch_private.check() == []
    assert transformers_private.check() == []


def test_a_moved_name_is_one_line_naming_it_and_the_fix():
    moved = torch_private.Private("torch.distributed", "_no_such_name", "a public one")
    with pytest.raises(RuntimeError) as e:
        moved.get()
    line = str(e.value)
    assert "\n" not in line and "torch.distributed._no_such_name" in line
    assert "a public one" in line and "pin the torch" in line
    gone = transformers_private.Private("transformers.no_such_module", "_x", "a public x")
    with pytest.raises(RuntimeError, match=r"no transformers\.no_such_module\._x.*a public x"):
        gone.get()


@pytest.mark.parametrize(
    "path", [("a",), ("a", "b"), ("a", 2, "c"), ("a", 0), ("x", "y", 1, 0), ("a", "c", "d")]
)
def test_set_element_builds_what_dcp_builds(path):
    # DCP's own object-path setter (private: compared here, never used by fsdp_lab)
    from torch.distributed.checkpoint._traverse import set_element

    ours, theirs = {"a": {"b": 1}}, {"a": {"b": 1}}
    if path[:2] == ("a", 2) or path == ("a", 0):
        ours, theirs = {}, {}
    torch_private.set_element(ours, path, 7)
    set_element(theirs, path, 7)
    assert ours == theirs


def test_lent_tensors_are_the_module_s_own_again_after_the_block_even_on_error():
    m = nn.Linear(2, 3)
    m.register_buffer("scale", torch.ones(3))
    weight, scale = m.weight, m.scale
    scratch = [(m, "weight", torch.zeros(3, 2)), (m, "scale", torch.zeros(3))]
    with pytest.raises(ValueError), torch_private.lent(scratch):
        assert torch.equal(m(torch.ones(1, 2)) - m.bias, torch.zeros(1, 3))
        assert m.scale.sum() == 0
        raise ValueError
    assert m.weight is weight and m.scale is scale
    assert isinstance(m.weight, nn.Parameter)


def test_own_tensors_are_what_the_state_dict_holds_of_a_module():
    m = nn.Linear(2, 3)
    m.register_buffer("kept", torch.ones(1))
    m.register_buffer("recomputed", torch.ones(1), persistent=False)
    names = [n for n, _ in torch_private.own_tensors(m)]
    assert names == list(m.state_dict()) == ["weight", "bias", "kept"]
    assert torch_private.non_persistent_buffers(m) == {"recomputed"}
    everything = [n for n, _ in torch_private.own_tensors(m, persistent=False)]
    assert everything == ["weight", "bias", "kept", "recomputed"]


def test_a_storage_key_is_shared_by_views_on_meta():
    a = torch.empty(4, device="meta")
    assert torch_private.storage_key(a[1:])[0] == torch_private.storage_key(a)[0]
    assert (
        torch_private.storage_key(torch.empty(4, device="meta"))[0]
        != (torch_private.storage_key(a)[0])
    )


def test_a_config_copy_attends_its_own_way():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2)
    transformers_private.set_implementation(config, "attn", "sdpa")
    other = transformers_private.with_implementation(config, "attn", "eager")
    assert transformers_private.implementation(other, "attn") == "eager"
    assert transformers_private.implementation(config, "attn") == "sdpa"
    assert transformers_private.implementation(copy.copy(object()), "attn") is None
