"""One rank of a run: the ordered recipe from a resolved config to a trained, sharded model.

Started by the launcher as ``python -m fsdp_lab.rank_main RUN_DIR`` (local spawn: it reads
RUN_DIR/config.yaml, the config the parent composed and validated) or called in-process under
torchrun. Either way it ends with ``os._exit``: interpreter shutdown after
``destroy_process_group`` sometimes aborts ("terminate called without an active exception").
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import transformers

from fsdp_lab import corpus as corpus_lib, hardware, loss as loss_lib, metrics
from fsdp_lab import model as model_lib, precision, sharding, slurm
from fsdp_lab.preempt import EXIT_CODE as PREEMPTED_EXIT_CODE, Preempted, StopFlag
from fsdp_lab.checkpoint import Checkpointer, checkpoint_root
from fsdp_lab.config import Config, DataKind, HardwareKind, LossKind, ModelTask, to_container
from fsdp_lab.rules import Topology, validate
from fsdp_lab.data import build_data
from fsdp_lab.loggers import MetricsWriter, Progress, RunSummary, setup_rank_logging
from fsdp_lab.loop import evaluate, train
from fsdp_lab.optim import build_optimizer, build_scheduler, resolve_implementation
from fsdp_lab.rundir import (HF_EXPORT_DIR, LOG_DIR, METRICS_FILE, RUN_FILE, error_file,
                             read_run_file, update_run_file, write_run_file)
from fsdp_lab.wandb_logger import WandbLogger

log = logging.getLogger("fsdp_lab")



def topology_from_env(kind) -> Topology:
    """The data-parallel ranks: the processes, or on tpu the XLA devices of the one process."""
    if kind is HardwareKind.tpu:
        n = hardware.xla_runtime_devices()
        return Topology(world_size=n, nproc_per_node=n, num_nodes=1, device=kind)
    world = int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return Topology(world_size=world, nproc_per_node=per_node, num_nodes=world // per_node,
                    device=kind)


def run(cfg: Config, run_dir: Path, *, early_signals: list[int] | None = None) -> None:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    setup_rank_logging(run_dir / LOG_DIR, rank)
    t0 = time.perf_counter()
    stop = StopFlag(early_signals)  # a signal during set-up is acted on at the first boundary

    # 1) Device, threads and the process group (under torchrun the launcher already joined it).
    kind = hardware.resolve_kind(cfg.hardware)
    device = hardware.rank_device(kind, local_rank)
    topo = topology_from_env(kind)
    threads = hardware.set_threads(cfg.hardware,
                                   hardware.processes_per_node(kind, topo.nproc_per_node))
    if not dist.is_initialized():
        hardware.init_process_group(kind, device, cfg.hardware.timeout_s)
    procs = dist.get_world_size()  # processes; on tpu one per host, each driving its devices
    validate(cfg, topo)
    hardware.set_tf32(kind, cfg.precision.tf32)
    torch.manual_seed(cfg.seed)

    # 2) The model's structure on meta: no memory is spent before sharding decides the layout.
    task = cfg.model.task
    hf_config = model_lib.build_hf_config(cfg.model)
    model = model_lib.build_meta_model(hf_config, task)
    total_params = sum(p.numel() for p in model.parameters())
    model_class = type(model).__name__  # before fully_shard renames it FSDP<name>
    flops_per_token = metrics.flops_per_token(model, hf_config, cfg.trainer.seq_len)
    peak_flops = hardware.peak_flops(cfg.hardware, kind, cfg.precision.param_dtype,
                                     tf32=cfg.precision.tf32)
    # The loss: a fused one replaces the meta model's forward before it is sharded.
    loss = loss_lib.build_loss(cfg.loss, model, task=task, compiled=cfg.compile,
                               kind=loss_lib.resolve_kind(cfg.loss, hf_config, task, kind,
                                                          compiled=cfg.compile))

    # 3)-5) The engine (FSDP2, or torch_xla SPMD on tpu) picks the units, checkpoints and
    # compiles them, shards them on the strategy's mesh with the dtype and offload policies,
    # and fills the shards: rank 0 builds the full model (seeded random init, or the pretrained
    # weights) and it reaches every rank's shards. No rank holds the full model on FSDP2.
    if cfg.model.pretrained:
        def source():
            return model_lib.load_pretrained(cfg.model.name_or_path, task)
    else:
        def source():
            return model_lib.build_full_model(hf_config, seed=cfg.seed, task=task)
    if kind is HardwareKind.tpu:
        from fsdp_lab import xla_sharding as engine
    else:
        engine = sharding
    sharded = engine.build_model(cfg, topo, device, meta_model=model, source=source)
    model = sharded.model
    load_rss = [None] * procs
    dist.all_gather_object(load_rss, hardware.host_peak_rss_bytes())

    # 6) This rank's share of every global batch (all ranks are data-parallel ranks). The
    # launcher tokenised and cached the corpus; here it is memory-mapped from the cache.
    t = cfg.trainer
    tokenizer = corpus_lib.load_tokenizer(cfg)
    corpus = None if cfg.data.kind is DataKind.synthetic else corpus_lib.prepare(cfg, tokenizer)
    ranks_here = topo.world_size // procs  # data-parallel ranks this process feeds
    data = build_data(cfg, corpus=corpus, tokenizer=tokenizer, vocab_size=hf_config.vocab_size,
                      dp_size=topo.world_size, dp_rank=rank * ranks_here, local_ranks=ranks_here)
    tokens_per_step = topo.world_size * t.micro_batch_size * t.grad_accum_steps * t.seq_len
    eval_batches = data.num_val_batches(t.eval_batches) if t.eval_every else 0

    # 7) Optimizer over the sharded params (its state is sharded with them), schedule, scaler.
    optim_impl = resolve_implementation(cfg.optim, kind,
                                        grad_scaler=cfg.precision.grad_scaler_enabled)
    optimizer = build_optimizer(model, cfg.optim, implementation=optim_impl)
    scheduler = build_scheduler(optimizer, cfg.optim, max_steps=t.max_steps)
    scaler = precision.build_grad_scaler(cfg.precision, device)

    # 8) Resume: the launcher resolved cfg.resume to a checkpoint path or "never".
    checkpointer = Checkpointer(cfg.checkpoint, checkpoint_root(cfg.checkpoint, run_dir),
                                model=model, optimizer=optimizer, scheduler=scheduler,
                                scaler=scaler, config=to_container(cfg), device=device,
                                data=data, io=sharded.checkpoint_io)
    assert cfg.resume != "auto", "the launcher resolves resume=auto before workers start"
    start_step = tokens_seen = 0
    if cfg.resume != "never":
        restored = checkpointer.load(Path(cfg.resume))
        start_step, tokens_seen = restored.step, restored.tokens_seen
        data.restore(restored.data_state, start_step)

    numels = sharded.local_numels()
    facts = {
        "world_size": topo.world_size, "num_nodes": topo.num_nodes,
        "hardware": hardware.describe(kind), "backend": hardware.backend(kind),
        "threads_per_rank": threads,
        "mesh_shape": sharded.mesh_shape, "mesh_axes": sharded.mesh_axes,
        "fsdp_units": sharded.units_desc, "num_fsdp_units": sharded.num_units,
        "model_class": model_class, "total_params": total_params,
        "local_params_per_rank": numels, "tokens_per_step": tokens_per_step,
        "task": task.name, "pretrained": cfg.model.pretrained,
        "load_peak_rss_bytes_per_rank": load_rss,
        "activation_checkpointing": sharded.checkpointed,
        "compiled": cfg.compile, "loss_kind": loss.kind.name,
        "optimizer": f"AdamW ({optim_impl.name})",
        "data": ({"train_blocks": len(corpus.train), "val_blocks": len(corpus.val),
                  "tokens": corpus.num_tokens, "documents": corpus.num_documents,
                  "fingerprint": corpus.fingerprint, "tokenizer": type(tokenizer).__name__}
                 if corpus is not None else {"kind": cfg.data.kind.name}),
        "resumed_from": None if cfg.resume == "never" else cfg.resume, "start_step": start_step,
        "torch": torch.__version__,
    }
    facts["flops_per_token"], facts["peak_flops"] = flops_per_token, peak_flops
    facts["transformers"] = transformers.__version__
    if sharded.param_specs is not None:
        facts["param_sharding"] = sharded.param_specs
    writer = progress = tracker = None
    summary = RunSummary()
    logged_through = -1  # W&B already has the steps up to here (a resumed run's)
    if rank == 0:
        log.info("%s | %d ranks, mesh %s %s | units: %s | %s params (%s per rank)",
                 facts["hardware"], topo.world_size, facts["mesh_axes"], facts["mesh_shape"],
                 facts["fsdp_units"], f"{total_params:,}", [f"{n:,}" for n in numels])
        log.info("loss=%s%s | optimizer %s | numbers read from the device every %d steps",
                 loss.kind.name, " (loss=auto)" if cfg.loss.kind is LossKind.auto else "",
                 facts["optimizer"], t.log_every)
        if topo.world_size == 1 and kind is not HardwareKind.tpu:
            log.info("world size 1: FSDP2 on a 1-rank mesh, nothing sharded; its all-gathers and "
                     "reduce-scatters are local copies, kept so that precision (param_dtype "
                     "copies, fp32 master weights) and checkpoints are those of a sharded run")
        claimed = read_run_file(run_dir)  # the launcher's: the job, a resumed run's W&B id
        continuing = cfg.resume != "never" and "wandb" in claimed
        logged_through = claimed.get("logged_through_step", -1) if continuing else -1
        facts["job"] = claimed.get("job")
        tracker = WandbLogger.start(cfg, run_dir, facts=facts, job=facts["job"],
                                    resume_id=claimed["wandb"]["id"] if continuing else None)
        if tracker is not None:
            facts["wandb"] = tracker.info
        write_run_file(run_dir, {**facts, "status": "running"})
        writer = MetricsWriter(run_dir / METRICS_FILE)
        progress = Progress(t.max_steps, enabled=t.progress_bar, initial=start_step)
    saved_step = start_step if cfg.resume != "never" else -1
    # The steps' peak memory is theirs: not the weight loading's, nor W&B's start on rank 0.
    hardware.reset_peak_memory(device)
    before = [None] * procs
    dist.all_gather_object(before, hardware.current_memory_bytes(device))
    facts["memory_before_train_bytes_per_rank"] = before

    def measure_state(opt, args, kwargs) -> None:  # once, after the first optimizer step
        facts["state_bytes_per_rank"] = sharded.state_bytes(optimizer)
        state_hook.remove()
    state_hook = optimizer.register_step_post_hook(measure_state)

    def emit(record: dict) -> None:  # rank 0: metrics.jsonl, the summary, W&B
        writer.write(record)
        summary.add(record)
        if tracker is not None and record["step"] > logged_through:
            tracker.log(record)

    def run_eval(step: int) -> None:
        result = evaluate(model, data, loss=loss, num_batches=eval_batches, device=device,
                          place=sharded.place_batch)
        if rank == 0:
            record = {"split": "val", "step": step, "val_loss": result.loss,
                      "val_ppl": result.perplexity, "val_tokens": result.tokens,
                      "eval_time_s": result.time_s}
            emit(record)
            log.info("step %d: validation loss %.4f, perplexity %.2f (%d tokens)",
                     step, result.loss, result.perplexity, result.tokens)

    def evaluates_at(step: int) -> bool:
        return bool(eval_batches) and (step % t.eval_every == 0 or step == t.max_steps)

    def on_records(records) -> None:  # rank 0: every step of a logging window
        if rank != 0:
            return
        for m in records:
            record = {"split": "train", **m.as_record(), **metrics.throughput(
                m, world_size=topo.world_size, flops_per_token=flops_per_token,
                peak_flops=peak_flops)}
            emit(record)
            progress.update(record)

    def on_boundary(step: int) -> None:  # every rank, after the window's records
        nonlocal saved_step
        if evaluates_at(step):
            run_eval(step)
        checkpointer.poll()
        if checkpointer.should_save(step):
            checkpointer.save(step, tokens_seen + (step - start_step) * tokens_per_step)
            saved_step = step

    # 9) The loop; a preemption signal ends it at the next logging boundary on every rank. A fresh
    # run is evaluated first: the starting point (a pretrained model's) is a number too.
    try:
        if eval_batches and start_step == 0:
            run_eval(0)
        last, preempted = train(
            model, data=data, loss=loss, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
            grad_clip=cfg.optim.grad_clip, start_step=start_step, max_steps=t.max_steps,
            grad_accum_steps=t.grad_accum_steps, tokens_per_step=tokens_per_step, device=device,
            place=sharded.place_batch, log_every=t.log_every,
            boundary_at=lambda step: evaluates_at(step) or checkpointer.should_save(step),
            on_records=on_records, on_boundary=on_boundary, stop_requested=stop)
        end_step = last.step if last is not None else start_step
        if rank == 0:
            progress.close()
            writer.close()
        _finish(cfg, run_dir, rank, model=model, checkpointer=checkpointer, facts=facts,
                summary=summary, tracker=tracker, preempted=preempted, saved_step=saved_step,
                end_step=end_step,
                tokens_seen=tokens_seen + (end_step - start_step) * tokens_per_step,
                stop=stop, export=lambda: _export(sharded, hf_config, run_dir / HF_EXPORT_DIR, rank,
                                                  task=task, tokenizer=tokenizer,
                                                  preset=cfg.model.arch is not None),
                t0=t0)
    except BaseException:
        if tracker is not None:
            tracker.finish(status="failed", summary=summary.as_dict())
        raise


def _finish(cfg: Config, run_dir: Path, rank: int, *, model, checkpointer, facts, summary,
            tracker, preempted: bool, saved_step: int, end_step: int, tokens_seen: int, stop,
            export, t0: float) -> None:
    """10) The final (or preemption) checkpoint, the Hugging Face export, run.json and W&B's
    summary."""
    if checkpointer.enabled and saved_step != end_step:
        checkpointer.save(end_step, tokens_seen, blocking=True)
    checkpointer.wait()
    if not preempted and cfg.checkpoint.export_hf:
        export()
    if rank != 0:
        if preempted:
            raise Preempted(f"stopped after step {end_step}")
        return
    status = "preempted" if preempted else "completed"
    results = {**summary.as_dict(), "total_time_s": time.perf_counter() - t0}
    write_run_file(run_dir, {**facts, "status": status, "step": end_step, **results})
    if tracker is not None:
        tracker.finish(status=status, summary={**results, "step": end_step})
    if preempted:
        log.info("stopped by signal %s after step %d", stop.signal, end_step)
        if slurm.requeue_for_submitit(stop.signal):
            log.info("requeued the SLURM job: it resumes from step %d", end_step)
        raise Preempted(f"stopped after step {end_step}")
    final_loss = results["final_loss"]
    log.info("done: step %d/%d, final loss %s, run dir %s", end_step, cfg.trainer.max_steps,
             f"{final_loss:.4f}" if final_loss is not None else "-", run_dir)


def _export(sharded, hf_config, out_dir: Path, rank: int, *, task: ModelTask, tokenizer,
            preset: bool) -> None:
    """Gather the full weights to rank 0's CPU (every rank takes part) and write them there."""
    from fsdp_lab.export import export_hf

    sd = sharded.full_state_dict()
    if rank == 0:
        export_hf(sd, hf_config, out_dir, replace=True, task=task,  # this run's own export
                  tokenizer=tokenizer, preset=preset)
        log.info("exported Hugging Face model: %s", out_dir)
    dist.barrier()


def run_and_exit(cfg: Config, run_dir: Path, *, early_signals: list[int] | None = None,
                 exit_process: bool = True) -> int:
    """Run this rank; on failure leave a one-line error for the launcher. Never returns, unless
    ``exit_process`` is false (a submitit job, whose own code must record the end): then the
    exit code."""
    code = 0
    try:
        run(cfg, run_dir, early_signals=early_signals)
    except Preempted:
        code = PREEMPTED_EXIT_CODE
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher
        code = 130 if isinstance(e, KeyboardInterrupt) else 1
        rank = int(os.environ.get("RANK", 0))
        logging.getLogger("fsdp_lab").error("rank %d failed", rank, exc_info=True)
        path = error_file(run_dir, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        line = traceback.format_exception_only(type(e), e)[-1].strip()
        path.write_text(json.dumps({"rank": rank, "time": time.time(), "error": line}))
        if rank == 0 and (run_dir / RUN_FILE).is_file():  # the launcher refines it to the cause
            update_run_file(run_dir, status="failed", error=f"rank 0: {line}")
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group cannot block the exit
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        if exit_process:
            logging.shutdown()
            os._exit(code)
    return code
