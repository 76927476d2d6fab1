"""Step 2 of a rank's run: the train state, everything the loop trains and a checkpoint holds.

In order: the model's structure on meta and its loss, the engine that shards and fills it, this
rank's data, the optimizer over the shards, and the resume from a checkpoint. Every rank builds
the same state; only the shards and the data rows differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp_lab.config import (
    Config,
    HardwareKind,
    ModelTask,
    OptimImpl,
    WeightLoading,
    to_container,
)
from fsdp_lab.config.data_kinds import kind_row
from fsdp_lab.config.hardware_kinds import Engine, hardware_row
from fsdp_lab.config.pipeline import splits_backward
from fsdp_lab.config.topology import Topology, dp_size, stage_topology
from fsdp_lab.data import corpus as corpus_lib
from fsdp_lab.data.context import ContextShare
from fsdp_lab.data.loader import Loader, build_data
from fsdp_lab.engine import conversion, finetune, fsdp, loading, precision
from fsdp_lab.engine import model as model_lib
from fsdp_lab.engine.hardware import devices, flops, memory, process_group
from fsdp_lab.engine.sharded import ShardedModel
from fsdp_lab.observe import metrics
from fsdp_lab.state.checkpoint import Checkpointer, FrozenBase, checkpoint_root
from fsdp_lab.train import loss as loss_lib
from fsdp_lab.train.evaluation import BoundaryEvals
from fsdp_lab.train.generate import Lockstep
from fsdp_lab.train.optim import build_optimizer, build_scheduler, resolve_implementation


@dataclass(frozen=True)
class RankContext:
    """Step 1's result: who this rank is and where it runs."""

    rank: int
    kind: HardwareKind  # cpu, gpu or tpu, never auto
    device: torch.device
    topo: Topology
    procs: int  # processes in the group; on tpu one per host, each driving its devices
    threads: int  # intra-op threads of this rank


@dataclass(frozen=True)
class ModelFacts(model_lib.ModelCounts):
    """What the model is (``ModelCounts``) and what a run derives from it."""

    hf_config: object
    task: ModelTask
    flops_per_token: int
    peak_flops: float | None
    load_rss: list  # each process's host peak RSS after the weights reached the shards


@dataclass
class TrainState:
    facts: ModelFacts  # what the run knows of its model (the sharded model is ``sharded``)
    sharded: ShardedModel
    loss: loss_lib.Loss
    tokenizer: object | None
    corpus: corpus_lib.Corpus | None  # None: synthetic data
    data: Loader
    optim_impl: OptimImpl
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object | None
    checkpointer: Checkpointer
    start_step: int
    tokens_seen: int  # before start_step (a resumed run's)
    tokens_per_step: int  # every position of every row of a global batch (throughput, MFU)
    eval_batches: int  # per evaluation; 0: no evaluation
    evals: BoundaryEvals | None = None  # generations and harness scores (eval.*); None: neither


# Long: the state's pieces in the order each needs the ones before it.
def build_train_state(cfg: Config, ctx: RankContext, run_dir: Path) -> TrainState:
    """Every rank builds the same state; only its shards and its rows of the data differ."""
    facts, meta_model, loss = _model_on_meta(cfg, ctx)
    sharded = _shard_and_fill(cfg, ctx, meta_model, facts.hf_config, loss)
    load_rss = process_group.gather_from_processes(memory.host_peak_rss_bytes())
    facts = dataclasses.replace(facts, load_rss=load_rss)
    tokenizer, corpus, data = _rank_data(cfg, ctx, facts.hf_config.vocab_size)
    # The optimizer over the sharded params (its state is sharded with them), schedule, scaler.
    t, topo = cfg.trainer, ctx.topo
    optim_impl = resolve_implementation(
        cfg.optim, ctx.kind, grad_scaler=cfg.precision.grad_scaler_enabled
    )
    optimizer = build_optimizer(sharded.model, cfg.optim, implementation=optim_impl)
    scheduler = build_scheduler(optimizer, cfg.optim, max_steps=t.max_steps)
    scaler = precision.build_grad_scaler(cfg.precision, ctx.device)
    checkpointer = Checkpointer(
        cfg.checkpoint,
        checkpoint_root(cfg.checkpoint, run_dir),
        model=sharded.model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        config=to_container(cfg),
        device=ctx.device,
        data=data,
        io=sharded.checkpoint_io,
        frozen=FrozenBase.of(cfg, sharded),
    )
    state = TrainState(
        facts=facts,
        sharded=sharded,
        loss=loss,
        tokenizer=tokenizer,
        corpus=corpus,
        data=data,
        optim_impl=optim_impl,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        checkpointer=checkpointer,
        start_step=0,
        tokens_seen=0,
        tokens_per_step=dp_size(
            stage_topology(topo, cfg.parallel.pipeline),
            cfg.parallel.tensor,
            context=cfg.parallel.context,
        )
        * t.micro_batch_size
        * t.grad_accum_steps
        * t.seq_len,
        eval_batches=data.num_val_batches(t.eval_batches) if t.eval_every else 0,
    )
    state.evals = BoundaryEvals.of(
        cfg,
        tokenizer,
        facts.hf_config,
        Lockstep(rank=data.dp_rank, size=data.dp_size, device=ctx.device),
    )
    _resume(cfg, state)
    return state


def _rank_data(cfg: Config, ctx: RankContext, vocab_size: int):
    """This rank's share of every global batch (its data-parallel rank's rows; under CP its
    chunks of them). The launcher tokenised and cached the corpus; here it is memory-mapped
    from the cache."""
    tokenizer = corpus_lib.load_tokenizer(cfg)
    corpus = (
        None
        if not kind_row(cfg.data.kind).prepared
        else corpus_lib.prepare(cfg, tokenizer, vocab_size=vocab_size)
    )
    ranks_here = ctx.topo.world_size // ctx.procs  # data-parallel ranks this process feeds
    # A TP group (contiguous ranks) reads the same rows; so does a CP group (the next
    # contiguous ranks: the context axis comes before tp), each rank its chunks of them. The
    # stages of a pipeline (the outermost axis) read the same rows too.
    tensor, context = cfg.parallel.tensor, cfg.parallel.context
    stage = stage_topology(ctx.topo, cfg.parallel.pipeline)
    data = build_data(
        cfg,
        corpus=corpus,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        dp_size=dp_size(stage, tensor, context=context),
        dp_rank=ctx.rank % stage.world_size * ranks_here // (tensor * context),
        local_ranks=ranks_here,
        context=ContextShare(context, ctx.rank // tensor % context) if context > 1 else None,
    )
    return tokenizer, corpus, data


def _model_on_meta(
    cfg: Config, ctx: RankContext
) -> tuple[ModelFacts, torch.nn.Module, loss_lib.Loss]:
    """The model's structure on meta (no memory is spent before sharding decides the layout),
    built for the loss it computes (a fused loss's model and head are subclasses of theirs),
    and that loss."""
    task = cfg.model.task
    hf_config = model_lib.build_hf_config(cfg.model)
    model, loss = loss_lib.meta_model_with_loss(
        cfg,
        hf_config,
        loss_lib.resolve_loss(
            cfg.loss,
            hf_config,
            task,
            ctx.kind,
            compiled=cfg.compile,
            split_backward=splits_backward(cfg.parallel),
        ),
        tp_ranks=cfg.parallel.tensor,
        sequences_split=cfg.parallel.context > 1,
        compute_dtype=devices.TORCH_DTYPES[cfg.precision.param_dtype],
    )
    facts = ModelFacts(
        **model_lib.count_model(model),
        hf_config=hf_config,
        task=task,
        flops_per_token=metrics.flops_per_token(model, hf_config, cfg.trainer.seq_len),
        peak_flops=flops.peak_flops(
            cfg.hardware, ctx.kind, cfg.precision.param_dtype, tf32=cfg.precision.tf32
        ),
        load_rss=[],
    )
    return facts, model, loss


def _shard_and_fill(
    cfg: Config, ctx: RankContext, meta_model: torch.nn.Module, hf_config, loss=None
) -> ShardedModel:
    """The engine (FSDP2, or torch_xla SPMD on tpu) picks the units, checkpoints and compiles
    them, shards them on the strategy's mesh with the dtype and offload policies, and fills the
    shards: on FSDP2 each rank its own (``engine.loading``), so no process holds the whole
    model; torch_xla's engine places a whole host model."""
    task, path = cfg.model.task, cfg.model.name_or_path if cfg.model.pretrained else None

    def whole():  # the model on rank 0: model.loading=rank0, and checkpoints per rank can't read
        if path is None:  # the seeded init: the same bits as per rank
            return model_lib.full_model(
                hf_config, seed=cfg.seed, task=task, finetune_cfg=cfg.finetune
            )
        full = model_lib.load_pretrained(path, task)  # transformers' own read
        finetune.apply(full, cfg.finetune)  # the same parameters as on meta
        loading.init_groups(full, cfg.seed, wanted=conversion.is_adapter, hf_init=False)
        return full

    if hardware_row(ctx.kind).engine is Engine.xla:
        from fsdp_lab.engine import xla

        return xla.build_model(cfg, ctx.topo, ctx.device, meta_model=meta_model, source=whole)
    source = loading.InitialWeights(
        seed=cfg.seed,
        pretrained=path,
        whole=whole,
        per_rank=cfg.model.loading is WeightLoading.per_rank,
    )
    return fsdp.build_model(
        cfg, ctx.topo, ctx.device, meta_model=meta_model, source=source, loss=loss
    )


def _resume(cfg: Config, state: TrainState) -> None:
    """The launcher resolved cfg.resume to a checkpoint path or "never"."""
    if cfg.resume == "auto":
        raise RuntimeError(
            "resume=auto reached a rank: the launcher resolves it before workers "
            "start (launch.prepare.prepare_run)"
        )
    if cfg.resume == "never":
        return
    restored = state.checkpointer.load(Path(cfg.resume))
    state.start_step, state.tokens_seen = restored.step, restored.tokens_seen
    state.data.restore(restored.data_state, state.start_step)
