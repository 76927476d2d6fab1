"""One rank of a run, in named steps: join -> build the train state -> fit -> finish.

``run_rank`` is called by ``launch.rank_main`` in a rank our local launcher started (spawned
as ``python -m fsdp_lab.launch.rank_main RUN_DIR PORT_FD``, or forked), or by
``launch.external`` in a rank torchrun, srun or submitit started. Who started it
(``preempt.Launched``) decides who checked the config, who reports a failure and how the
process ends.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp_lab.config import Config, ConfigError, HardwareKind
from fsdp_lab.config.hardware_kinds import hardware_row
from fsdp_lab.config.model import method_row
from fsdp_lab.config.precisions import dtype_row
from fsdp_lab.config.rules import validate
from fsdp_lab.config.topology import Topology
from fsdp_lab.engine.hardware import devices, flops, memory, process_group
from fsdp_lab.observe import flight, heartbeat
from fsdp_lab.observe.profile.recorder import WindowProfiler
from fsdp_lab.observe.run_logs import setup_rank_logging
from fsdp_lab.observe.rundir import HF_EXPORT_DIR, LOG_DIR, RUN_FILE, error_file, update_run_file
from fsdp_lab.state.export import ExportTarget, export_model
from fsdp_lab.train.build import RankContext, TrainState, build_train_state
from fsdp_lab.train.loop import LoopSetup, NonFiniteLoss, tokens_seen, train
from fsdp_lab.train.preempt import EXIT_CODE as PREEMPTED_EXIT_CODE
from fsdp_lab.train.preempt import Launched, Preempted, StopFlag
from fsdp_lab.train.reporter import Reporter, RunFacts, collect_facts

log = logging.getLogger("fsdp_lab")


@dataclass
class RankRun:
    """One rank's run, as the steps after ``join`` pass it along."""

    cfg: Config
    run_dir: Path
    ctx: RankContext
    state: TrainState
    facts: RunFacts
    reporter: Reporter | None  # rank 0 only
    stop: StopFlag
    started: float  # perf_counter at the start


@dataclass(frozen=True)
class FitResult:
    end_step: int
    preempted: bool  # stopped early by a signal, on every rank after the same step
    saved_step: int  # the last step a checkpoint was written at; -1: none


def run_rank(
    cfg: Config, run_dir: Path, launched: Launched, *, early_signals: list[int] | None = None
) -> int:
    """This rank's run, in named steps: join, build the train state, fit, finish. A failure
    leaves a one-line error for the launcher. Ends the process (``os._exit``), unless
    ``launched`` is submitit: then it returns the exit code, and a preemption is raised
    (``Preempted``, checkpoint written) for submitit's job to requeue itself.
    ``early_signals``: preemption signals that came while the rank started up."""
    code, preempted, reporter = 0, None, None
    try:
        started, rank = time.perf_counter(), int(os.environ["RANK"])
        setup_rank_logging(run_dir / LOG_DIR, rank)
        stop = StopFlag(early_signals)  # a signal during set-up is acted on at the first boundary
        ctx = join(cfg, run_dir / LOG_DIR, checked=launched.checked(rank))  # 1) device, group
        state = build_train_state(cfg, ctx, run_dir)  # 2) model, loss, data, optimizer, resume
        if (beat := heartbeat.current()) is not None:
            beat.step_done(state.start_step)
        facts = collect_facts(cfg, ctx, state)
        reporter = Reporter.start(cfg, run_dir, facts, ctx, state) if rank == 0 else None
        rank_run = RankRun(cfg, run_dir, ctx, state, facts, reporter, stop, started)
        result = fit(rank_run)  # 3) the loop, with its evaluations and checkpoints
        finish(rank_run, result)  # 4) last checkpoint, export, run.json, the trackers' summary
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher
        if reporter is not None:
            reporter.fail()
        if isinstance(e, Preempted):
            code, preempted = PREEMPTED_EXIT_CODE, e
        else:
            code = 130 if isinstance(e, KeyboardInterrupt) else 1
            _record_failure(run_dir, e, launcher_reports=launched.launcher_reports)
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # a broken group cannot block the exit
                dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        if launched.exits:
            logging.shutdown()
            os._exit(code)
    if preempted is not None:
        raise preempted
    return code


def topology_from_env(kind: HardwareKind) -> Topology:
    """The data-parallel ranks: the processes, or on tpu the XLA devices of the one process."""
    if hardware_row(kind).one_process_per_host:
        return Topology.nodes(devices.xla_runtime_devices(), 1, kind)
    return Topology.from_launcher(os.environ, kind)


def join(cfg: Config, log_dir: Path, *, checked: bool = False) -> RankContext:
    """Device, threads and the process group (under torchrun the launcher already joined it);
    the topology's rules checked here unless they were (``checked``: ``Launched.checked``).
    ``log_dir``: where a flight recorder dump of this rank goes."""
    kind = devices.resolve_kind(cfg.hardware)
    device = devices.rank_device(kind, int(os.environ.get("LOCAL_RANK", 0)))
    topo = topology_from_env(kind)
    threads = devices.set_threads(
        cfg.hardware, devices.processes_per_node(kind, topo.nproc_per_node)
    )
    memory.set_host_allocator(cfg.hardware)
    flight.clear(log_dir, int(os.environ["RANK"]))
    process_group.set_flight_recorder(cfg.hardware.flight_recorder, flight.watchdog_prefix(log_dir))
    if not dist.is_initialized():
        process_group.init_process_group(kind, device, cfg.hardware.timeout_s, cfg.hardware.backend)
    if dist.get_world_size() > 1:  # so a timeout can name the rank that stopped
        heartbeat.start(dist.get_rank())
    if not checked:
        validate(cfg, topo)
    flops.set_tf32(kind, cfg.precision.tf32)
    torch.manual_seed(cfg.seed)
    return RankContext(
        rank=int(os.environ["RANK"]),
        kind=kind,
        device=device,
        topo=topo,
        procs=dist.get_world_size(),
        threads=threads,
    )


def fit(r: RankRun) -> FitResult:
    """The loop, with its evaluations and checkpoints; a preemption signal ends it at the next
    logging boundary on every rank."""
    cfg, ctx, state = r.cfg, r.ctx, r.state
    # The steps' peak memory is theirs: not the weight loading's, nor the trackers' start on rank 0.
    memory.reset_peak_memory(ctx.device)
    before = process_group.gather_from_processes(memory.current_memory_bytes(ctx.device))
    if r.reporter is not None:
        r.reporter.record(memory_before_train_bytes_per_rank=before)

    def measure_state(opt, args, kwargs) -> None:  # once, after the first optimizer step
        state_bytes = state.sharded.state_bytes(state.optimizer)
        if r.reporter is not None:
            r.reporter.record(state_bytes_per_rank=state_bytes)
        hook.remove()

    hook = state.optimizer.register_step_post_hook(measure_state)
    setup = LoopSetup(
        trainer=cfg.trainer,
        grad_clip=cfg.optim.grad_clip,
        device=ctx.device,
        tp_ranks=cfg.parallel.tensor,
        reporter=r.reporter,
        stop_requested=r.stop,
        heartbeat=heartbeat.current(),
        trim_host_heap=cfg.hardware.malloc_trim and hardware_row(ctx.kind).host,
        profiler=WindowProfiler.start(
            cfg.profile,
            rank=ctx.rank,
            device=ctx.device,
            run_dir=r.run_dir,
            start_step=state.start_step,
            max_steps=cfg.trainer.max_steps,
        ),
    )
    try:
        end = train(state, setup)
    except NonFiniteLoss as e:
        # The weights were checked as they were read: a resumed checkpoint's, and pretrained
        # ones on the engines that read them (torch_xla's loader is its own).
        checks = hardware_row(ctx.kind).engine_checks_weights
        read = cfg.resume != "never" or (cfg.model.pretrained and checks)
        raise FloatingPointError(_nonfinite_advice(cfg, state.start_step, e, read)) from None
    if r.reporter is not None:
        r.reporter.end_of_training()
    saved_step = end.saved_step
    if saved_step is None:  # none in the loop: a resumed run's checkpoint is its start
        saved_step = state.start_step if cfg.resume != "never" else -1
    return FitResult(
        end_step=end.last.step if end.last is not None else state.start_step,
        preempted=end.preempted,
        saved_step=saved_step,
    )


# A non-finite loss this soon after a resume points at the checkpoint, not the learning rate.
RESUME_SUSPECT_STEPS = 10


def _nonfinite_advice(cfg: Config, start_step: int, e: NonFiniteLoss, read: bool) -> str:
    """The error, what was checked (``read``: the weights, finite as they were read; the last
    finite step's gradient norm), and the fix the evidence points at."""
    checked = []
    if read:
        checked.append("the weights were finite as they were read")
    if e.before is not None:
        checked.append(f"the gradient norm at step {e.before.step} was {e.before.grad_norm:.4g}")
    seen = f" ({'; '.join(checked)})" if checked else ""
    after = e.step - start_step
    if cfg.resume != "never" and after <= RESUME_SUSPECT_STEPS:
        return (
            f"{e}{seen}, {after} step(s) after resuming from {cfg.resume}: suspect the "
            f"checkpoint before the learning rate; check it with `fsdp-lab verify {cfg.resume}` "
            "(and checkpoint.verify=checksum), or resume from an earlier one"
        )
    if not dtype_row(cfg.precision.param_dtype).half:
        return f"{e}{seen}; lower optim.lr (now {cfg.optim.lr:g}) or raise optim.warmup_steps"
    return f"{e}{seen}; lower optim.lr (now {cfg.optim.lr:g}) or use precision=fp32"


def finish(r: RankRun, result: FitResult) -> None:
    """The final (or preemption) checkpoint, the Hugging Face export, run.json and the trackers'
    summary. A preempted run raises ``Preempted`` on every rank once that is done."""
    cfg, state, end = r.cfg, r.state, result.end_step
    if state.checkpointer.enabled and result.saved_step != end:
        state.checkpointer.save(end, tokens_seen(state, end), blocking=True)
    state.checkpointer.wait()
    if not result.preempted and cfg.checkpoint.export_hf:
        memory.reset_host_peak()
        start = memory.current_memory_bytes(torch.device("cpu"))  # the host's RSS now
        _export(r)
        rss = process_group.gather_from_processes((start, memory.host_peak_since_reset_bytes()))
        if r.reporter is not None:
            r.reporter.record(
                export_start_rss_bytes_per_rank=[a for a, _ in rss],
                export_peak_rss_bytes_per_rank=[b for _, b in rss],
            )
    if r.reporter is not None:
        r.reporter.close(
            end, preempted=result.preempted, total_time_s=time.perf_counter() - r.started
        )
    if result.preempted:
        if r.ctx.rank == 0:
            log.info("stopped by signal %s after step %d", r.stop.signal, end)
        raise Preempted(end, signal=r.stop.signal)


def _export(r: RankRun) -> None:
    """Stream the weights out, one tensor group at a time: every rank takes part in gathering
    each, rank 0 writes it (``state.export``): no process holds the whole model."""

    out_dir = r.run_dir / HF_EXPORT_DIR
    sharded = r.state.sharded
    export_model(
        sharded.export_names(),
        sharded.full_tensors,
        ExportTarget(out_dir, replace=True, tokenizer=r.state.tokenizer),  # the run's own
        r.cfg,
        r.state.facts.hf_config,
        writer=r.ctx.rank == 0,
    )
    if r.ctx.rank == 0:
        what = "LoRA adapter (PEFT)" if method_row(r.cfg.finetune.method).adapters else "model"
        log.info("exported Hugging Face %s: %s", what, out_dir)
    dist.barrier()


def _record_failure(run_dir: Path, e: BaseException, *, launcher_reports: bool) -> None:
    """This rank's error file, which the launcher reads to name the root cause; rank 0 also
    marks run.json failed (the launcher refines the reason). Under torchrun or srun (no
    launcher of ours to read the heartbeats) a collective that timed out is reported as the
    rank it waited for, on this rank's stderr too."""
    rank = int(os.environ.get("RANK", 0))
    path = error_file(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = traceback.format_exception_only(type(e), e)[-1].strip()
    if isinstance(e, ConfigError):  # a message written for the user: no class name before it
        line = str(e)
    timeout = heartbeat.is_timeout(line)
    recorded = _save_flight_record(run_dir, rank) if timeout else None
    beat = heartbeat.current()
    # Locally the launcher reads the beats (it hosts the store) and every rank's flight record;
    # here only under torchrun/srun, and only this rank's record.
    if not launcher_reports and timeout:
        world = int(os.environ.get("WORLD_SIZE", 1))
        beats = heartbeat.read(beat.store, world) if beat is not None else {}
        stall = heartbeat.describe_stall(beats, world, waiting=rank)
        if stall is not None or recorded is not None:  # name the rank it waited for, and where
            line = "; ".join(x for x in (stall or line, recorded) if x)
            print(f"fsdp_lab: error: {line}", file=sys.stderr)
    log.error("rank %d failed: %s", rank, line, exc_info=True)  # the traceback: log file only
    path.write_text(json.dumps({"rank": rank, "time": time.time(), "error": line}))
    if rank == 0 and (run_dir / RUN_FILE).is_file():
        update_run_file(run_dir, status="failed", error=f"rank 0: {line}")


def _save_flight_record(run_dir: Path, rank: int) -> str | None:
    """This rank's flight recorder, written to its logs (gloo never dumps by itself; with NCCL
    the watchdog may have too), and what it says in one line. Never raises: the error that
    brought the rank here is the one to report."""
    try:
        path = flight.dump_file(run_dir / LOG_DIR, rank)
        saved = flight.save(process_group.flight_records(), path, rank)
        return flight.describe({rank: saved}, [], waiting=[rank])
    except Exception as e:  # noqa: BLE001 - a missing dump must not hide the failure
        log.warning("rank %d: no flight recorder dump: %s", rank, e)
        return None
