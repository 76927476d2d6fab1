"""From a composed config to N ranks running ``worker.run``: local spawn or an existing group.

Bare ``python train.py`` validates the config here, in the parent, then starts
``hardware.nproc_per_node`` worker processes that read the resolved config from the run dir.
Under torchrun or srun (RANK/WORLD_SIZE set, or SLURM's task variables) this process is one
rank: ``external.join_existing_group`` takes over.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from fsdp_lab import external, preempt, rundir, slurm
from fsdp_lab.config import ConfigError, Config, DataKind, HardwareKind, to_typed
from fsdp_lab.rules import Topology, refuse_for_xla, validate

log = logging.getLogger("fsdp_lab")

# After the first rank fails, the others get this long to fail on their own (a broken
# collective usually ends them at once) before they are terminated.
GRACE_S = 5.0


def main(dict_cfg: DictConfig, *, run_dir: Path, multirun: bool,
         job: dict | None = None) -> tuple[int, str | None]:
    """One run (a sweep's job) from its composed config: (exit code, the one-line error if the
    config was refused before launch). Failures have been reported on stderr once. ``job``
    (its overrides and group choices, see ``sweep.job_info``) goes into run.json."""
    try:
        slurm.adopt_srun_env()  # under srun each task is one rank, as under torchrun
    except ConfigError as e:
        print(f"fsdp_lab: error: {e}", file=sys.stderr)
        return 2, str(e)
    forwarder = preempt.SignalForwarder() if "RANK" not in os.environ else None
    try:
        cfg = to_typed(dict_cfg)
        if "RANK" in os.environ:
            if multirun and not slurm.under_submitit():  # submitit runs one job per task
                raise ConfigError(
                    "-m/--multirun under torchrun or srun would run the whole sweep on every "
                    "rank; run `python train.py -m ...` (it starts each job's ranks itself)")
            return external.join_existing_group(cfg, run_dir, job), None  # submitit only
        topo = _local_topology(cfg)
        cfg = prepare_run(cfg, topo, run_dir, job)
    except ConfigError as e:
        if forwarder is not None:
            forwarder.restore()
        print(f"fsdp_lab: error: {e}", file=sys.stderr)
        return 2, str(e)
    try:
        return spawn_local(cfg, topo, run_dir, forwarder), None
    finally:
        forwarder.restore()


def prepare_run(cfg: Config, topo: Topology, run_dir: Path, job: dict | None = None) -> Config:
    """Every check that can run before a worker starts, and the decisions made once: which
    checkpoint to resume from and whether this run dir may be written. Returns the config the
    workers run, with ``resume`` resolved to a checkpoint path or "never"."""
    from fsdp_lab import checkpoint as ckpt, corpus as corpus_lib, hardware, loss as loss_lib
    from fsdp_lab import model as model_lib, wrap
    from fsdp_lab.optim import resolve_implementation

    validate(cfg, topo)
    hardware.check_nproc(topo.device, topo.nproc_per_node)
    p = cfg.precision
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        if getattr(p, name) is not None:
            hardware.check_dtype(topo.device, getattr(p, name), f"precision.{name}")
    if cfg.compile:
        hardware.check_compile(topo.device)
    slow = hardware.slow_cpu_dtype(topo.device, cfg.precision.param_dtype)
    if slow is not None:
        log.warning("precision.param_dtype=%s: %s; precision=fp32 trains the same model faster "
                    "on this machine", cfg.precision.param_dtype.value, slow)
    cfg = corpus_lib.absolute_paths(cfg)
    if cfg.model.name_or_path is not None:  # an unreadable or unreachable model is named first
        model_lib.check_task(model_lib.build_hf_config(cfg.model), cfg.model.task)
    # The tokenizer decides a preset's vocabulary size; the resolved size is what workers run.
    tokenizer = corpus_lib.load_tokenizer(cfg)
    cfg = dataclasses.replace(cfg, model=model_lib.resolve_vocab_size(cfg.model, tokenizer))
    # The model's structure on meta costs no memory: wrap errors (a class that matches nothing)
    # and checkpoints of another model surface here once, not in every worker.
    hf_config = model_lib.build_hf_config(cfg.model)
    model_lib.check_seq_len(hf_config, cfg.trainer.seq_len)
    loss_lib.resolve_kind(cfg.loss, hf_config, cfg.model.task, topo.device,
                          compiled=cfg.compile)
    resolve_implementation(cfg.optim, topo.device, grad_scaler=cfg.precision.grad_scaler_enabled)
    if cfg.model.pretrained:
        model_lib.check_weights(cfg.model.name_or_path)
    if tokenizer is not None:
        if len(tokenizer) > hf_config.vocab_size:
            raise ConfigError(
                f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                f"{hf_config.vocab_size}; use the model's own tokenizer (data.tokenizer) or set "
                f"model.vocab_size>={len(tokenizer)}")
    if cfg.data.kind is not DataKind.synthetic:
        # Tokenise and pack once, here: missing files, an empty dataset or a wrong column fail
        # before any rank starts, and the ranks find the result in the cache.
        corpus = corpus_lib.prepare(cfg, tokenizer)
        if cfg.trainer.eval_every and len(corpus.val) == 0:
            log.warning("data.validation_fraction=%s leaves no validation blocks: no evaluation",
                        cfg.data.validation_fraction)
    meta_model = model_lib.build_meta_model(hf_config, cfg.model.task)
    wrap.select_units(meta_model, cfg.wrap)
    root = ckpt.checkpoint_root(cfg.checkpoint, run_dir)
    resume_path = ckpt.resolve_resume(cfg.resume, root)
    if resume_path is not None:
        marker = ckpt.verify(resume_path)
        step = marker["step"]
        if topo.device is HardwareKind.tpu and marker["format"] != "sharded":
            raise ConfigError(
                f"resume={resume_path}: a checkpoint={marker['format']} checkpoint cannot be "
                "loaded on hardware=tpu; resume it on cpu/gpu, or convert it with `fsdp-lab "
                "export` and start from that (model=local model.name_or_path=<export>)")
        ckpt.check_compatible(resume_path, meta_model)
    continuing = resume_path is not None and cfg.resume == "auto"
    _claim_run_dir(run_dir, continuing=continuing, job=job)
    if continuing:
        logged = _truncate_metrics(run_dir / rundir.METRICS_FILE, step)
        # W&B keeps what it logged past the checkpoint; the worker logs only after it, so a
        # resumed W&B run has every step once.
        rundir.update_run_file(run_dir, logged_through_step=max(logged, step))
        log.info("resuming %s from %s (step %d)", run_dir, resume_path, step)
    elif resume_path is not None:
        log.info("starting from %s (step %d)", resume_path, step)
    return dataclasses.replace(cfg, resume=str(resume_path) if resume_path else "never")


def _truncate_metrics(path: Path, step: int) -> int:
    """Drop records of steps after the checkpoint: they are about to be run again. Returns the
    last step the file had (0 if none)."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    steps = [json.loads(line)["step"] if line.strip() else None for line in lines]
    kept = [line for line, s in zip(lines, steps) if s is not None and s <= step]
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)
    return max((s for s in steps if s is not None), default=0)


def _local_topology(cfg: Config) -> Topology:
    from fsdp_lab import hardware

    kind = hardware.resolve_kind(cfg.hardware)
    if kind is HardwareKind.tpu:
        refuse_for_xla(cfg)  # before the num_nodes line below, whose advice does not fit tpu
    if cfg.hardware.num_nodes > 1:
        raise ConfigError(
            f"hardware.num_nodes={cfg.hardware.num_nodes}: a bare `python train.py` starts ranks "
            "on this node only; launch multi-node runs with torchrun or srun on every node")
    nproc = cfg.hardware.nproc_per_node or hardware.default_nproc_per_node(kind)
    if nproc < 1 and kind is HardwareKind.tpu:
        raise ConfigError("hardware=tpu found no XLA device; on a TPU VM check its chips, or "
                          "set PJRT_DEVICE=CPU CPU_NUM_DEVICES=N to run on XLA's CPU devices")
    if nproc < 1:
        raise ConfigError("hardware=gpu found no GPU; use hardware=cpu")
    log.info("hardware=%s (%s): %d local ranks", kind.name, hardware.describe(kind), nproc)
    return Topology(world_size=nproc, nproc_per_node=nproc, num_nodes=1, device=kind)


def _claim_run_dir(run_dir: Path, *, continuing: bool, job: dict | None) -> None:
    """A run dir holds one run: write into one that has files only to continue its run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if continuing:
        return
    message = (f"run dir {run_dir} already holds files and no complete checkpoint to resume "
               "(or resume is not auto); pick a new one with hydra.run.dir=... "
               "(hydra.sweep.dir=... for -m)")
    if any(run_dir.iterdir()):
        raise ConfigError(message)
    # Claim it atomically: of two launches that both saw it empty, only one creates run.json.
    if not rundir.create_run_file(run_dir, {"status": "starting", "job": job}):
        raise ConfigError(message)


def _rendezvous_store(timeout_s: int):
    """The ranks' rendezvous store, hosted here on a port the OS assigns as it binds: unlike a
    port picked in advance and bound seconds later by rank 0, no other process can take it."""
    import datetime

    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=timeout_s))


def spawn_local(cfg: Config, topo: Topology, run_dir: Path,
                forwarder: preempt.SignalForwarder) -> int:
    """Start one worker process per rank, wait, and report the first failure once.

    A preemption signal (a scheduler's SIGTERM, SLURM's SIGUSR1) reaches every rank through
    ``forwarder``; they finish the step, checkpoint and exit with preempt.EXIT_CODE."""
    from fsdp_lab import hardware

    rundir.save_run_config(cfg, run_dir)
    log_dir = run_dir / rundir.LOG_DIR
    log_dir.mkdir(exist_ok=True)
    store = _rendezvous_store(cfg.hardware.timeout_s)
    # One process per rank; on tpu one for the host, which drives every XLA device.
    nprocs = hardware.processes_per_node(topo.device, topo.nproc_per_node)
    base_env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                # Every rank is a client of the launcher's store (torchrun's agent does the same).
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "WORLD_SIZE": str(nprocs), "LOCAL_WORLD_SIZE": str(nprocs),
                "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []
    outputs = []
    try:
        for rank in range(nprocs):
            env = {**base_env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            # Rank 0 talks to the console; the others' raw output (native warnings, crashes)
            # goes to their log file beside what their logger writes there.
            out = None if rank == 0 else open(log_dir / f"rank{rank}.log", "ab")
            outputs.append(out)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fsdp_lab.rank_main", str(run_dir)], env=env,
                stdout=out, stderr=subprocess.STDOUT if out else None,
                preexec_fn=_prepare_child))
            forwarder.add(procs[-1])
        code, exit_times = _wait(procs)
    except KeyboardInterrupt:
        _stop(procs)
        _mark_failed(run_dir, "interrupted (Ctrl-C)")
        print("fsdp_lab: interrupted", file=sys.stderr)
        return 130
    finally:
        for out in outputs:
            if out is not None:
                out.close()
    if code == preempt.EXIT_CODE:
        facts = rundir.read_run_file(run_dir)
        sig = forwarder.seen[0] if forwarder.seen else "?"
        print(f"fsdp_lab: preempted (signal {sig}) after step "
              f"{facts.get('step')}, checkpoint written; run the same command again with "
              f"hydra.run.dir={run_dir} to resume", file=sys.stderr)
    elif code != 0:
        reason = _first_failure(run_dir, procs, exit_times)
        _mark_failed(run_dir, reason)
        print(f"fsdp_lab: error: {reason}", file=sys.stderr)
    return 128 - code if code < 0 else code  # killed by signal N: exit 128+N, as shells do


def _prepare_child() -> None:
    """In the child before exec.

    Hold preemption signals pending (the mask survives exec) until rank_main has its handler
    in place and unblocks them, so none is lost or fatal. And on Linux, die with the launcher:
    a launcher killed by SIGKILL or the OOM killer must not leave ranks training as orphans.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, preempt.SIGNALS)
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _wait(procs: list[subprocess.Popen]) -> tuple[int, dict[int, float]]:
    """Wait for every rank; after the first failure, stop the rest. Returns the first non-zero
    exit code (0 if none) and when each rank was seen to exit (wall clock)."""
    exit_times: dict[int, float] = {}
    failed_at = None
    while True:
        for rank, p in enumerate(procs):
            if rank not in exit_times and p.poll() is not None:
                exit_times[rank] = time.time()
        codes = [p.returncode for p in procs]
        # A preempted rank is not a failure: the others follow it.
        first_bad = next((c for c in codes if c not in (None, 0, preempt.EXIT_CODE)), 0)
        if len(exit_times) == len(procs):
            preempted = preempt.EXIT_CODE in codes
            return first_bad or (preempt.EXIT_CODE if preempted else 0), exit_times
        if failed_at is None and first_bad:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            _stop(procs)
            return first_bad, exit_times
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 5
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _first_failure(run_dir: Path, procs: list[subprocess.Popen],
                   exit_times: dict[int, float]) -> str:
    """The root cause, shown once.

    A rank that died without writing an error (kill -9, OOM killer, a native crash) before the
    launcher stopped anyone is the cause: the errors its peers then write ("Connection reset by
    peer") are effects, and they often reach the disk before the launcher's poll sees the
    death. Otherwise the earliest error written wins.
    """
    deaths, errors = [], []  # (time, rank, message)
    for rank, p in enumerate(procs):
        path = rundir.error_file(run_dir, rank)
        if path.is_file():
            err = json.loads(path.read_text())
            errors.append((err["time"], rank, f"failed: {err['error']}"))
        elif p.returncode not in (0, None, preempt.EXIT_CODE) and rank in exit_times:
            how = f"signal {-p.returncode}" if p.returncode < 0 else f"exit code {p.returncode}"
            deaths.append((exit_times[rank], rank, f"died ({how}) without an error message"))
    if not deaths and not errors:
        return "a rank failed without an error message"
    _, rank, message = min(deaths or errors)
    return f"rank {rank} {message} (full log: {run_dir / rundir.LOG_DIR / f'rank{rank}.log'})"


def _mark_failed(run_dir: Path, reason: str) -> None:
    """Record the failure in run.json, so reports list the run as failed with its reason."""
    rundir.update_run_file(run_dir, status="failed", error=reason)
