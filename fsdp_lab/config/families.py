"""The model families fsdp_lab knows, one row per Hugging Face ``model_type``: the only place
that says what a family is.

A row says whether fsdp_lab has a preset of it (``model.arch``) and how the preset's sizes
become a transformers config; whether the fused losses may take its head; which layer model
``fsdp-lab plan`` counts its activations with, and its q/k normalisation; whether it routes
tokens to experts; whether transformers converts its checkpoint's keys at load; and which of
its linear layers a low-precision path (float8 training, a quantised frozen base) may convert;
whether context parallelism's attention reproduces its own (CP); and whether pipeline
parallelism cuts it into stages (PP). The engine (``engine.model``), the rules, the losses
(``train.loss``) and the plan (``planning.activation_memory``) read this table (columns: fused
loss, activation layer model, q/k norm, experts, converts keys, CP, PP); nothing else names a
family. A model type without a row still trains (loss=hf, the llama layer model, a warning).

| model_type | preset    | fused | layers | q/k norm | experts | converts | CP  | PP  |
| llama      | llama     | yes   | llama  |          |         |          | yes | yes |
| mistral    |           | yes   | llama  |          |         |          | yes | yes |
| qwen2      | qwen2     | yes   | llama  |          |         |          | yes | yes |
| qwen3      |           | yes   | llama  | head     |         |          | yes | yes |
| gpt2       | gpt2      | yes   | gpt2   |          |         |          |     |     |
| gpt_neox   |           |       | neox   |          |         |          |     |     |
| bert       | bert      |       | bert   |          |         |          |     |     |
| roberta    |           |       | bert   |          |         |          |     |     |
| qwen3_moe  | qwen3_moe | yes   | llama  | head     | yes     | yes      | yes |     |
| mixtral    | mixtral   | yes   | llama  |          | yes     | yes      | yes |     |
| olmoe      | olmoe     | yes   | llama  | full     | yes     | yes      | yes |     |

Imports no torch and no transformers: a preset's config class is named, and built by the
engine.
"""

from __future__ import annotations

import enum
import functools
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

from fsdp_lab.config.errors import ConfigError, positive
from fsdp_lab.config.model import DEFAULT_TASK, ModelArch, ModelConfig, ModelTask


class Activations(enum.Enum):
    """The layer model ``planning.activation_memory`` counts a family's saved activations with
    (read off each family's eager code)."""

    llama = "llama"  # pre-norm, rotary, gated MLP (Llama, Mistral, Qwen, the MoE decoders)
    gpt2 = "gpt2"  # learned positions, GELU MLP, dropouts
    neox = "neox"  # GPT-NeoX: parallel residual, partial rotary
    bert = "bert"  # post-norm encoder


class QkNorm(enum.Enum):
    none = ""
    head = "head"  # an RMSNorm over each head's q and k (Qwen3, Qwen3-MoE)
    full = "full"  # an RMSNorm over the whole q and k projections (OLMoE)


LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class Family:
    model_type: str
    activations: Activations
    preset: ModelArch | None = None
    """The ``model.arch`` preset of this family (its ``conf/model/*.yaml``), if there is one."""
    hf_config: str = ""
    """The preset's transformers config class (a name in ``transformers``)."""
    preset_fields: Callable[[ModelConfig], dict] | None = None
    """model.* sizes -> the preset config's own fields (beside the vocabulary, ties and
    special tokens every preset shares, which they may override); dropout and router noise
    off, so runs are the same across world sizes and strategies."""
    task: ModelTask = DEFAULT_TASK
    """What its preset trains (encoders: masked_lm)."""
    rotary_gqa: bool = True
    """Rotary positions and grouped-query attention (num_kv_heads; head_dim must be even)."""
    fused_loss: bool = False
    """hidden = base(...); logits = lm_head(hidden), a bias-free Linear; loss =
    ForCausalLMLoss: the fused losses (chunked, liger, cce) may take its head. Gemma 2/3
    (soft-capping), Cohere (logit_scale), Granite (logits_scaling) may not."""
    qk_norm: QkNorm = QkNorm.none
    experts: bool = False
    """Each sparse layer routes tokens to experts: a ``gate`` and fused 3-D ``experts``
    (``engine.moe``); model.num_experts > 0, parallel.expert applies."""
    low_precision_linears: tuple[str, ...] = ()
    """The linear layers (last name part) a low-precision path may convert: the blocks'
    projections, never the head, embeddings, norms or a router. GPT-2's are Conv1D (none);
    the experts are 3-D tensors, not Linear layers."""
    context_parallel: bool = False
    """Its attention is what ``engine.context_parallel`` computes over a split sequence: the
    decoder calls transformers' ``AttentionInterface`` with rotary queries and keys, a causal
    mask, its ``scaling`` and at most a ``sliding_window``; nothing else (no soft-capping,
    sinks, ALiBi or learned absolute positions: GPT-2's attention scales by layer and upcasts
    of its own, and an encoder attends both ways)."""
    pipeline: bool = False
    """Pipeline parallelism cuts it through its own forwards: ``model.embed_tokens``,
    ``model.layers``, ``model.norm``, ``lm_head``; a later stage's input as ``inputs_embeds``,
    to which the decoder adds nothing (GPT-2 adds its positions)."""


def _llama_like(m: ModelConfig) -> dict:
    return dict(
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_position_embeddings,
        attention_dropout=0.0,
    )


def _gpt2(m: ModelConfig) -> dict:
    # GPT-2 has no grouped-query attention; its MLP width is n_inner.
    return dict(
        n_embd=m.hidden_size,
        n_inner=m.intermediate_size,
        n_layer=m.num_layers,
        n_head=m.num_heads,
        n_positions=m.max_position_embeddings,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )


def _bert(m: ModelConfig) -> dict:
    return dict(
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        max_position_embeddings=m.max_position_embeddings,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        bos_token_id=None,  # an encoder: BERT's own (none), not the decoders' 0 and 1
        eos_token_id=None,
    )


def _moe(m: ModelConfig) -> dict:
    """Every MoE preset's shared fields: every layer sparse."""
    fields = _llama_like(m)
    fields.pop("intermediate_size")
    return dict(fields, num_experts_per_tok=m.experts_per_token)


def _expert_width(m: ModelConfig) -> int:
    return m.expert_intermediate_size or m.intermediate_size


def _qwen3_moe(m: ModelConfig) -> dict:
    return dict(
        _moe(m),
        intermediate_size=m.intermediate_size,  # dense layers' (none here)
        moe_intermediate_size=_expert_width(m),
        num_experts=m.num_experts,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        head_dim=m.hidden_size // m.num_heads,
    )


def _mixtral(m: ModelConfig) -> dict:
    return dict(
        _moe(m),
        intermediate_size=_expert_width(m),
        num_local_experts=m.num_experts,
        router_jitter_noise=0.0,  # random noise in training: breaks exact parity
    )


def _olmoe(m: ModelConfig) -> dict:
    return dict(
        _moe(m),
        intermediate_size=_expert_width(m),
        num_experts=m.num_experts,
        norm_topk_prob=False,
    )


A, Q = Activations, QkNorm
BERT_LINEARS = ("query", "key", "value", "dense")
_ROWS = (
    Family(
        "llama",
        A.llama,
        ModelArch.llama,
        "LlamaConfig",
        _llama_like,
        fused_loss=True,
        low_precision_linears=LLAMA_LINEARS,
        context_parallel=True,
        pipeline=True,
    ),
    Family(
        "mistral",
        A.llama,
        fused_loss=True,
        low_precision_linears=LLAMA_LINEARS,
        context_parallel=True,
        pipeline=True,
    ),
    Family(
        "qwen2",
        A.llama,
        ModelArch.qwen2,
        "Qwen2Config",
        _llama_like,
        fused_loss=True,
        low_precision_linears=LLAMA_LINEARS,
        context_parallel=True,
        pipeline=True,
    ),
    Family(
        "qwen3",
        A.llama,
        fused_loss=True,
        qk_norm=Q.head,
        low_precision_linears=LLAMA_LINEARS,
        context_parallel=True,
        pipeline=True,
    ),
    Family(
        "gpt2",
        A.gpt2,
        ModelArch.gpt2,
        "GPT2Config",
        _gpt2,
        rotary_gqa=False,
        fused_loss=True,
    ),
    Family("gpt_neox", A.neox, rotary_gqa=False),
    Family(
        "bert",
        A.bert,
        ModelArch.bert,
        "BertConfig",
        _bert,
        task=ModelTask.masked_lm,
        rotary_gqa=False,
        low_precision_linears=BERT_LINEARS,
    ),
    Family(
        "roberta",
        A.bert,
        task=ModelTask.masked_lm,
        rotary_gqa=False,
        low_precision_linears=BERT_LINEARS,
    ),
    Family(
        "qwen3_moe",
        A.llama,
        ModelArch.qwen3_moe,
        "Qwen3MoeConfig",
        _qwen3_moe,
        fused_loss=True,
        qk_norm=Q.head,
        experts=True,
        low_precision_linears=ATTENTION_LINEARS,
        context_parallel=True,
    ),
    Family(
        "mixtral",
        A.llama,
        ModelArch.mixtral,
        "MixtralConfig",
        _mixtral,
        fused_loss=True,
        experts=True,
        low_precision_linears=ATTENTION_LINEARS,
        context_parallel=True,
    ),
    Family(
        "olmoe",
        A.llama,
        ModelArch.olmoe,
        "OlmoeConfig",
        _olmoe,
        fused_loss=True,
        qk_norm=Q.full,
        experts=True,
        low_precision_linears=ATTENTION_LINEARS,
        context_parallel=True,
    ),
)
del A, Q
FAMILIES: dict[str, Family] = {row.model_type: row for row in _ROWS}
ENTRY_POINTS = "fsdp_lab.families"


@functools.cache
def _plug_in() -> None:
    """The rows users' packages register, added to the table once per process: an entry point
    in the group ``fsdp_lab.families`` naming a ``Family`` (or a list of them), e.g. in the
    user's pyproject.toml ``[project.entry-points."fsdp_lab.families"] phi3 =
    "my_lab.families:PHI3"``. Every process that reads the table (the launcher, each rank,
    plan) finds them the same. A bad one raises on every call, not only the first."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINTS):
        loaded = ep.load()
        for row in loaded if isinstance(loaded, (list, tuple)) else [loaded]:
            if not isinstance(row, Family):
                raise ConfigError(
                    f"entry point {ep.name} = {ep.value} (group {ENTRY_POINTS}) is a "
                    f"{type(row).__name__}, not a fsdp_lab.config.families.Family"
                )
            if row.model_type in FAMILIES and FAMILIES[row.model_type] is not row:
                raise ConfigError(
                    f"entry point {ep.name} = {ep.value} registers model_type "
                    f"{row.model_type!r}, which fsdp_lab has a row for; name another type"
                )
            FAMILIES[row.model_type] = row


def _rows() -> dict[str, Family]:
    """The table, users' rows included (``_plug_in``)."""
    _plug_in()
    return FAMILIES


def family_of(model_type: str) -> Family | None:
    """The row of a Hugging Face model type; None for a type fsdp_lab has no row for."""
    return _rows().get(model_type)


def preset_family(arch: ModelArch) -> Family:
    """The row of a preset; a preset without one is a bug, not a user error."""
    for row in _rows().values():
        if row.preset is arch:
            return row
    raise RuntimeError(f"model.arch {arch} has no row in FAMILIES")


def fused_loss_types() -> list[str]:
    """The model types the fused losses may take, by name."""
    return sorted(t for t, row in _rows().items() if row.fused_loss)


def context_parallel_types() -> list[str]:
    """The model types context parallelism runs, by name."""
    return sorted(t for t, row in _rows().items() if row.context_parallel)


def pipeline_types() -> list[str]:
    """The model types pipeline parallelism cuts into stages, by name."""
    return sorted(t for t, row in _rows().items() if row.pipeline)


def expert_presets() -> list[str]:
    """The mixture-of-experts presets, by name."""
    return [row.preset.name for row in _rows().values() if row.experts and row.preset]


def check_preset(m: ModelConfig) -> None:
    """A preset's fields against its family: the task it trains, its experts (a mixture of
    experts needs some, a dense preset takes none), and what rotary and grouped-query
    attention ask of the heads."""
    if m.arch is None:
        return
    row = preset_family(m.arch)
    if row.task is not m.task:
        raise ConfigError(
            f"model.task={m.task.name} does not fit model.arch={m.arch.name}, a "
            f"{row.task.name} preset; set model.task={row.task.name}"
        )
    if m.router_aux_loss_coef is not None and m.router_aux_loss_coef < 0:
        raise ConfigError(
            f"model.router_aux_loss_coef={m.router_aux_loss_coef} must be >= 0 (0: off, "
            "null: the model's default)"
        )
    if not row.experts and m.num_experts:
        presets = ", ".join(f"{name}_tiny" for name in expert_presets())
        raise ConfigError(
            f"model.num_experts={m.num_experts} but model.arch={m.arch.name} is dense; use "
            f"a mixture-of-experts preset (model={presets})"
        )
    if row.experts:
        positive(m.num_experts, "model.num_experts")
        if not 1 <= m.experts_per_token <= m.num_experts:
            raise ConfigError(
                f"model.experts_per_token={m.experts_per_token} must be between 1 and "
                f"model.num_experts={m.num_experts}"
            )
        if m.expert_intermediate_size is not None:
            positive(m.expert_intermediate_size, "model.expert_intermediate_size")
    if row.rotary_gqa:
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={m.num_heads} must be divisible by "
                f"model.num_kv_heads={m.num_kv_heads}"
            )
        if (m.hidden_size // m.num_heads) % 2:
            raise ConfigError(
                f"model.hidden_size/model.num_heads={m.hidden_size // m.num_heads} must be even "
                "(rotary embeddings rotate pairs of dimensions)"
            )
