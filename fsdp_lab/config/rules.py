"""Every rule a config must satisfy, checked once, in the parent, before any rank starts.

``check_fields`` runs each group's own single-field rules (in the group's module) and the few
that span two groups (run by ``load.to_typed``); ``validate`` the rules that need the topology
(world size, nodes). Each failure is a ``ConfigError`` naming the setting and the fix, on one
line. Imports no torch.
"""

from __future__ import annotations

from fsdp_lab.config.checkpoint_formats import format_row, with_async_saves
from fsdp_lab.config.data import check_data
from fsdp_lab.config.data_kinds import Holds, kind_row
from fsdp_lab.config.errors import ConfigError, positive
from fsdp_lab.config.evaluation import check_eval
from fsdp_lab.config.families import check_preset
from fsdp_lab.config.hardware import HardwareKind, check_hardware
from fsdp_lab.config.hardware_kinds import Feature, hardware_row
from fsdp_lab.config.losses import loss_needs_triton, loss_runs_anywhere
from fsdp_lab.config.low_precision import check_low_precision
from fsdp_lab.config.low_precision import setting as low_precision
from fsdp_lab.config.model import (
    ExpertsImplementation,
    check_finetune,
    check_model,
    method_row,
    task_row,
)
from fsdp_lab.config.pipeline import check_pipeline
from fsdp_lab.config.precisions import check_precision, dtype_row
from fsdp_lab.config.profiling import profile_problem
from fsdp_lab.config.schema import Config
from fsdp_lab.config.sharding import (
    ActivationCheckpointingMode,
    check_layout,
    check_sharding,
    offloaded,
)
from fsdp_lab.config.strategies import strategy_of, with_expert_parallel, with_replica_groups
from fsdp_lab.config.topology import Topology, dp_size, replicate_size
from fsdp_lab.config.training import CheckpointConfig, OptimImpl, check_optim, check_trainer


def check_fields(cfg: Config) -> None:
    """Each group's single fields, then the rules across two groups that need no topology."""
    check_trainer(cfg.trainer)
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} must be >= 0")
    check_optim(cfg.optim, cfg.loss)
    check_hardware(cfg.hardware)
    check_layout(cfg.parallel, cfg.wrap, cfg.activation_checkpointing)
    check_model(cfg.model)
    check_preset(cfg.model)
    check_data(cfg.data)
    _check_token_data(cfg)
    check_sharding(cfg.sharding)
    _check_checkpoint(cfg.checkpoint)
    check_precision(cfg.precision)
    check_finetune(cfg.finetune)
    check_eval(cfg.eval)
    _check_eval_layout(cfg)


def _check_eval_layout(cfg: Config) -> None:
    """Generation's sequences grow a token at a time: sequence parallelism cannot split them."""
    e = cfg.eval
    if (e.prompts is not None or e.harness_tasks) and cfg.parallel.sequence_parallel:
        what = "eval.prompts" if e.prompts is not None else "eval.harness_tasks"
        raise ConfigError(
            f"{what} with parallel.sequence_parallel=true: generation feeds one token at a "
            "time, which cannot be split over the tensor-parallel ranks; set "
            "parallel.sequence_parallel=false, or score the export with `fsdp-lab eval`"
        )


def _check_checkpoint(c: CheckpointConfig) -> None:
    if c.every_n_steps < 0:
        raise ConfigError(
            f"checkpoint.every_n_steps={c.every_n_steps} must be >= 0 (0: at the end)"
        )
    if c.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last={c.keep_last} must be >= 1")
    if c.async_enabled and not format_row(c.format).async_saves:
        raise ConfigError(
            f"checkpoint.async_enabled=true needs checkpoint={' or '.join(with_async_saves())} "
            f"(got {c.format.name})"
        )


def refuse_for_hardware(cfg: Config, kind: HardwareKind) -> None:
    """What the config asks for that the kind's row refuses: the first, in one line naming the
    setting, why and the fix."""
    row = hardware_row(kind)
    for feature, setting in asked(cfg):
        if not row.runs(feature):
            raise ConfigError(f"hardware={kind.name} cannot run {setting}: {row.refuses[feature]}")


def asked(cfg: Config) -> list[tuple[Feature, str]]:
    """The features the config asks for that some kind refuses, each with the setting that
    asks for it (``config.hardware_kinds.Feature``)."""
    return [(f, setting) for f, on, setting in _layout_asks(cfg) + _run_asks(cfg) if on]


def _layout_asks(cfg: Config) -> tuple[tuple[Feature, bool, str], ...]:
    """(feature, asked, setting): how the model is split and computed."""
    s, p, r = cfg.sharding, cfg.precision, cfg.parallel
    scaled = [d.name for d in (p.param_dtype, p.reduce_dtype) if dtype_row(d).needs_scaler]
    return (
        (
            Feature.strategy_regathers,
            strategy_of(s.strategy).xla is not s.strategy,
            f"sharding={s.strategy.name}",
        ),
        (
            Feature.reshard_after_forward,
            s.reshard_after_forward is not None,
            f"sharding.reshard_after_forward={s.reshard_after_forward}",
        ),
        (
            Feature.prefetch,
            s.prefetch.forward != 0 or s.prefetch.backward != 1,
            "sharding.prefetch",
        ),
        (
            Feature.offload,
            offloaded(cfg.offload),
            f"offload={cfg.offload.device.name}",
        ),
        (
            Feature.op_checkpointing,
            cfg.activation_checkpointing.mode is ActivationCheckpointingMode.op,
            "activation_checkpointing=op",
        ),
        (Feature.scaled_dtype, bool(scaled), f"precision={scaled[0] if scaled else ''}"),
        (Feature.grad_scaler, p.grad_scaler_enabled, "precision.grad_scaler_enabled=true"),
        (
            Feature.half_reduce,
            dtype_row(p.reduce_dtype).half,
            f"precision.reduce_dtype={p.reduce_dtype.name}",
        ),
        (Feature.output_dtype, p.output_dtype is not None, "precision.output_dtype"),
        (Feature.compile, cfg.compile, "compile=true"),
        (Feature.tensor_parallel, r.tensor > 1, f"parallel.tensor={r.tensor}"),
        (Feature.context_parallel, r.context > 1, f"parallel.context={r.context}"),
        (Feature.expert_parallel, r.expert > 1, f"parallel.expert={r.expert}"),
        (Feature.pipeline_parallel, r.pipeline > 1, f"parallel.pipeline={r.pipeline}"),
    )


def _run_asks(cfg: Config) -> tuple[tuple[Feature, bool, str], ...]:
    """(feature, asked, setting): the rest of the run (optimizer, loss, checkpoints,
    fine-tuning, kernels, hosts)."""
    loss = cfg.loss.kind
    return (
        (
            Feature.generation,
            cfg.eval.prompts is not None or bool(cfg.eval.harness_tasks),
            "eval.prompts or eval.harness_tasks",
        ),
        (
            Feature.fused_optimizer,
            cfg.optim.implementation is OptimImpl.fused,
            "optim.implementation=fused",
        ),
        (Feature.custom_loss, not loss_runs_anywhere(loss), f"loss={loss.name}"),
        (Feature.triton, loss_needs_triton(loss), f"loss={loss.name}"),
        (
            Feature.whole_file_checkpoints,
            format_row(cfg.checkpoint.format).whole_files,
            f"checkpoint={cfg.checkpoint.format.name}",
        ),
        (Feature.async_checkpoints, cfg.checkpoint.async_enabled, "checkpoint.async_enabled=true"),
        (
            Feature.frozen_parameters,
            method_row(cfg.finetune.method).freezes,
            f"finetune={cfg.finetune.method.name}",
        ),
        (
            Feature.multi_host,
            cfg.hardware.num_nodes != 1,
            f"hardware.num_nodes={cfg.hardware.num_nodes}",
        ),
        (Feature.torchao, low_precision(cfg) is not None, low_precision(cfg) or ""),
        (
            Feature.grouped_mm,
            cfg.model.experts_implementation is ExpertsImplementation.grouped_mm,
            "model.experts_implementation=grouped_mm",
        ),
    )


def _check_parallel(cfg: Config, topo: Topology) -> int:
    """parallel.*: the TP degree, checked against the ranks and what TP combines with."""
    p = cfg.parallel
    _check_context(cfg, topo)
    _check_expert(cfg, topo)
    tensor = p.tensor
    if tensor == 1:
        if p.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel=true needs parallel.tensor > 1")
        return 1
    if topo.world_size % tensor:
        raise ConfigError(
            f"parallel.tensor={tensor} does not divide the {topo.world_size} ranks; set "
            "hardware.nproc_per_node to a multiple of it"
        )
    refusals = (
        (
            method_row(cfg.finetune.method).adapters,
            "finetune=lora (PEFT wraps q_proj as q_proj.base_layer: the TP plan no longer "
            "matches it)",
        ),
    )
    for refused, what in refusals:
        if refused:
            raise ConfigError(f"parallel.tensor={tensor} cannot combine with {what} yet")
    return tensor


def _check_context(cfg: Config, topo: Topology) -> None:
    """parallel.context: a divisor of the ranks (beside TP), a sequence cut into 2N equal
    chunks, and the settings CP does not run with, refused; the model's side (an attention the
    CP attention reproduces) is checked on its config (launch.prepare)."""
    context, tensor, seq_len = cfg.parallel.context, cfg.parallel.tensor, cfg.trainer.seq_len
    if context == 1:
        return
    refusals = (
        (cfg.parallel.expert > 1, f"parallel.expert={cfg.parallel.expert}"),
        (
            not task_row(cfg.model.task).causal,
            f"model.task={cfg.model.task.value} (an encoder attends both ways; CP splits a "
            "causal LM's sequences)",
        ),
    )
    for refused, what in refusals:
        if refused:
            raise ConfigError(
                f"parallel.context={context} cannot combine with {what}; set parallel.context=1"
            )
    if topo.world_size % (context * tensor):
        with_tp = f" x parallel.tensor={tensor}" if tensor > 1 else ""
        raise ConfigError(
            f"parallel.context={context}{with_tp} does not divide the {topo.world_size} ranks; "
            f"set hardware.nproc_per_node to a multiple of {context * tensor}"
        )
    if seq_len % (2 * context):
        fit = seq_len - seq_len % (2 * context) or 2 * context
        raise ConfigError(
            f"trainer.seq_len={seq_len} is not a multiple of 2 x parallel.context={2 * context} "
            f"(each rank keeps 2 of {2 * context} equal chunks of a sequence); set "
            f"trainer.seq_len={fit}"
        )


def _check_expert(cfg: Config, topo: Topology) -> None:
    """parallel.expert: a divisor of the shard axis, refused with the settings it was not
    verified with (docs/sharding-and-precision.md lists what was); the model's side (an MoE, an
    expert count the degree divides) is checked on its structure (launch.prepare)."""
    expert, s = cfg.parallel.expert, cfg.sharding
    raf = s.reshard_after_forward
    positive(expert, "parallel.expert")
    if expert == 1:
        return
    refusals = (
        (cfg.parallel.tensor > 1, f"parallel.tensor={cfg.parallel.tensor}"),
        (
            not strategy_of(s.strategy).expert_parallel,
            f"sharding={s.strategy.name} (verified: {', '.join(with_expert_parallel())})",
        ),
        (
            isinstance(raf, int) and not isinstance(raf, bool),
            f"sharding.reshard_after_forward={raf} (an int)",
        ),
        (cfg.compile, "compile=true (the all-to-all's split sizes are data-dependent)"),
        (offloaded(cfg.offload), f"offload={cfg.offload.device.name}"),
        (
            method_row(cfg.finetune.method).freezes,
            f"finetune={cfg.finetune.method.name}",
        ),
    )
    for refused, what in refusals:
        if refused:
            raise ConfigError(
                f"parallel.expert={expert} is not verified with {what}; set parallel.expert=1 "
                "or drop that setting"
            )
    shard = dp_size(topo) // replicate_size(s, topo)
    if shard % expert:
        raise ConfigError(
            f"parallel.expert={expert} does not divide the {shard} ranks of the shard axis; set "
            "parallel.expert to a divisor of it (or hardware.nproc_per_node to a multiple)"
        )


def _check_token_data(cfg: Config) -> None:
    """data=tokens has no tokenizer to size a preset's vocabulary."""
    d, m = cfg.data, cfg.model
    row = kind_row(d.kind)
    if row.replies_only and not task_row(m.task).causal:
        raise ConfigError(
            f"data={d.kind.value} trains a causal LM on replies; model.task={m.task.value} "
            "predicts masked tokens: use data=text for it, or a causal LM"
        )
    ids_only = row.reads is Holds.ids  # token files: no tokenizer unless one is named
    if ids_only and d.tokenizer is None and m.arch and m.vocab_size is None:
        raise ConfigError(
            f"data={d.kind.value} with model={m.arch.value}: model.vocab_size is null and there "
            "is no tokenizer to take it from; set model.vocab_size (above the largest token id, "
            "e.g. 50304 for GPT-2's) or data.tokenizer"
        )


def validate(cfg: Config, topo: Topology) -> None:
    """Cross-field rules that need the topology; raises ConfigError naming the setting and fix."""
    s = cfg.sharding
    check_low_precision(cfg)
    refuse_for_hardware(cfg, topo.device)
    problem = profile_problem(
        cfg.profile,
        max_steps=cfg.trainer.max_steps,
        world_size=topo.world_size,
        kind=topo.device.name,
    )
    if problem is not None:
        raise ConfigError(problem)
    hybrid = strategy_of(s.strategy).has_replica_groups
    if s.replicate_size is not None and not hybrid:
        raise ConfigError(
            f"sharding.replicate_size={s.replicate_size} applies only to sharding="
            f"{' or '.join(with_replica_groups())} (got sharding={s.strategy.name}); remove it"
        )
    topo = check_pipeline(cfg, topo)  # every rule below: within one pipeline stage
    tensor = _check_parallel(cfg, topo)
    context = cfg.parallel.context
    dp = dp_size(topo, tensor, context=context)
    split = tensor * context > 1
    ranks = f"{dp} data-parallel ranks" if split else f"{dp} ranks"
    replicate = replicate_size(s, topo, tensor, context=context)
    if hybrid:
        if replicate < 1 or dp % replicate:
            raise ConfigError(
                f"sharding.replicate_size={replicate} does not divide the "
                f"{ranks if split else f'world size {dp}'}; set sharding.replicate_size "
                "to a divisor of it"
            )
        if dp // replicate * context < 2:  # the ranks of a CP group shard the model too
            more = (
                "4+ ranks (hardware.nproc_per_node=4)"
                if hardware_row(topo.device).default_ranks
                else f"4+ {topo.device.name} devices on a node"
            )
            raise ConfigError(
                f"sharding={s.strategy.name} on {ranks} with replicate_size="
                f"{replicate} leaves shard groups of 1 rank; use {more}, a smaller "
                "sharding.replicate_size, or sharding=full"
            )
    raf = s.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool):
        shard_size = dp // replicate * context  # FSDP's shard axis: shard x context
        if shard_size % raf or raf >= shard_size:
            raise ConfigError(
                f"sharding.reshard_after_forward={raf} must be a proper divisor of the shard "
                f"axis size {shard_size}; use true, false or a divisor"
            )
