"""The model and finetune groups: a preset or a Hugging Face directory, its experts, how its
weights arrive, which parameters train, and their single-field rules. Imports no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from fsdp_lab.config.errors import ConfigError, positive


class ModelArch(enum.Enum):
    llama = "llama"
    gpt2 = "gpt2"
    qwen2 = "qwen2"
    bert = "bert"
    qwen3_moe = "qwen3_moe"  # mixtures of experts: model.num_experts > 0
    mixtral = "mixtral"
    olmoe = "olmoe"


class WeightLoading(enum.Enum):
    """How the initial weights reach the shards."""

    per_rank = "per_rank"  # each rank reads (or draws) only its own shards
    rank0 = "rank0"  # rank 0 builds the whole model in fp32 and broadcasts it


class ExpertsImplementation(enum.Enum):
    """How an MoE layer runs its experts (transformers' ``_experts_implementation``)."""

    auto = "auto"  # transformers' own choice (grouped_mm where torch has it)
    eager = "eager"  # a loop over the experts that received tokens (a host sync per layer)
    batched_mm = "batched_mm"  # one bmm over (token, expert) pairs: gathers a weight per pair
    grouped_mm = "grouped_mm"  # tokens sorted by expert, one grouped GEMM (torch >= 2.9)


class ModelTask(enum.Enum):
    causal_lm = "causal_lm"  # next-token prediction (decoders: Llama, GPT-2, Qwen2, ...)
    masked_lm = "masked_lm"  # predict masked tokens from both sides (encoders: BERT, RoBERTa, ...)


class FinetuneMethod(enum.Enum):
    full = "full"  # every parameter trains
    freeze = "freeze"  # the modules finetune.freeze names (and the first freeze_blocks) are frozen
    lora = "lora"  # PEFT's LoRA adapters train; the whole base model is frozen


@dataclass(frozen=True)
class TaskRow:
    causal: bool
    """Predicts each next token from those before it: attention runs one way, so context
    parallelism can split a sequence, replies can be trained on and generated, and a fused loss
    can take the hidden states."""
    masks_tokens: bool
    """Predicts masked tokens: needs the tokenizer's mask token, and the loader masks them."""
    upcasts_logits: bool
    """transformers' loss for the task upcasts the logits to fp32 (the plan counts the copy)."""
    auto_class: str
    """transformers' ``AutoModelFor...`` class that builds the model for it."""
    peft_task_type: str | None
    """PEFT's task type for an exported adapter, so that the Auto class loads its directory."""


TASKS: dict[ModelTask, TaskRow] = {
    ModelTask.causal_lm: TaskRow(
        causal=True,
        masks_tokens=False,
        upcasts_logits=True,
        auto_class="AutoModelForCausalLM",
        peft_task_type="CAUSAL_LM",
    ),
    ModelTask.masked_lm: TaskRow(
        causal=False,
        masks_tokens=True,
        upcasts_logits=False,
        auto_class="AutoModelForMaskedLM",
        peft_task_type=None,
    ),
}
DEFAULT_TASK = ModelTask.causal_lm


def task_row(task: ModelTask) -> TaskRow:
    return TASKS[task]


@dataclass(frozen=True)
class MethodRow:
    freezes: bool
    """Some parameters do not train (a frozen base: no gradients, no optimizer state)."""
    adapters: bool
    """Trains adapters added to a frozen base (PEFT's LoRA): what an export saves alone."""


FINETUNE_METHODS: dict[FinetuneMethod, MethodRow] = {
    FinetuneMethod.full: MethodRow(freezes=False, adapters=False),
    FinetuneMethod.freeze: MethodRow(freezes=True, adapters=False),
    FinetuneMethod.lora: MethodRow(freezes=True, adapters=True),
}


def method_row(method: FinetuneMethod) -> MethodRow:
    return FINETUNE_METHODS[method]


class QuantizeBase(enum.Enum):
    none = "none"
    nf4 = "nf4"  # QLoRA: the frozen base's linear layers in torchao's 4-bit NormalFloat


@dataclass
class ModelConfig:
    arch: Optional[ModelArch] = None
    """Preset family built from the sizes below with random init; None when name_or_path is set."""
    name_or_path: Optional[str] = None
    """A local Hugging Face model directory (config.json, optionally safetensors and a
    tokenizer) or a hub id such as HuggingFaceTB/SmolLM2-135M (where the hub is reachable)."""
    pretrained: bool = False
    """name_or_path only: load its weights (each rank reads only its own shards from the
    safetensors files). false: random init from its config, seeded."""
    loading: WeightLoading = WeightLoading.per_rank
    """per_rank: each rank reads from the safetensors files, or draws from the seed, only the
    shards it holds (host RAM: its shards and one tensor). rank0: rank 0 builds the whole model
    in fp32 (transformers' from_pretrained, or the seeded init) and broadcasts it: the same
    weights, at the whole model's host RAM on rank 0. A checkpoint transformers converts in a
    way that cannot be read per tensor, or a hub id, takes rank0's route with a warning."""
    task: ModelTask = DEFAULT_TASK
    """causal_lm: next-token loss; masked_lm: loss on masked tokens (encoders such as BERT)."""
    vocab_size: Optional[int] = None
    """Presets: None takes the tokenizer's size (256 for synthetic data)."""
    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    """Share the input embedding with the output head (GPT-2, small Qwen2)."""
    num_experts: int = 0
    """Mixture-of-experts presets (qwen3_moe, mixtral, olmoe): experts per MoE layer; 0 for the
    dense presets. model=local reads it from config.json."""
    experts_per_token: int = 2
    """MoE presets: the experts each token is routed to (top-k)."""
    expert_intermediate_size: Optional[int] = None
    """MoE presets: each expert's MLP width; None: model.intermediate_size."""
    router_aux_loss_coef: Optional[float] = None
    """MoE models: the weight of the router's load-balancing loss added to the training
    objective (once per step, a mean over micro-batches). None: the model's own default
    (config.router_aux_loss_coef, 0.001 for Qwen3-MoE); 0: off (still measured and logged)."""
    experts_implementation: ExpertsImplementation = ExpertsImplementation.auto
    """MoE models: the experts' kernel (config._experts_implementation). auto: transformers'
    choice; grouped_mm needs torch >= 2.9."""


@dataclass
class FinetuneConfig:
    """Which parameters train. Frozen parameters hold no gradient and no optimizer state;
    they may share an FSDP unit with trainable ones (FSDP2 shards per parameter)."""

    method: FinetuneMethod = FinetuneMethod.full
    """full: every parameter trains; freeze: the parameters under finetune.freeze and
    finetune.freeze_blocks are frozen; lora: PEFT's LoRA adapters on finetune.target_modules
    train and the whole base model is frozen."""
    freeze: List[str] = field(default_factory=list)
    """freeze: module or parameter name patterns (fnmatch; a module freezes everything under
    it), e.g. [model.embed_tokens, "model.layers.0.*"]. Names as in model.named_modules()."""
    freeze_blocks: int = 0
    """freeze: also freeze the first N transformer blocks (the model's stack of layers)."""
    r: int = 8
    """lora: the adapters' rank."""
    alpha: int = 16
    """lora: the scale is alpha / r."""
    dropout: float = 0.0
    """lora: dropout on the adapters' input (0.0: none; > 0 makes ranks draw different masks)."""
    target_modules: Optional[List[str]] = None
    """lora: module names (a name or its last parts, as PEFT matches them, e.g. [q_proj,
    v_proj]; all-linear: every linear layer but the head). None: PEFT's default for the
    architecture."""
    quantize_base: QuantizeBase = QuantizeBase.none
    """lora: nf4 holds the frozen base's block projections in 4-bit NormalFloat (QLoRA, torchao's
    NF4Tensor: blocks of 64 with double-quantised scales, ~4.13 bits a parameter), sharded and
    all-gathered in 4 bits; norms, embeddings, the head and the adapters keep their dtypes."""

    def chosen(self) -> str:
        """The option as the user names it (conf/finetune/): LoRA on an NF4 base is qlora."""
        if self.method is FinetuneMethod.lora and self.quantize_base is QuantizeBase.nf4:
            return "qlora"
        return self.method.name


def check_model(m: ModelConfig) -> None:
    if (m.arch is None) == (m.name_or_path is None):
        raise ConfigError(
            "model: set exactly one of model.arch (a preset) and model.name_or_path "
            f"(got arch={m.arch and m.arch.name}, name_or_path={m.name_or_path})"
        )
    if m.pretrained and m.name_or_path is None:
        raise ConfigError(
            "model.pretrained=true needs model.name_or_path (a directory or hub id "
            "with weights); presets have no weights"
        )
    if m.name_or_path is not None:
        path = Path(m.name_or_path).expanduser()
        local = path.exists() or not is_hub_id(m.name_or_path)
        if local and not (path / "config.json").is_file():
            raise ConfigError(
                f"model.name_or_path={m.name_or_path}: no config.json there; point it at a local "
                "Hugging Face model directory (one that save_pretrained wrote) or a hub id"
            )
        return
    if m.vocab_size is not None:
        positive(m.vocab_size, "model.vocab_size")
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "max_position_embeddings",
    ):
        positive(getattr(m, name), f"model.{name}")
    if m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} must be divisible by model.num_heads={m.num_heads}"
        )


def is_hub_id(name: str) -> bool:
    """`org/name` or `name` with no path syntax: what the hub accepts and a path rarely is."""
    parts = name.split("/")
    return (
        len(parts) <= 2
        and all(parts)
        and not name.startswith((".", "~"))
        and all(c.isalnum() or c in "-_." for part in parts for c in part)
    )


def check_finetune(f: FinetuneConfig) -> None:
    """The finetune group: each method's own settings, and no setting of another method."""
    default = FinetuneConfig()
    if f.method is not FinetuneMethod.freeze:
        for name in ("freeze", "freeze_blocks"):
            if getattr(f, name) != getattr(default, name):
                raise ConfigError(
                    f"finetune.{name} applies only to finetune=freeze (this run is "
                    f"finetune={f.method.name}); remove it or set finetune=freeze"
                )
    if f.method is not FinetuneMethod.lora:
        for name in ("r", "alpha", "dropout", "target_modules", "quantize_base"):
            if getattr(f, name) != getattr(default, name):
                raise ConfigError(
                    f"finetune.{name} applies only to finetune=lora (this run is "
                    f"finetune={f.method.name}); remove it or set finetune=lora"
                )
    if f.freeze_blocks < 0:
        raise ConfigError(f"finetune.freeze_blocks={f.freeze_blocks} must be >= 0")
    if f.method is FinetuneMethod.freeze and not f.freeze and not f.freeze_blocks:
        raise ConfigError(
            "finetune=freeze freezes nothing; set finetune.freeze=[<module pattern>, ...] "
            "and/or finetune.freeze_blocks=N"
        )
    positive(f.r, "finetune.r")
    positive(f.alpha, "finetune.alpha")
    if not 0 <= f.dropout < 1:
        raise ConfigError(f"finetune.dropout={f.dropout} must be in [0, 1)")
    if f.target_modules is not None and not f.target_modules:
        raise ConfigError(
            "finetune.target_modules=[] names no module; list them (e.g. [q_proj,v_proj]) "
            "or set finetune.target_modules=null for PEFT's default"
        )
