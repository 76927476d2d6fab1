"""The groups that say how the model is split and computed: sharding (the strategy and its
knobs; what each strategy means is ``strategies``' table), parallel (TP, EP), precision, wrap,
offload and activation checkpointing, with their single-field rules. Imports no torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from fsdp_lab.config.errors import ConfigError, positive


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


class Float8Recipe(enum.Enum):
    """torchao's float8 training recipes (``Float8LinearConfig.from_recipe_name``)."""

    tensorwise = "tensorwise"  # one scale per tensor; FSDP2 all-gathers the weights in float8
    rowwise = "rowwise"  # one scale per row (more accurate, slower); bf16 all-gathers


class WrapPolicy(enum.Enum):
    transformer = "transformer"
    size = "size"
    none = "none"


class OffloadDevice(enum.Enum):
    none = "none"
    cpu = "cpu"


class ActivationCheckpointingMode(enum.Enum):
    none = "none"
    full = "full"  # recompute every FSDP unit's activations in backward
    selective = "selective"  # every k-th unit only
    op = "op"  # every unit, keeping some operators' outputs: torchtitan's selective op-level


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
    context parallelism (CP), next to it; expert parallelism (EP), borrowed from the shard
    axis; pipeline parallelism (PP), outermost."""

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
    """Context-parallel (CP) degree: every sequence is split over this many ranks, which read
    the same rows; each keeps 2 of 2N chunks (head-tail, so the causal work is balanced) and at
    each attention layer all-gathers the group's keys and values. Activations per rank fall
    about N-fold, so sequences N times longer fit. FSDP shards over shard x context. The
    sequence length must be a multiple of 2N. 1: no CP."""
    expert: int = 1
    """Expert-parallel (EP) degree for mixture-of-experts models: each MoE layer's experts are
    split over this many contiguous ranks of the shard axis (E/expert whole experts each) and
    tokens reach them by all-to-all; the remaining shard ranks shard each expert's parameters
    with FSDP. Must divide the expert count and the shard axis. 1: no EP."""
    pipeline: int = 1
    """Pipeline-parallel (PP) degree: the model is cut into stages of whole decoder layers
    (the first also holds the embedding, the last the final norm and the head), placed on the
    outermost mesh axis; each stage's ranks shard it with the sharding strategy, and
    activations pass between stages point to point. World size = pipeline x the data-parallel
    ranks of a stage. 1: no PP."""
    pipeline_schedule: str = "1F1B"
    """torch's schedule: GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble,
    ZBVZeroBubble, DualPipeV (``config.pipeline.SCHEDULES``)."""
    stages_per_rank: Optional[int] = None
    """Virtual stages a pipeline rank runs (interleaved and V schedules); None: the schedule's
    own (1 for GPipe and 1F1B, 2 for the others; V schedules need exactly 2)."""
    pipeline_microbatches: Optional[int] = None
    """Microbatches each micro-batch (``trainer.micro_batch_size`` rows) is cut into as it
    flows through the pipeline; more shrink the bubble. None: one per stage."""
    pipeline_layers: Optional[List[int]] = None
    """Decoder layers per stage, in order, instead of the even split (which counts the
    embedding and the head as a layer each)."""


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
    float8_recipe: Optional[Float8Recipe] = None
    """precision=float8: the blocks' linear layers compute in float8 through torchao
    (tensorwise or rowwise scales); the rest in param_dtype (bf16). None: no float8."""
    float8_all_gather: Optional[bool] = None
    """float8: all-gather the float8 layers' weights in float8 (half of bf16's bytes), their
    scales precomputed for every shard in one all-reduce after each optimizer step. None: on
    for tensorwise; rowwise cannot."""


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


def offloaded(cfg: OffloadConfig) -> bool:
    """Whether the sharded state lives on the host (the one place that reads the device)."""
    return cfg.device is OffloadDevice.cpu


def offload_config(on: bool) -> OffloadConfig:
    """The offload group that does, or does not, offload (tune's grid)."""
    return OffloadConfig(device=OffloadDevice.cpu if on else OffloadDevice.none)


@dataclass
class ActivationCheckpointingConfig:
    mode: ActivationCheckpointingMode = ActivationCheckpointingMode.none
    """none; full: every FSDP unit recomputes its activations in backward; selective: every
    `every`-th unit; op: every unit, keeping the outputs of attention and of every second
    matrix multiply (torchtitan's selective op-level policy: the recompute is the cheap
    operators and half the matmuls). Trades compute (up to one extra forward) for memory."""
    every: int = 2
    """selective: checkpoint units 0, k, 2k, ... (k = every)."""


def check_sharding(s: ShardingConfig) -> None:
    prefetch = s.prefetch
    if prefetch.forward < 0:
        raise ConfigError(
            f"sharding.prefetch.forward={prefetch.forward} must be >= 0 (0: FSDP2's "
            "implicit forward prefetching)"
        )
    if prefetch.backward < 1:
        raise ConfigError(
            f"sharding.prefetch.backward={prefetch.backward} must be >= 1: FSDP2 "
            "always prefetches the next unit in backward (1, its default)"
        )
    raf = s.reshard_after_forward
    if raf is not None and not isinstance(raf, (bool, int)):
        raise ConfigError(
            f"sharding.reshard_after_forward={raf!r} must be true, false, an int or null"
        )
    if isinstance(raf, int) and not isinstance(raf, bool) and raf < 2:
        raise ConfigError(
            f"sharding.reshard_after_forward={raf} as an int must be >= 2 (use true or false)"
        )


def check_layout(p: ParallelConfig, w: WrapConfig, a: ActivationCheckpointingConfig) -> None:
    """parallel's, wrap's and activation_checkpointing's single fields."""
    positive(p.tensor, "parallel.tensor")
    positive(p.context, "parallel.context")
    if w.policy is WrapPolicy.size:
        positive(w.min_num_params, "wrap.min_num_params")
    if a.every < 1:
        raise ConfigError(f"activation_checkpointing.every={a.every} must be >= 1")
