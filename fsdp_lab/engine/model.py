"""Build a Hugging Face model on the meta device and materialise its (sharded) weights.

``model_on_meta`` is the one recipe of a run's model (the architecture, then the finetune
group's freezes or adapters) that every rank, the launcher's checks, ``fsdp-lab plan`` and the
exporters build. ``materialize`` gives a sharded model its storage and initial weights, each
rank filling only its own shards (``engine.loading``), or on ``model.loading=rank0`` rank 0
building the whole model and broadcasting it; either way the same seed or checkpoint gives
bitwise the same model at any world size or strategy, and ``full_model`` the same model whole
in one process (the unsharded reference of the tests).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from fsdp_lab.config import (
    ConfigError,
    ExpertsImplementation,
    ModelConfig,
    ModelTask,
    families,
    first_line,
)
from fsdp_lab.config.model import DEFAULT_TASK, task_row
from fsdp_lab.engine import finetune, finite, loading, moe, nf4
from fsdp_lab.engine.activations import clean_name
from fsdp_lab.engine.finetune import frozen_fingerprint
from fsdp_lab.engine.hardware import process_group
from fsdp_lab.internals import torch_private, transformers_private

log = logging.getLogger(__name__)


def build_hf_config(cfg: ModelConfig):
    """The transformers config of a preset, with every hyperparameter spelled out, or of a
    directory or hub id; set up for training: no KV cache (HF fills one in every forward when
    use_cache is on; activation checkpointing then keeps it alive and each recomputation grows
    it, +43% peak measured on a 4-layer Llama). An export turns it back on."""
    hf_config = _hf_config(cfg)
    hf_config.use_cache = False
    if cfg.router_aux_loss_coef is not None and hasattr(hf_config, "router_aux_loss_coef"):
        hf_config.router_aux_loss_coef = cfg.router_aux_loss_coef  # the loss reads it here
    impl = cfg.experts_implementation
    moe.set_experts_implementation(
        hf_config, None if impl is ExpertsImplementation.auto else impl.value
    )
    # Master weights are fp32 whatever dtype the directory's config names (SmolLM2's says
    # bfloat16, and from_config builds in it: every shard and AdamW's state were then bf16);
    # the compute dtype is precision.param_dtype's. transformers 4 calls the field torch_dtype.
    setattr(hf_config, "dtype" if hasattr(hf_config, "dtype") else "torch_dtype", torch.float32)
    return hf_config


def _hf_config(cfg: ModelConfig):
    import transformers
    from transformers import AutoConfig

    if cfg.name_or_path is not None:
        local = Path(cfg.name_or_path).expanduser()
        try:
            return AutoConfig.from_pretrained(local if local.exists() else cfg.name_or_path)
        except (OSError, ValueError, KeyError) as e:  # malformed JSON, unknown model_type, offline
            first = first_line(e)
            if not local.exists():
                raise ConfigError(
                    f"model.name_or_path={cfg.name_or_path} is not a local directory and the "
                    f"Hugging Face hub did not give its config ({first}); offline, download "
                    "the model elsewhere and pass its directory"
                ) from e
            raise ConfigError(
                f"model.name_or_path={cfg.name_or_path}: its config.json cannot be read by "
                f"transformers ({first}); point it at a model directory"
            ) from e
    # The launcher resolves a None vocabulary from the tokenizer; unresolved, it is synthetic's.
    vocab_size = cfg.vocab_size or SYNTHETIC_VOCAB_SIZE
    common = dict(
        vocab_size=vocab_size,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=None,
    )
    row = families.preset_family(cfg.arch)
    hf_cls = getattr(transformers, row.hf_config)
    return hf_cls(**{**common, **row.preset_fields(cfg)})  # a row's own fields win


SYNTHETIC_VOCAB_SIZE = 256


def resolve_vocab_size(cfg: ModelConfig, tokenizer) -> ModelConfig:
    """A preset's vocabulary: as set, else the tokenizer's size (256 for synthetic data)."""
    if cfg.arch is None or cfg.vocab_size is not None:
        return cfg
    size = len(tokenizer) if tokenizer is not None else SYNTHETIC_VOCAB_SIZE
    return dataclasses.replace(cfg, vocab_size=size)


def check_task(hf_config, task: ModelTask) -> None:
    """An encoder (BERT, RoBERTa...) trained as a causal LM sees the tokens it predicts (its
    attention is bidirectional): the loss collapses and nothing says why. Refuse it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if (
        task_row(task).causal
        and hf_config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES
        and not getattr(hf_config, "is_decoder", False)
    ):
        raise ConfigError(
            f"model: {hf_config.model_type} is an encoder (bidirectional attention); train it with "
            "model.task=masked_lm"
        )


def align_special_tokens(hf_config, tokenizer) -> None:
    """A preset's config names bos/eos ids 0 and 1 (the byte-level tokenizer's); an export with
    another tokenizer must name that tokenizer's, or `generate` would not stop at its EOS."""
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if value is not None and hasattr(hf_config, name):
            setattr(hf_config, name, value)


def max_positions(hf_config) -> int | None:
    """The longest sequence the model takes (None where the config does not say)."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int):
            return value
    return None


def check_seq_len(hf_config, seq_len: int) -> None:
    positions = max_positions(hf_config)
    if positions is not None and seq_len > positions:
        raise ConfigError(
            f"trainer.seq_len={seq_len} exceeds the model's {positions} "
            "positions; lower trainer.seq_len"
        )


def _auto_class(task: ModelTask):
    import transformers

    return getattr(transformers, task_row(task).auto_class)


def _from_config(hf_config, task: ModelTask) -> nn.Module:
    try:
        return _auto_class(task).from_config(hf_config)
    except ValueError as e:  # an architecture without a head for this task
        raise ConfigError(
            f"model: {type(hf_config).__name__} has no {task.name} model in transformers "
            f"({str(e).splitlines()[0][:200]}); set model.task to what the model is"
        ) from e


def build_meta_model(
    hf_config, task: ModelTask = DEFAULT_TASK, mixin: type | None = None
) -> nn.Module:
    """The architecture's structure with no storage: sharding decides where each piece lives.
    ``mixin``: built as a subclass of the task's class for the config with ``mixin`` first
    (``extended``), as a fused loss's model is: an extension that exists from construction."""
    with torch.device("meta"):
        model = _from_config(hf_config, task)
        if mixin is None:
            return model
        return transformers_private.from_config(extended(mixin, type(model)), hf_config)


@functools.cache
def extended(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin``'s methods first, under ``cls``'s own name (what run.json's model
    class and an export's ``architectures`` read), as ``fully_shard`` names its FSDP<cls>."""
    return type(cls.__name__, (mixin, cls), {"__module__": mixin.__module__})


@dataclasses.dataclass(frozen=True)
class ModelCounts:
    """What a model is, counted on meta before sharding renames and splits it: what a run
    (``train.build.ModelFacts``) and a plan (``planning.plan_model.ModelShape``) both say of it."""

    model_class: str  # before fully_shard renames it FSDP<name>
    total_params: int  # a tied parameter once
    trainable_params: int  # total_params unless finetune freezes some or adds adapters
    experts: moe.ExpertCounts  # a mixture of experts' (zeros for a dense model)


def count_model(model: nn.Module) -> dict:
    """``ModelCounts``' fields of ``model`` (a record extending it takes them as keywords)."""

    trainable, total = finetune.counts(model)
    counts = ModelCounts(type(model).__name__, total, trainable, moe.expert_counts(model))
    return {f.name: getattr(counts, f.name) for f in dataclasses.fields(ModelCounts)}


def model_on_meta(
    hf_config, task: ModelTask, finetune_cfg=None, mixin: type | None = None
) -> nn.Module:
    """A run's model on meta: the architecture (``mixin``: as ``build_meta_model``), then the
    finetune group's freezes or LoRA adapters. Every rank, the launcher's checks, ``fsdp-lab
    plan`` and the exporters build it here, so all see the same parameters by name."""

    model = build_meta_model(hf_config, task, mixin)
    if finetune_cfg is not None:
        finetune.apply(model, finetune_cfg)
    return model


def full_model(
    hf_config,
    *,
    seed: int,
    task: ModelTask = DEFAULT_TASK,
    finetune_cfg=None,
    pretrained: str | None = None,
    mixin: type | None = None,
) -> nn.Module:
    """The whole model in one process, on the host, filled exactly as the sharded ranks fill
    their shards (``engine.loading``): the unsharded reference of a run, and the model an
    export writes into."""

    model = model_on_meta(hf_config, task, finetune_cfg, mixin)
    tied = tied_groups(model)
    model.to_empty(device=torch.device("cpu"))
    if tied:
        model.tie_weights()  # to_empty gives each module a new parameter: tie them again
        check_tied(model, tied)
    loading.fill(model, loading.InitialWeights(seed=seed, pretrained=pretrained))
    return model


def build_full_model(hf_config, *, seed: int, task: ModelTask = DEFAULT_TASK) -> nn.Module:
    """The whole model on CPU with the seeded random init a sharded run starts from."""
    return full_model(hf_config, seed=seed, task=task)


def load_pretrained(name_or_path: str, task: ModelTask) -> nn.Module:
    """The whole pretrained model on CPU in fp32, read by transformers: rank 0's source where
    a checkpoint cannot be read per rank (``materialize``'s fallback)."""
    local = Path(name_or_path).expanduser()
    source = str(local) if local.exists() else name_or_path
    try:
        return _auto_class(task).from_pretrained(source, dtype=torch.float32)
    except Exception as e:
        first = first_line(e)
        raise ConfigError(
            f"model.pretrained=true but no weights can be read from model.name_or_path="
            f"{name_or_path} ({first}); set model.pretrained=false for random init"
        ) from e


def _non_persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for mod_name, mod in model.named_modules():
        for buf_name in torch_private.non_persistent_buffers(mod):
            buf = mod.get_buffer(buf_name)
            if buf is not None:
                out[clean_name(f"{mod_name}.{buf_name}" if mod_name else buf_name)] = buf
    return out


def tied_groups(model: nn.Module, clean=clean_name) -> list[list[str]]:
    """Names that share one parameter (tied input/output embeddings), one list per parameter;
    ``clean`` strips the wrappers' parts from the names."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(clean(name))
    return [group for group in names.values() if len(group) > 1]


def check_tied(model: nn.Module, expected: list[list[str]]) -> None:
    """Tied stays tied: sharding (or loading) must not give a shared parameter two copies."""
    if tied_groups(model) != expected:
        raise RuntimeError(
            f"tied parameters {expected} were untied (now {tied_groups(model)}); "
            "they must be sharded in one FSDP unit"
        )


def materialize(
    model: nn.Module, *, device: torch.device, source, offload: bool = False
) -> str | None:
    """Give the sharded meta model real storage on ``device`` and its initial weights. With
    ``offload`` the parameter shards live on the host (CPUOffloadPolicy requires it) and only
    the buffers, which FSDP does not move, go to ``device``.

    ``source`` is a ``loading.InitialWeights``. Per rank (model.loading=per_rank), each rank
    fills its own shards, read from the safetensors files or drawn from the seed: no process
    holds the whole model. Else, or where a checkpoint cannot be read per rank (a hub id, a
    conversion that cannot be planned per tensor: with a warning), its ``whole()`` builds the
    model on rank 0 and it reaches every rank's shards tensor by tensor
    (``broadcast_from_rank0``). ``source`` may also be such a builder itself (tests).

    Returns, on every rank, the fingerprint of the frozen base (None: none is frozen): what a
    checkpoint that leaves the base out records and a resume compares.
    """

    model.to_empty(device=torch.device("cpu") if offload else device)
    if offload and device.type != "cpu":
        for module in model.modules():
            for key, buffer in module.named_buffers(recurse=False):
                setattr(module, key, buffer.to(device))
    if not isinstance(source, loading.InitialWeights):
        return _from_rank0(model, source)
    if source.per_rank:
        try:
            fingerprint = loading.fill(model, source)
            loading.check_filled(model)
            return fingerprint
        except loading.NotPerRank as e:
            if any(nf4.is_nf4(p) for p in model.parameters()):
                raise ConfigError(
                    f"finetune.quantize_base=nf4: each rank quantises its own shards as it "
                    f"reads them, and {source.pretrained} cannot be read per rank ({e}); "
                    "convert it with save_pretrained to a directory, or use finetune=lora"
                ) from e
            if dist.get_rank() == 0:
                log.warning(
                    "%s cannot be read per rank (%s): rank 0 reads the whole model and "
                    "broadcasts it, holding about %.1f GB of host memory",
                    source.pretrained,
                    e,
                    fp32_bytes(model) / 1e9,
                )
    if source.pretrained is not None and not source.from_files():  # a hub id's: of the whole
        return _from_rank0(model, source.whole)
    _from_rank0(model, source.whole, fingerprint=False)
    return loading.frozen_fingerprint(model, source)  # the same on either route


def fp32_bytes(model: nn.Module) -> int:
    """The whole model's bytes in fp32 (its global shapes, whatever it is sharded into)."""
    return sum(p.numel() * 4 for p in model.parameters())


def _from_rank0(model: nn.Module, source, *, fingerprint: bool = True) -> str | None:
    """``source()``'s whole model on rank 0 into every rank's shards, tensor by tensor; the
    fingerprint of its frozen parameters (``fingerprint``; else None)."""

    rank = dist.get_rank()
    full_sd: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    digest = None
    if rank == 0:
        full = source()
        full_sd = full.state_dict()
        buffers = _non_persistent_buffers(full)
        digest = frozen_fingerprint(full) if fingerprint else None
        del full  # the state dict keeps the tensors alive, not a second copy
    process_group.after_rank0("initial_weights")  # reading may outlast hardware.timeout_s
    set_model_state_dict(
        model,
        full_sd,
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
    )
    payload = [buffers, digest]
    dist.broadcast_object_list(payload, src=0)
    own = _non_persistent_buffers(model)
    assert own.keys() == payload[0].keys(), (own.keys(), payload[0].keys())
    with torch.no_grad():
        for name, value in payload[0].items():
            own[name].copy_(value.to(own[name].device))
    loading.check_filled(model)
    own = ((f"tensor {n}", p) for n, p in model.named_parameters())
    if (damaged := finite.agree(finite.first_in(own))) is not None:
        # every rank checked its shards of what rank 0 read
        raise ConfigError(f"the initial weights rank 0 read: {damaged}; {finite.DAMAGED}")
    return payload[1]
