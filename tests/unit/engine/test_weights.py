"""A pretrained directory's weight files, checked from their safetensors headers before any rank
starts: a model saved as several files reads back with every shape; each bad input is one line
naming the file and the fix."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fsdp_lab.config import ConfigError
from fsdp_lab.engine import conversion, weights
from fsdp_lab.engine.model import build_meta_model


def config(**overrides) -> LlamaConfig:
    sizes = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaConfig(**{**sizes, **overrides})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama saved as several safetensors files and an index, as large models are."""
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    LlamaForCausalLM(config()).save_pretrained(path, max_shard_size="100KB")
    return path


def copy_of(saved, tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    for f in saved.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    return out


def read_headers(name_or_path: str) -> dict[str, tuple[int, ...]] | None:
    """Every tensor's shape in a local directory's safetensors files, as the checks read them."""
    files = weights.local_files(name_or_path)
    return None if files is None else files.shapes()


def refused(path) -> str:
    with pytest.raises(ConfigError) as e:
        read_headers(str(path))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_model_in_several_files_reads_back_with_every_shape(saved):
    files = sorted(p.name for p in saved.glob("*.safetensors"))
    assert len(files) > 1 and (saved / weights.INDEX).is_file()
    shapes = read_headers(str(saved))
    model = build_meta_model(config())
    own = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes == {k: own[k] for k in shapes} and set(shapes) <= set(own)
    plan = conversion.plan_loading(model, weights.WeightFiles(str(saved)), str(saved))
    assert set(plan.sources) == set(own) and all(s.convert is None for s in plan.sources.values())
    assert read_headers("HuggingFaceTB/SmolLM2-135M") is None  # a hub id: not ours


def test_a_file_the_index_names_but_the_directory_lacks(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    gone = sorted(path.glob("*.safetensors"))[1]
    gone.unlink()
    message = refused(path)
    assert gone.name in message and "names 1 file(s) the directory lacks" in message


def test_a_file_cut_short_or_not_safetensors(saved, tmp_path):
    path = copy_of(saved, tmp_path)
    first = sorted(path.glob("*.safetensors"))[0]
    data = first.read_bytes()
    first.write_bytes(data[:-100])
    assert f"{first} is cut short: {len(data) - 100} bytes where its header" in refused(path)
    first.write_bytes(b"\x00" * 64)
    assert f"{first} is not a safetensors file" in refused(path)
    first.write_bytes(data[:5])
    assert "is not a safetensors file" in refused(path)
    (path / weights.INDEX).write_text("[]")
    assert "is not a safetensors index" in refused(path)


def test_pickled_weights_are_refused_and_an_empty_directory_says_what_it_lacks(tmp_path):
    assert "holds no weights" in refused(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not opened")
    message = refused(tmp_path)
    assert "pickled weights only" in message and "save_pretrained" in message


def planned(model, path) -> str:
    with pytest.raises(ConfigError) as e:
        conversion.plan_loading(model, weights.WeightFiles(str(path)), str(path))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_weights_of_another_size_than_config_json(saved):
    line = planned(build_meta_model(config(vocab_size=512)), saved)
    assert "2 tensor(s) disagree with its config.json" in line
    assert "model.embed_tokens.weight is [300, 64] in the file, [512, 64] in the model" in line


def test_the_index_and_headers_are_all_that_is_read(saved, tmp_path):
    """A 4 GB file would take as long as its header: the data is never read (here: the data
    of a whole file replaced by a hole of the same size reads the same)."""
    path = copy_of(saved, tmp_path)
    first = sorted(path.glob("*.safetensors"))[0]
    data = first.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    first.write_bytes(data[: 8 + length] + b"\x00" * (len(data) - 8 - length))
    assert read_headers(str(path)) == read_headers(str(saved))
    assert json.loads((path / weights.INDEX).read_text())["weight_map"]


def test_a_tensor_the_checkpoint_lacks_or_the_model_has_no_place_for(saved, tmp_path):
    """Names the first few keys either way; the fix is the matching config.json."""
    from safetensors.torch import load_file, save_file

    path = copy_of(saved, tmp_path)
    first = sorted(path.glob("*.safetensors"))[0]
    held = load_file(first)
    gone = sorted(held)[0]
    save_file({k: v for k, v in held.items() if k != gone}, first, metadata={"format": "pt"})
    index = json.loads((path / weights.INDEX).read_text())
    del index["weight_map"][gone]
    (path / weights.INDEX).write_text(json.dumps(index))
    line = planned(build_meta_model(config()), path)
    assert f"the checkpoint lacks 1 of the model's tensors ({gone})" in line
    save_file({**held, "model.extra.weight": torch.zeros(2)}, first, metadata={"format": "pt"})
    index["weight_map"].update({gone: first.name, "model.extra.weight": first.name})
    (path / weights.INDEX).write_text(json.dumps(index))
    line = planned(build_meta_model(config()), path)
    assert "1 tensor(s) of the checkpoint have no place in LlamaForCausalLM" in line
    assert "(model.extra.weight)" in line


def test_transformers_conversions_are_planned_from_the_headers(tmp_path):
    """A Mixtral as save_pretrained writes it (one tensor per expert) plans each fused experts
    tensor from its experts, in transformers' order, and back; GPT-2's own checkpoints (no
    'transformer.' prefix, attention masks stored) read too."""
    from transformers import GPT2Config, GPT2LMHeadModel, MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=12,
    )
    MixtralForCausalLM(cfg).save_pretrained(tmp_path / "mixtral")
    model = build_meta_model(cfg)
    plan = conversion.plan_loading(model, weights.WeightFiles(str(tmp_path / "mixtral")), "m")
    fused = plan.sources["model.layers.0.mlp.experts.gate_up_proj"]
    experts = [k.split(".experts.")[1] for k in fused.keys]
    assert experts == [f"{e}.w1.weight" for e in range(12)] + [f"{e}.w3.weight" for e in range(12)]
    assert plan.sources["model.layers.0.mlp.gate.weight"].keys == [
        "model.layers.0.block_sparse_moe.gate.weight"
    ]
    groups = conversion.plan_saving(model, model.state_dict())
    written = {k for _, save in groups for k in save(dict(model.state_dict()))}
    assert written == set(read_headers(str(tmp_path / "mixtral")))
    # GPT-2 as OpenAI published it: keys of the base model, masks the model does not hold.
    gpt2 = GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=64, n_positions=32)
    sd = {k.removeprefix("transformer."): v for k, v in GPT2LMHeadModel(gpt2).state_dict().items()}
    sd = {k: v.contiguous() for k, v in sd.items() if k != "lm_head.weight"}
    sd["h.0.attn.bias"] = torch.ones(1, 1, 32, 32)
    (tmp_path / "gpt2").mkdir()
    from safetensors.torch import save_file

    save_file(sd, tmp_path / "gpt2" / weights.SINGLE, metadata={"format": "pt"})
    model = build_meta_model(gpt2)
    plan = conversion.plan_loading(model, weights.WeightFiles(str(tmp_path / "gpt2")), "g")
    assert plan.sources["transformer.h.0.attn.c_attn.weight"].keys == ["h.0.attn.c_attn.weight"]


def rewrite_header(path, edit) -> None:
    """The file with its JSON header changed by ``edit(header)``, the data left as it is (its
    offsets count from the data's start, whatever the header's length)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def test_overlapping_ranges_or_a_length_unlike_dtype_times_shape_are_named(saved, tmp_path):
    """Both passed the header check before and stopped a rank with safetensors' own error."""
    path = copy_of(saved, tmp_path)
    first = sorted(path.glob("*.safetensors"))[0]
    data = first.read_bytes()
    keys = sorted(k for k in json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]]))
    keys = [k for k in keys if k != "__metadata__"]

    rewrite_header(first, lambda h: h[keys[0]].update(dtype="F16"))  # F32 bytes called F16
    message = refused(path)
    assert f"{first}: tensor {keys[0]} (F16 " in message and "has a byte range of" in message
    first.write_bytes(data)

    def shift(header):  # the tensor at offset 0 claims 4 bytes more: the next one overlaps it
        key = min(keys, key=lambda k: header[k]["data_offsets"][0])
        end = header[key]["data_offsets"][1] + 4
        header[key].update(dtype="F32", shape=[end // 4], data_offsets=[0, end])

    rewrite_header(first, shift)
    message = refused(path)
    assert "overlaps the tensor before it" in message and str(first) in message
    first.write_bytes(data)
    rewrite_header(first, lambda h: h[keys[0]].update(dtype="F8_E4M3FNUZ"))  # 1 byte, not 4
    assert f"tensor {keys[0]} (F8_E4M3FNUZ " in refused(path)
    rewrite_header(first, lambda h: h[keys[0]].update(dtype="Q4"))  # newer than the table
    assert read_headers(str(path))[keys[0]]  # left to safetensors
