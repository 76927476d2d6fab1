"""The hardware kinds, one row each: what a device is, which engine runs it, how its ranks
start, and what it refuses. The rules, the launchers, both engines and the plan read these
columns; none of them names a kind. Imports no torch.

| hardware | device | engine | ranks start | backend     | memory | ranks by default | plan on |
| cpu      | cpu    | fsdp2  | fork        | gloo        | host   | 2                | cpu     |
| gpu      | cuda   | fsdp2  | spawn       | nccl + gloo | device | one per GPU      | h100    |
| tpu      | xla    | xla    | spawn       | XLA's       | device | every XLA device | (none)  |

The fsdp2 engine is torch's ``fully_shard`` over a process group, one process per rank
(``engine.fsdp``); the xla engine is torch_xla's SPMD, one process per host driving all its
devices (``engine.xla``). A new kind is a ``HardwareKind`` member, a row here, a
``conf/hardware/`` file and, for a new torch device type, that type's operations in
``engine.hardware.devices``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from fsdp_lab.config.hardware import HardwareKind, StartMethod


class Engine(enum.Enum):
    fsdp2 = "fsdp2"  # torch's fully_shard over a process group: one process per rank
    xla = "xla"  # torch_xla SPMD: one process per host; the compiler shards by annotation


class Feature(enum.Enum):
    """What a run can ask for that a kind may refuse (``config.rules.asked`` says which
    setting asks for each)."""

    strategy_regathers = "strategy_regathers"  # keep gathered parameters forward to backward
    reshard_after_forward = "reshard_after_forward"
    prefetch = "prefetch"
    offload = "offload"
    op_checkpointing = "op_checkpointing"
    scaled_dtype = "scaled_dtype"  # a compute or reduce dtype that needs loss scaling (fp16)
    grad_scaler = "grad_scaler"
    half_reduce = "half_reduce"  # reducing gradients in 16 bits
    output_dtype = "output_dtype"
    compile = "compile"
    generation = "generation"  # eval.prompts, eval.harness_tasks
    fused_optimizer = "fused_optimizer"
    custom_loss = "custom_loss"  # any loss but the model's own
    triton = "triton"  # a loss running Triton kernels
    whole_file_checkpoints = "whole_file_checkpoints"
    async_checkpoints = "async_checkpoints"
    frozen_parameters = "frozen_parameters"  # finetune other than full
    multi_host = "multi_host"
    tensor_parallel = "tensor_parallel"
    context_parallel = "context_parallel"
    expert_parallel = "expert_parallel"
    pipeline_parallel = "pipeline_parallel"
    torchao = "torchao"  # float8 training, an NF4 base
    grouped_mm = "grouped_mm"  # model.experts_implementation=grouped_mm
    external_launch = "external_launch"  # torchrun, srun, hydra/launcher=slurm


@dataclass(frozen=True)
class HardwareRow:
    device_type: str
    """torch's device type: cpu, cuda or xla (``engine.hardware.devices`` holds each type's
    operations: its count, random state, waits, memory statistics)."""
    engine: Engine
    start_method: StartMethod
    """How a bare ``python train.py`` starts the local ranks when hardware.start_method=auto."""
    forks: bool
    """A forked child can use the device (CUDA and XLA cannot be used in one)."""
    host: bool
    """The device is the host's CPU: its memory is RAM (parameters, gathers and optimizer
    state count against the host), its kernels run one by one on the host's cores, its
    collectives run over gloo, and offload has nowhere further to go."""
    nccl: bool
    """hardware.backend=auto uses NCCL for the device's tensors (and gloo for CPU ones)."""
    default_ranks: int | None
    """Ranks per node when hardware.nproc_per_node is null; None: one per device of the host."""
    plan_device: str | None
    """The named device row (``config.device_rows``) ``fsdp-lab plan`` prices an unmeasured
    machine of this kind on; None: the plan cannot model this engine's buffers."""
    compile_needs_compiler: bool
    """compile=true builds C++ (inductor's CPU backend): a compiler must be on PATH."""
    flash_attention: bool
    """SDPA applies the causal mask in place in bf16 and fp16 (the flash kernel: no seq x seq
    mask in memory); elsewhere the mask is materialised at each call."""
    slurm_gpus: bool
    """hydra/launcher=slurm asks SLURM for one GPU per rank (``--gpus-per-node``)."""
    refuses: Mapping[Feature, str] = field(default_factory=dict)
    """What this kind cannot run, each with why and the fix, for a one-line error before any
    rank starts."""

    @property
    def one_process_per_host(self) -> bool:
        """One SPMD process drives every device of its host (each device one rank)."""
        return self.engine is Engine.xla

    @property
    def engine_checks_weights(self) -> bool:
        """The engine's loader checks pretrained weights for non-finite values as it reads
        them (the FSDP2 engine's; torch_xla's loader is its own)."""
        return self.engine is Engine.fsdp2

    def runs(self, feature: Feature) -> bool:
        return feature not in self.refuses


_ANNOTATION = "torch_xla shards by annotation; set it to 1"
_XLA_REFUSES = {
    Feature.strategy_regathers: (
        "keeping gathered parameters from forward to backward is the XLA compiler's scheduling, "
        "not a setting; use sharding=full (for grad_op) or sharding=hybrid (for hybrid_zero2): "
        "the same math and the same sharded state"
    ),
    Feature.reshard_after_forward: "the XLA compiler schedules re-gathering; remove it",
    Feature.prefetch: (
        "the XLA compiler schedules the all-gathers; remove sharding.prefetch.forward/backward"
    ),
    Feature.offload: "torch_xla SPMD keeps parameters on the TPU; use offload=none",
    Feature.op_checkpointing: (
        "torch_xla's checkpoint takes no operator policy; use activation_checkpointing=full or "
        "selective"
    ),
    Feature.scaled_dtype: "TPUs compute in bf16, without loss scaling; use precision=bf16",
    Feature.grad_scaler: (
        "bf16 needs no loss scaling on XLA; set precision.grad_scaler_enabled=false"
    ),
    Feature.half_reduce: (
        "XLA reduces gradients in their own dtype (fp32 master weights); use precision=bf16"
    ),
    Feature.output_dtype: (
        "autocast decides the output dtypes on XLA; set precision.output_dtype=null"
    ),
    Feature.compile: "XLA already compiles every step; set compile=false",
    Feature.generation: (
        "generation recompiles at every new length on XLA; remove them and score the export "
        "with `fsdp-lab eval RUN_DIR` instead"
    ),
    Feature.fused_optimizer: ("XLA has no fused AdamW; use optim.implementation=foreach (or auto)"),
    Feature.custom_loss: "XLA compiles the model's own loss into the step; use loss=hf (or auto)",
    Feature.triton: "Triton kernels run on a GPU; use loss=hf (or auto)",
    Feature.whole_file_checkpoints: (
        "torch_xla's distributed checkpoint reads and writes only DCP's files; use "
        "checkpoint=sharded (checkpoint.export_hf for whole weights), or resume it on cpu/gpu "
        "or start from its `fsdp-lab export` (model=local model.name_or_path=<export>)"
    ),
    Feature.async_checkpoints: (
        "XLA checkpoints are written synchronously; set checkpoint.async_enabled=false"
    ),
    Feature.frozen_parameters: (
        "frozen parameters and adapters are not verified on torch_xla; use finetune=full"
    ),
    Feature.multi_host: ("multi-host TPU slices are not supported yet; run on one TPU VM host"),
    Feature.tensor_parallel: _ANNOTATION,
    Feature.context_parallel: _ANNOTATION,
    Feature.expert_parallel: _ANNOTATION,
    Feature.pipeline_parallel: (
        "torch.distributed.pipelining sends activations between processes, and one SPMD "
        "process drives every device of the host; set parallel.pipeline=1"
    ),
    Feature.torchao: (
        "torchao's float8 and NF4 kernels are CUDA/CPU only; use hardware=gpu or hardware=cpu"
    ),
    Feature.grouped_mm: (
        "XLA does not lower torch.nn.functional.grouped_mm; use model.experts_implementation="
        "eager or batched_mm"
    ),
    Feature.external_launch: (
        "one SPMD process per host drives all its devices, started by the run's own command; "
        "run that on the TPU VM, without torchrun, srun or hydra/launcher=slurm"
    ),
}

HARDWARE: dict[HardwareKind, HardwareRow] = {
    HardwareKind.cpu: HardwareRow(
        device_type="cpu",
        engine=Engine.fsdp2,
        start_method=StartMethod.fork,
        forks=True,
        host=True,
        nccl=False,
        default_ranks=2,
        plan_device="cpu",
        compile_needs_compiler=True,
        flash_attention=False,
        slurm_gpus=False,
        refuses={Feature.triton: "Triton kernels run on a GPU; use loss=chunked"},
    ),
    HardwareKind.gpu: HardwareRow(
        device_type="cuda",
        engine=Engine.fsdp2,
        start_method=StartMethod.spawn,
        forks=False,
        host=False,
        nccl=True,
        default_ranks=None,
        plan_device="h100",
        compile_needs_compiler=False,
        flash_attention=True,
        slurm_gpus=True,
    ),
    HardwareKind.tpu: HardwareRow(
        device_type="xla",
        engine=Engine.xla,
        start_method=StartMethod.spawn,
        forks=False,
        host=False,
        nccl=False,
        default_ranks=None,
        plan_device=None,
        compile_needs_compiler=False,
        flash_attention=False,
        slurm_gpus=False,
        refuses=_XLA_REFUSES,
    ),
}


def hardware_row(kind: HardwareKind | str) -> HardwareRow:
    """The row of a resolved kind (or of its name); auto has none (``devices.resolve_kind``
    decides it first)."""
    kind = HardwareKind(getattr(kind, "value", kind))
    try:
        return HARDWARE[kind]
    except KeyError:
        raise RuntimeError(
            f"hardware.kind {kind.name} has no row (auto is resolved first)"
        ) from None


def kind_of(device_type: str) -> HardwareKind:
    """The kind whose device is torch's ``device_type``."""
    return next(k for k, row in HARDWARE.items() if row.device_type == device_type)


def resolved(kind: HardwareKind, *, cuda: bool) -> HardwareKind:
    """auto is the GPU kind where CUDA is usable, else the host's; another kind is itself."""
    if kind is not HardwareKind.auto:
        return kind
    return kind_of("cuda" if cuda else "cpu")


def plannable() -> list[str]:
    """The kinds ``fsdp-lab plan`` models, by name, for an error's fix."""
    return [k.name for k, row in HARDWARE.items() if row.plan_device is not None]
