"""Every rule a config must satisfy, checked once, in the parent, before any rank starts.

``check_fields`` holds the rules of single fields and groups (run by ``load.to_typed``);
``validate`` the rules that need the topology (world size, nodes). Each failure is a
``ConfigError`` naming the setting and the fix, on one line. Imports no torch.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_lab.config.checkpoint_formats import format_row, with_async_saves
from fsdp_lab.config.losses import runs_on_xla
from fsdp_lab.config.profiling import profile_problem
from fsdp_lab.config.schema import (
    MALLOC_MMAP_THRESHOLD_MAX,
    MOE_ARCHS,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DataKind,
    Dtype,
    FinetuneConfig,
    FinetuneMethod,
    HardwareKind,
    ModelArch,
    ModelConfig,
    ModelTask,
    OffloadDevice,
    OptimImpl,
    PrecisionConfig,
    QuantizeBase,
    WrapPolicy,
)
from fsdp_lab.config.strategies import strategy_of, with_replica_groups
from fsdp_lab.config.topology import Topology, dp_size, replicate_size


def _positive(value: int | float, name: str) -> None:
    if value <= 0:
        raise ConfigError(f"{name}={value} must be > 0; set {name}=<a positive value>")


# Long: one flat list of single-field rules, each a condition and its message, read in order.
def check_fields(cfg: Config) -> None:
    t, m, o, h = cfg.trainer, cfg.model, cfg.optim, cfg.hardware
    for name in ("max_steps", "micro_batch_size", "grad_accum_steps", "seq_len"):
        _positive(getattr(t, name), f"trainer.{name}")
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} must be >= 0")
    if t.seq_len < 2:
        raise ConfigError(
            f"trainer.seq_len={t.seq_len} must be >= 2 (a next-token target needs two tokens)"
        )
    _positive(o.lr, "optim.lr")
    _positive(o.eps, "optim.eps")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(o, name) < 1:
            raise ConfigError(f"optim.{name}={getattr(o, name)} must be in [0, 1)")
    if o.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay={o.weight_decay} must be >= 0")
    if o.grad_clip is not None:
        _positive(o.grad_clip, "optim.grad_clip")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    if h.nproc_per_node is not None and h.nproc_per_node < 1:
        raise ConfigError(
            f"hardware.nproc_per_node={h.nproc_per_node} must be >= 1; set it to the ranks per node"
        )
    _positive(h.num_nodes, "hardware.num_nodes")
    _positive(h.timeout_s, "hardware.timeout_s")
    if h.flight_recorder < 0:
        raise ConfigError(f"hardware.flight_recorder={h.flight_recorder} must be >= 0 (0: off)")
    if h.threads_per_rank is not None:
        _positive(h.threads_per_rank, "hardware.threads_per_rank")
    limit = MALLOC_MMAP_THRESHOLD_MAX
    if h.malloc_mmap_threshold is not None and not 0 < h.malloc_mmap_threshold <= limit:
        raise ConfigError(
            f"hardware.malloc_mmap_threshold={h.malloc_mmap_threshold} must be 1 to {limit} "
            "bytes (32 MiB, glibc's limit), e.g. 131072; or null for glibc's own"
        )
    if h.peak_tflops is not None:
        _positive(h.peak_tflops, "hardware.peak_tflops")
    _positive(cfg.parallel.tensor, "parallel.tensor")
    _positive(h.time_limit_min, "hardware.time_limit_min")
    if cfg.wrap.policy is WrapPolicy.size:
        _positive(cfg.wrap.min_num_params, "wrap.min_num_params")
    _check_model(m)
    _check_data(cfg.data)
    _check_token_data(cfg)
    if t.eval_every < 0:
        raise ConfigError(f"trainer.eval_every={t.eval_every} must be >= 0 (0: no evaluation)")
    _positive(t.eval_batches, "trainer.eval_batches")
    _positive(t.log_every, "trainer.log_every")
    if cfg.loss.chunk_size is not None:
        _positive(cfg.loss.chunk_size, "loss.chunk_size")
    prefetch = cfg.sharding.prefetch
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
    if cfg.activation_checkpointing.every < 1:
        raise ConfigError(
            f"activation_checkpointing.every={cfg.activation_checkpointing.every} must be >= 1"
        )
    _check_checkpoint(cfg.checkpoint)
    _check_precision(cfg.precision)
    _check_finetune(cfg.finetune)
    raf = cfg.sharding.reshard_after_forward
    if raf is not None and not isinstance(raf, (bool, int)):
        raise ConfigError(
            f"sharding.reshard_after_forward={raf!r} must be true, false, an int or null"
        )
    if isinstance(raf, int) and not isinstance(raf, bool) and raf < 2:
        raise ConfigError(
            f"sharding.reshard_after_forward={raf} as an int must be >= 2 (use true or false)"
        )


def _check_model(m: ModelConfig) -> None:
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
    if (m.arch is ModelArch.bert) != (m.task is ModelTask.masked_lm):
        raise ConfigError(
            f"model.task={m.task.name} does not fit model.arch={m.arch.name}: the bert preset is "
            "masked_lm, the decoder presets are causal_lm; set model.task accordingly"
        )
    if m.vocab_size is not None:
        _positive(m.vocab_size, "model.vocab_size")
    for name in (
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "max_position_embeddings",
    ):
        _positive(getattr(m, name), f"model.{name}")
    if m.hidden_size % m.num_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} must be divisible by model.num_heads={m.num_heads}"
        )
    _check_experts(m)
    if m.arch is not ModelArch.gpt2:  # GPT-2 has no grouped-query attention or rotary
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


def _check_experts(m: ModelConfig) -> None:
    """A preset's experts: the MoE presets need some, a dense preset takes none."""
    if m.router_aux_loss_coef is not None and m.router_aux_loss_coef < 0:
        raise ConfigError(
            f"model.router_aux_loss_coef={m.router_aux_loss_coef} must be >= 0 (0: off, "
            "null: the model's default)"
        )
    if m.arch not in MOE_ARCHS:
        if m.num_experts:
            raise ConfigError(
                f"model.num_experts={m.num_experts} but model.arch={m.arch.name} is dense; use "
                "a mixture-of-experts preset (model=qwen3_moe_tiny, mixtral_tiny, olmoe_tiny)"
            )
        return
    _positive(m.num_experts, "model.num_experts")
    if not 1 <= m.experts_per_token <= m.num_experts:
        raise ConfigError(
            f"model.experts_per_token={m.experts_per_token} must be between 1 and "
            f"model.num_experts={m.num_experts}"
        )
    if m.expert_intermediate_size is not None:
        _positive(m.expert_intermediate_size, "model.expert_intermediate_size")


def is_hub_id(name: str) -> bool:
    """`org/name` or `name` with no path syntax: what the hub accepts and a path rarely is."""
    parts = name.split("/")
    return (
        len(parts) <= 2
        and all(parts)
        and not name.startswith((".", "~"))
        and all(c.isalnum() or c in "-_." for part in parts for c in part)
    )


def _check_data(d: DataConfig) -> None:
    if not isinstance(d.files, list) or not all(isinstance(f, str) for f in d.files):
        raise ConfigError(
            f"data.files={d.files!r} must be a path or a list of paths "
            "(data.files=corpus.txt, data.files=[a.txt,'b/*.txt'])"
        )
    if d.kind is DataKind.text and not d.files:
        raise ConfigError(
            "data=text needs data.files=[...] (paths or globs of .txt, .jsonl, "
            ".parquet or .csv files)"
        )
    if d.kind is DataKind.chat and not d.files:
        raise ConfigError(
            "data=chat needs data.files=[...] (paths or globs of .jsonl, .json or .parquet "
            "files of messages or prompt/completion rows)"
        )
    chat_only = ("layout", "messages_column", "prompt_column", "completion_column")
    chat_only += ("chat_template", "train_on", "packing", "overlong")
    default = DataConfig()
    changed = [f for f in chat_only if getattr(d, f) != getattr(default, f)]
    if d.kind is not DataKind.chat and changed:
        raise ConfigError(
            f"data.{changed[0]} applies to data=chat (conversations), not data={d.kind.value}; "
            f"drop it, or set data=chat"
        )
    if d.kind is DataKind.tokens and not d.files:
        raise ConfigError(
            "data=tokens needs data.files=[...] (paths or globs of .bin or .npy files)"
        )
    if d.kind is DataKind.hub and not d.name:
        raise ConfigError("data=hub needs data.name=<hub dataset name>")
    if d.streaming and d.kind is not DataKind.hub:
        raise ConfigError(
            f"data.streaming=true streams a hub dataset, not data={d.kind.value}; local files "
            "are read in bounded memory already: drop data.streaming"
        )
    if d.max_tokens is not None and not d.streaming:
        raise ConfigError(
            "data.max_tokens applies to data=hub data.streaming=true (it ends the stream); "
            "drop it, or stream the dataset"
        )
    if d.max_tokens is not None:
        _positive(d.max_tokens, "data.max_tokens")
    if d.num_proc is not None:
        _positive(d.num_proc, "data.num_proc")
    if d.eos_id is not None and d.eos_id < 0:
        raise ConfigError(f"data.eos_id={d.eos_id} must be a token id (>= 0)")
    if not 0 <= d.validation_fraction < 1:
        raise ConfigError(f"data.validation_fraction={d.validation_fraction} must be in [0, 1)")
    if not 0 < d.mlm_probability < 1:
        raise ConfigError(f"data.mlm_probability={d.mlm_probability} must be in (0, 1)")


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


def _check_finetune(f: FinetuneConfig) -> None:
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
    _positive(f.r, "finetune.r")
    _positive(f.alpha, "finetune.alpha")
    if not 0 <= f.dropout < 1:
        raise ConfigError(f"finetune.dropout={f.dropout} must be in [0, 1)")
    if f.target_modules is not None and not f.target_modules:
        raise ConfigError(
            "finetune.target_modules=[] names no module; list them (e.g. [q_proj,v_proj]) "
            "or set finetune.target_modules=null for PEFT's default"
        )
    if f.quantize_base is QuantizeBase.nf4:
        raise ConfigError(
            "finetune.quantize_base=nf4 (QLoRA) is not built: bitsandbytes' 4-bit weights are "
            "not FSDP2-aware and torchao's NF4Tensor route is unverified here; set "
            "finetune.quantize_base=none"
        )


def _check_precision(p: PrecisionConfig) -> None:
    if p.param_dtype is Dtype.fp16 and not p.grad_scaler_enabled:
        raise ConfigError(
            "precision.param_dtype=fp16 needs precision.grad_scaler_enabled=true "
            "(fp16 gradients underflow without loss scaling); or use precision=fp16"
        )


# Long: a table of (refused, message) rows, one per setting XLA cannot honour.
def refuse_for_xla(cfg: Config) -> None:
    """hardware=tpu: the settings torch_xla's SPMD FSDP has no equivalent for, refused."""
    s, p = cfg.sharding, cfg.precision
    instead = strategy_of(s.strategy).xla
    if instead is not s.strategy:
        raise ConfigError(
            f"sharding={s.strategy.name} on hardware=tpu: keeping gathered parameters from "
            "forward to backward is the XLA compiler's scheduling, not a setting; use "
            f"sharding={instead.name} (the same math and the same sharded state)"
        )
    refusals = (
        (
            s.reshard_after_forward is not None,
            f"sharding.reshard_after_forward="
            f"{s.reshard_after_forward}: the XLA compiler schedules re-gathering; remove it",
        ),
        (
            cfg.offload.device is not OffloadDevice.none,
            "offload=cpu: torch_xla SPMD keeps parameters on the TPU; use offload=none",
        ),
        (
            Dtype.fp16 in (p.param_dtype, p.reduce_dtype),
            "precision=fp16: TPUs compute in bf16, without loss scaling; use precision=bf16",
        ),
        (
            p.grad_scaler_enabled,
            "precision.grad_scaler_enabled=true: bf16 needs no loss "
            "scaling on XLA; set precision.grad_scaler_enabled=false",
        ),
        (
            p.reduce_dtype is Dtype.bf16,
            "precision.reduce_dtype=bf16 (precision=bf16_pure): XLA "
            "reduces gradients in their own dtype (fp32 master weights); use precision=bf16",
        ),
        (
            p.output_dtype is not None,
            "precision.output_dtype: autocast decides the output "
            "dtypes on XLA; set precision.output_dtype=null",
        ),
        (cfg.compile, "compile=true: XLA already compiles every step; set compile=false"),
        (
            s.prefetch.forward != 0 or s.prefetch.backward != 1,
            "sharding.prefetch: the XLA "
            "compiler schedules the all-gathers; remove sharding.prefetch.forward/backward",
        ),
        (
            cfg.optim.implementation is OptimImpl.fused,
            "optim.implementation=fused: XLA has no "
            "fused AdamW; use optim.implementation=foreach (or auto)",
        ),
        (
            not runs_on_xla(cfg.loss.kind),
            f"loss={cfg.loss.kind.name}: XLA "
            "compiles the model's own loss into the step; use loss=hf (or loss=auto)",
        ),
        (
            not format_row(cfg.checkpoint.format).on_xla,
            f"checkpoint={cfg.checkpoint.format.name}: use checkpoint="
            "sharded (torch_xla's distributed checkpoint; checkpoint.export_hf for whole weights)",
        ),
        (
            cfg.checkpoint.async_enabled,
            "checkpoint.async_enabled=true: XLA checkpoints are "
            "written synchronously; set checkpoint.async_enabled=false",
        ),
        (
            cfg.finetune.method is not FinetuneMethod.full,
            f"finetune={cfg.finetune.method.name}: frozen parameters and adapters are not "
            "verified on torch_xla; use finetune=full",
        ),
        (
            cfg.hardware.num_nodes != 1,
            f"hardware.num_nodes={cfg.hardware.num_nodes}: "
            "multi-host TPU slices are not supported yet; run on one TPU VM host",
        ),
    )
    for refused, message in refusals:
        if refused:
            raise ConfigError(f"hardware=tpu cannot run {message}")


def _check_parallel(cfg: Config, topo: Topology) -> int:
    """parallel.*: the TP degree, checked against the ranks and what TP combines with."""
    p = cfg.parallel
    if p.context != 1:
        raise ConfigError(
            f"parallel.context={p.context}: context parallelism is not supported (torch's "
            "context_parallel has no sharding strategy for CPU SDPA, so it cannot be verified "
            "here); set parallel.context=1"
        )
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
        (topo.device is HardwareKind.tpu, "hardware=tpu (torch_xla shards by annotation)"),
        (
            cfg.finetune.method is FinetuneMethod.lora,
            "finetune=lora (PEFT wraps q_proj as q_proj.base_layer: the TP plan no longer "
            "matches it)",
        ),
    )
    for refused, what in refusals:
        if refused:
            raise ConfigError(f"parallel.tensor={tensor} cannot combine with {what} yet")
    return tensor


def _check_expert(cfg: Config, topo: Topology) -> None:
    """parallel.expert: a divisor of the shard axis, refused with the settings it was not
    verified with (docs/sharding-and-precision.md lists what was); the model's side (an MoE, an
    expert count the degree divides) is checked on its structure (launch.prepare)."""
    expert, s = cfg.parallel.expert, cfg.sharding
    raf = s.reshard_after_forward
    _positive(expert, "parallel.expert")
    if expert == 1:
        return
    refusals = (
        (cfg.parallel.tensor > 1, f"parallel.tensor={cfg.parallel.tensor}"),
        (topo.device is HardwareKind.tpu, "hardware=tpu"),
        (
            s.strategy.name not in ("full", "grad_op", "hybrid", "hybrid_zero2"),
            f"sharding={s.strategy.name} (verified: full, grad_op, hybrid, hybrid_zero2)",
        ),
        (
            isinstance(raf, int) and not isinstance(raf, bool),
            f"sharding.reshard_after_forward={raf} (an int)",
        ),
        (cfg.compile, "compile=true (the all-to-all's split sizes are data-dependent)"),
        (cfg.offload.device is not OffloadDevice.none, f"offload={cfg.offload.device.name}"),
        (
            cfg.finetune.method is not FinetuneMethod.full,
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
    if d.kind is DataKind.chat and m.task is not ModelTask.causal_lm:
        raise ConfigError(
            f"data=chat trains a causal LM on replies; model.task={m.task.value} predicts "
            "masked tokens: use data=text for it, or a causal LM"
        )
    if d.kind is DataKind.tokens and d.tokenizer is None and m.arch and m.vocab_size is None:
        raise ConfigError(
            f"data=tokens with model={m.arch.value}: model.vocab_size is null and there is no "
            "tokenizer to take it from; set model.vocab_size (above the largest token id, e.g. "
            "50304 for GPT-2's) or data.tokenizer"
        )


def validate(cfg: Config, topo: Topology) -> None:
    """Cross-field rules that need the topology; raises ConfigError naming the setting and fix."""
    s = cfg.sharding
    if topo.device is HardwareKind.tpu:
        refuse_for_xla(cfg)
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
    tensor = _check_parallel(cfg, topo)
    dp = dp_size(topo, tensor)
    ranks = f"{dp} data-parallel ranks" if tensor > 1 else f"{dp} ranks"
    replicate = replicate_size(s, topo, tensor)
    if hybrid:
        if replicate < 1 or dp % replicate:
            raise ConfigError(
                f"sharding.replicate_size={replicate} does not divide the "
                f"{ranks if tensor > 1 else f'world size {dp}'}; set sharding.replicate_size "
                "to a divisor of it"
            )
        if dp // replicate < 2:
            more = (
                "4+ XLA devices (PJRT_DEVICE=CPU CPU_NUM_DEVICES=4, or a larger TPU)"
                if topo.device is HardwareKind.tpu
                else "4+ ranks (hardware.nproc_per_node=4)"
            )
            raise ConfigError(
                f"sharding={s.strategy.name} on {ranks} with replicate_size="
                f"{replicate} leaves shard groups of 1 rank; use {more}, a smaller "
                "sharding.replicate_size, or sharding=full"
            )
    raf = s.reshard_after_forward
    if isinstance(raf, int) and not isinstance(raf, bool):
        shard_size = dp // replicate
        if shard_size % raf or raf >= shard_size:
            raise ConfigError(
                f"sharding.reshard_after_forward={raf} must be a proper divisor of the shard "
                f"axis size {shard_size}; use true, false or a divisor"
            )
