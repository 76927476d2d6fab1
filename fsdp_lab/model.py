"""Build a Hugging Face causal LM on the meta device and materialise its (sharded) weights.

Initial weights are made once, on rank 0, as a plain CPU model seeded with ``seed``, and reach
every rank's shards by broadcast. So the same seed gives bitwise the same initial model whatever
the world size or sharding strategy, and an unsharded reference run can start from it too.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from fsdp_lab.config import ConfigError, ModelArch, ModelConfig

log = logging.getLogger(__name__)


def build_hf_config(cfg: ModelConfig):
    """The transformers config of a preset, with every hyperparameter spelled out, or of a dir."""
    from transformers import AutoConfig, GPT2Config, LlamaConfig, Qwen2Config

    if cfg.name_or_path is not None:
        try:
            return AutoConfig.from_pretrained(Path(cfg.name_or_path).expanduser())
        except (OSError, ValueError, KeyError) as e:  # malformed JSON, unknown model_type
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"model.name_or_path={cfg.name_or_path}: its config.json cannot be read by "
                f"transformers ({first}); point it at a causal LM directory") from e
    common = dict(vocab_size=cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                  bos_token_id=0, eos_token_id=1, pad_token_id=None)
    match cfg.arch:
        case ModelArch.llama | ModelArch.qwen2:
            hf_cls = LlamaConfig if cfg.arch is ModelArch.llama else Qwen2Config
            return hf_cls(
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads,
                max_position_embeddings=cfg.max_position_embeddings,
                attention_dropout=0.0,
                **common,
            )
        case ModelArch.gpt2:
            # GPT-2 has no grouped-query attention or separate MLP width knob beyond n_inner.
            return GPT2Config(
                n_embd=cfg.hidden_size,
                n_inner=cfg.intermediate_size,
                n_layer=cfg.num_layers,
                n_head=cfg.num_heads,
                n_positions=cfg.max_position_embeddings,
                # Dropout off: runs are then identical across world sizes and strategies.
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                **common,
            )
        case _:
            raise ValueError(f"unknown model.arch {cfg.arch}")


def max_positions(hf_config) -> int | None:
    """The longest sequence the model takes (None where the config does not say)."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int):
            return value
    return None


def _from_config(hf_config) -> nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(hf_config)
    except ValueError as e:  # not a causal LM architecture
        raise ConfigError(
            f"model: {type(hf_config).__name__} is not a causal LM transformers can build "
            f"({str(e).splitlines()[0]}); use a decoder model directory") from e


def build_meta_model(hf_config) -> nn.Module:
    """The model's structure with no storage: sharding decides where each piece lives."""
    with torch.device("meta"):
        return _from_config(hf_config)


def build_full_model(hf_config, *, seed: int) -> nn.Module:
    """The whole model on CPU with seeded random init: rank 0's source and the test reference."""
    torch.manual_seed(seed)
    return _from_config(hf_config)


def _non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for mod_name, mod in model.named_modules():
        for buf_name in mod._non_persistent_buffers_set:
            buf = mod._buffers.get(buf_name)
            if buf is not None:
                out[f"{mod_name}.{buf_name}" if mod_name else buf_name] = buf
    return out


def materialize(model: nn.Module, *, device: torch.device, seed: int, hf_config) -> None:
    """Give the sharded meta model real storage on ``device`` and rank 0's initial weights.

    Non-persistent buffers (rotary ``inv_freq``) are not in a state dict, so they are copied from
    rank 0's CPU model too: after ``to_empty`` they hold garbage (loss silently off by ~4e-4).
    """
    rank = dist.get_rank()
    model.to_empty(device=device)
    full_sd: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    if rank == 0:
        full = build_full_model(hf_config, seed=seed)
        full_sd = full.state_dict()
        buffers = _non_persistent_buffers(full)
    set_model_state_dict(
        model, full_sd,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    payload = [buffers]
    dist.broadcast_object_list(payload, src=0)
    own = _non_persistent_buffers(model)
    assert own.keys() == payload[0].keys(), (own.keys(), payload[0].keys())
    with torch.no_grad():
        for name, value in payload[0].items():
            own[name].copy_(value.to(own[name].device))
    for name, param in model.named_parameters():
        assert not param.is_meta, f"{name} was not materialised"
