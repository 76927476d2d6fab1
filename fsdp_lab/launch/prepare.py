"""Everything decided once, in the parent, before any rank starts: the topology of a local run,
every check that can run without a process group, the checkpoint to resume from, and the claim
on the run dir. Under torchrun or srun rank 0 runs ``prepare_run`` (``launch.external``)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from fsdp_lab.config import Config, ConfigError, StartMethod, typed_command
from fsdp_lab.config.checkpoint_formats import format_row
from fsdp_lab.config.data_kinds import kind_row
from fsdp_lab.config.hardware_kinds import Feature, hardware_row
from fsdp_lab.config.losses import loss_of
from fsdp_lab.config.model import method_row
from fsdp_lab.config.pipeline import splits_backward
from fsdp_lab.config.rules import refuse_for_hardware, validate
from fsdp_lab.config.topology import Topology
from fsdp_lab.launch import local
from fsdp_lab.observe import run_logs, rundir, trackers
from fsdp_lab.observe.record import RunRecord
from fsdp_lab.train.harness import HarnessTasks, include_dir

if TYPE_CHECKING:  # the parent imports torch only once a check needs it
    import torch

log = logging.getLogger("fsdp_lab")


def prepare_run(cfg: Config, topo: Topology, run_dir: Path, job: dict | None = None) -> Config:
    """Every check that can run before a worker starts, and the decisions made once: which
    checkpoint to resume from and whether this run dir may be written. Returns the config the
    workers run, with ``resume`` resolved to a checkpoint path or "never"."""
    validate(cfg, topo)
    trackers.check(cfg.logger)
    _check_hardware(cfg, topo)
    cfg, meta_model = check_model_and_data(cfg, topo)
    return _resume_point(cfg, topo, run_dir, job, meta_model)


def _check_hardware(cfg: Config, topo: Topology) -> None:
    from fsdp_lab.engine.hardware import devices, process_group

    process_group.backend(topo.device, cfg.hardware.backend)  # nccl off gpu: refused here
    devices.check_nproc(topo.device, topo.nproc_per_node, cfg.hardware.backend)
    p = cfg.precision
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        if getattr(p, name) is not None:
            devices.check_dtype(topo.device, getattr(p, name), f"precision.{name}")
    if cfg.compile:
        devices.check_compile(topo.device)
    devices.check_experts_implementation(cfg.model.experts_implementation)
    slow = devices.slow_cpu_dtype(topo.device, cfg.precision.param_dtype)
    if slow is not None:
        log.warning(
            "precision.param_dtype=%s: %s; precision=fp32 trains the same model faster "
            "on this machine",
            cfg.precision.param_dtype.value,
            slow,
        )


def check_model_and_data(cfg: Config, topo: Topology) -> tuple[Config, torch.nn.Module]:
    """The model, its loss and optimizer, the tokenizer and the corpus, checked (the corpus
    tokenised and cached) once; returns the config with absolute paths and the resolved
    vocabulary size, and the model's structure on meta."""
    from fsdp_lab.data import corpus as corpus_lib
    from fsdp_lab.engine import model as model_lib
    from fsdp_lab.engine import weights, wrap
    from fsdp_lab.train import loss as loss_lib
    from fsdp_lab.train.optim import resolve_implementation

    cfg = corpus_lib.absolute_paths(cfg)
    if cfg.model.name_or_path is not None:  # an unreadable or unreachable model is named first
        model_lib.check_task(model_lib.build_hf_config(cfg.model), cfg.model.task)
    # The tokenizer decides a preset's vocabulary size; the resolved size is what workers run.
    tokenizer = corpus_lib.load_tokenizer(cfg)
    cfg = dataclasses.replace(cfg, model=model_lib.resolve_vocab_size(cfg.model, tokenizer))
    hf_config = model_lib.build_hf_config(cfg.model)
    model_lib.check_seq_len(hf_config, cfg.trainer.seq_len)
    loss_kind = loss_lib.resolve_loss(
        cfg.loss,
        hf_config,
        cfg.model.task,
        topo.device,
        compiled=cfg.compile,
        split_backward=splits_backward(cfg.parallel),
    )
    resolve_implementation(cfg.optim, topo.device, grad_scaler=cfg.precision.grad_scaler_enabled)
    files = weights.local_files(cfg.model.name_or_path) if cfg.model.pretrained else None
    _check_vocab(tokenizer, hf_config)
    _check_corpus(cfg, tokenizer, hf_config.vocab_size)
    cfg = _check_eval(cfg, tokenizer, hf_config)
    # The model's structure on meta costs no memory: wrap errors (a class that matches nothing)
    # and checkpoints of another model surface here once, not in every worker.
    meta_model = model_lib.model_on_meta(hf_config, cfg.model.task, cfg.finetune)
    if files is not None:  # every tensor's sources, and their shapes, from the headers
        _check_weights(meta_model, files, cfg.model.name_or_path)
    _check_finetune(cfg, meta_model, loss_kind)
    if cfg.parallel.tensor > 1:  # a model without a TP plan, or one the degree cannot split
        from fsdp_lab.engine import tensor_parallel

        tensor_parallel.check(meta_model, cfg.parallel)
    if cfg.parallel.context > 1:  # an attention CP does not reproduce
        from fsdp_lab.engine import context_parallel

        context_parallel.check(hf_config, cfg.parallel.context)
    if cfg.parallel.pipeline > 1:  # a family it cannot cut, a layout its schedule refuses
        from fsdp_lab.engine import pipeline

        frozen = any(not p.requires_grad for p in meta_model.parameters())
        pipeline.check(hf_config, cfg.parallel, cfg.trainer.micro_batch_size, frozen_base=frozen)
    if cfg.parallel.expert > 1:  # a dense model, or an expert count the degree cannot split
        from fsdp_lab.engine import expert_parallel

        expert_parallel.check(meta_model, cfg.parallel.expert)
    wrap.select_units(meta_model, cfg.wrap)
    return cfg, meta_model


def _check_corpus(cfg: Config, tokenizer, vocab_size: int) -> None:
    """Tokenise and pack the corpus once, here: missing files, an empty dataset or a wrong
    column fail before any rank starts, and the ranks find the result in the cache."""
    from fsdp_lab.data import corpus as corpus_lib

    row = kind_row(cfg.data.kind)
    if not row.prepared:
        return
    corpus = corpus_lib.prepare(cfg, tokenizer, vocab_size=vocab_size)
    if row.replies_only and corpus.train.learned_tokens() == 0:
        raise ConfigError(
            f"data={cfg.data.kind.value}: no reply token lies within the first "
            f"trainer.seq_len={cfg.trainer.seq_len} tokens of any training conversation, so "
            "nothing would be learned; raise trainer.seq_len (fsdp-lab data preview shows the "
            "rows)"
        )
    if cfg.trainer.eval_every and len(corpus.val) == 0:
        log.warning(
            "data.validation_fraction=%s leaves no validation blocks: no evaluation",
            cfg.data.validation_fraction,
        )


def _check_vocab(tokenizer, hf_config) -> None:
    if tokenizer is not None and len(tokenizer) > hf_config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
            f"{hf_config.vocab_size}; use the model's own tokenizer (data.tokenizer) or set "
            f"model.vocab_size>={len(tokenizer)}"
        )


def _check_eval(cfg: Config, tokenizer, hf_config) -> Config:
    """eval.prompts read and rendered, eval.harness_tasks found and loaded, once here: a bad
    prompt file or task fails before any rank starts. Returns the config with the prompt file
    and the task folder as absolute paths (a rank may start elsewhere)."""
    from fsdp_lab.train.evaluation import check_eval_setup

    e = cfg.eval
    check_eval_setup(cfg, tokenizer, hf_config)
    if e.keep_gathered and (e.prompts is not None or e.harness_tasks):
        from torch.distributed.fsdp import FSDPModule

        if not hasattr(FSDPModule, "set_reshard_after_forward"):
            raise ConfigError(
                "eval.keep_gathered=true needs FSDP2's set_reshard_after_forward (torch>=2.7); "
                "upgrade torch or set eval.keep_gathered=false"
            )
    if isinstance(e.prompts, str):
        e = dataclasses.replace(e, prompts=str(Path(e.prompts).expanduser().resolve()))
    if e.harness_tasks:
        e = dataclasses.replace(e, harness_include_path=include_dir(e.harness_include_path))
        HarnessTasks.of(e).check()
    return dataclasses.replace(cfg, eval=e)


def _check_weights(meta_model: torch.nn.Module, files, path: str) -> None:
    """The checkpoint's tensors against the model's, from the headers: one line naming the
    first few keys for a tensor either side lacks or a shape that differs."""
    from fsdp_lab.engine import conversion

    with contextlib.suppress(conversion.NotPerRank):  # rank 0 reads it whole, and says so
        conversion.plan_loading(meta_model, files, path)


def _check_finetune(cfg: Config, meta_model: torch.nn.Module, loss_kind) -> None:
    """The finetune group on the model's structure: patterns that match nothing, nothing left
    to train, and LoRA on the output head under a loss that reads the head's weight alone."""
    from fsdp_lab.engine import finetune

    method = cfg.finetune.method
    if not method_row(method).freezes:
        return
    if finetune.adapts_head(meta_model) and loss_of(loss_kind).fused:
        raise ConfigError(
            f"finetune.target_modules adapts the output head, and loss={loss_kind.name} "
            "computes the logits from the head's weight alone (without its adapter); set "
            "loss=hf, or leave the head out of finetune.target_modules"
        )
    if method_row(method).adapters and not cfg.model.pretrained:
        log.warning(
            "finetune=lora on a randomly initialised base (model.pretrained=false): legal, but "
            "the frozen base is noise; set model=local model.name_or_path=DIR "
            "(model.pretrained=true) to adapt a pretrained model"
        )


def _resume_point(
    cfg: Config, topo: Topology, run_dir: Path, job: dict | None, meta_model: torch.nn.Module
) -> Config:
    """The checkpoint to start from (checked complete and of this model), and the claim on the
    run dir: a fresh one, or this run's own when resume=auto continues it."""
    from fsdp_lab.state import checkpoint as ckpt

    root = ckpt.checkpoint_root(cfg.checkpoint, run_dir)
    # Verified (checkpoint.verify) and its pickles read through their guards, here, once.
    resume_path = ckpt.resolve_resume(cfg.resume, root, cfg.checkpoint.verify)
    if resume_path is not None:
        marker = json.loads((resume_path / ckpt.MARKER).read_text())
        step = marker["step"]
        row = hardware_row(topo.device)
        whole = Feature.whole_file_checkpoints
        if format_row(marker["format"]).whole_files and not row.runs(whole):
            raise ConfigError(
                f"resume={resume_path}: a checkpoint={marker['format']} checkpoint cannot be "
                f"loaded on hardware={topo.device.name}: {row.refuses[whole]}"
            )
        base = ckpt.check_compatible(resume_path, meta_model)
        if not base["saved"] and not cfg.model.pretrained:
            raise ConfigError(
                f"resume={resume_path}: the checkpoint holds only the trainable parameters of "
                f"a fine-tune of {base['source']}, whose frozen base this run does not read; "
                f"set model.pretrained=true model.name_or_path={base['source']}"
            )
    continuing = resume_path is not None and cfg.resume == "auto"
    _claim_run_dir(run_dir, continuing=continuing, job=job)
    if continuing:
        logged = _truncate_metrics(run_dir / rundir.METRICS_FILE, step)
        _truncate_metrics(run_dir / rundir.SAMPLES_FILE, step)  # eval.prompts' completions
        # A tracker keeps what it logged past the checkpoint; the reporter sends a continued
        # tracker only the steps after it, so a resumed tracker run has every step once.
        rundir.update_run_file(run_dir, logged_through_step=max(logged, step))
        log.info("resuming %s from %s (step %d)", run_dir, resume_path, step)
    elif resume_path is not None:
        log.info("starting from %s (step %d)", resume_path, step)
    return dataclasses.replace(cfg, resume=str(resume_path) if resume_path else "never")


def _truncate_metrics(path: Path, step: int) -> int:
    """Drop records of steps after the checkpoint (metrics.jsonl's, samples.jsonl's): they are
    about to be run again. Returns the last step the file had (0 if none)."""
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines(keepends=True)
    steps = [run_logs.step_of_line(line) for line in lines]
    kept = [line for line, s in zip(lines, steps, strict=True) if s is not None and s <= step]
    if len(kept) != len(lines):
        rundir.write_atomic(path, "".join(kept))
    return max((s for s in steps if s is not None), default=0)


def local_topology(cfg: Config) -> Topology:
    from fsdp_lab.engine.hardware import devices

    kind = devices.resolve_kind(cfg.hardware)
    refuse_for_hardware(cfg, kind)  # before the num_nodes line below, whose advice may not fit
    if cfg.hardware.num_nodes > 1:
        raise ConfigError(
            f"hardware.num_nodes={cfg.hardware.num_nodes}: a bare `{typed_command()}` starts ranks "
            "on this node only; launch multi-node runs with torchrun or srun on every node"
        )
    nproc = cfg.hardware.nproc_per_node or devices.default_nproc_per_node(kind)
    if nproc < 1:
        raise ConfigError(devices.none_found(kind))
    method = local.resolve_start_method(cfg.hardware.start_method, kind)
    log.info(
        "hardware=%s (%s): %d local ranks (%s)",
        kind.name,
        devices.device_summary(kind),
        nproc,
        "forked from this process" if method is StartMethod.fork else "spawned",
    )
    return Topology.nodes(nproc, 1, kind)


def _claim_run_dir(run_dir: Path, *, continuing: bool, job: dict | None) -> None:
    """A run dir holds one run: write into one that has files only to continue its run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if continuing:
        return
    message = (
        f"run dir {run_dir} already holds files and no complete checkpoint to resume "
        "(or resume is not auto); pick a new one with hydra.run.dir=... "
        "(hydra.sweep.dir=... for -m)"
    )
    if any(run_dir.iterdir()):
        raise ConfigError(message)
    # Claim it atomically: of two launches that both saw it empty, only one creates run.json.
    if not rundir.create_run_file(run_dir, RunRecord(status="starting", job=job)):
        raise ConfigError(message)
