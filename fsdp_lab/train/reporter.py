"""What a run says of itself: its facts (run.json's, the trackers' params) and rank 0's records.

``RunFacts`` is collected once on every rank (some facts take a collective); rank 0's
``Reporter`` writes them to run.json, streams the step records to metrics.jsonl, the summary, the
progress bar and the trackers (``logger=...``), and closes it all with the run's status.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from fsdp_lab.config import Config, HardwareKind, LossKind, ProfileMode, to_container
from fsdp_lab.engine import hardware
from fsdp_lab.engine.moe import ExpertCounts
from fsdp_lab.observe import metrics
from fsdp_lab.observe.loggers import MetricsWriter, Progress, RunSummary, read_records
from fsdp_lab.observe.profile.recorder import PROFILE_DIR
from fsdp_lab.observe.profile.result import ProfileResult, RankProfile
from fsdp_lab.observe.profile.summary import TIMELINE_PNG, metrics_record, summary_line
from fsdp_lab.observe.rundir import (
    CONFIG_FILE,
    METRICS_FILE,
    RUN_FILE,
    read_run_file,
    write_run_file,
)
from fsdp_lab.observe.trackers import RunInfo, TrackerSet
from fsdp_lab.observe.trackers.base import flatten, redact
from fsdp_lab.train.build import RankContext, TrainState

log = logging.getLogger("fsdp_lab")

# The facts trackers get as params, as system.<fact> (W&B's config, MLflow's params...).
_SYSTEM_PARAMS = (
    "torch",
    "transformers",
    "hardware",
    "backend",
    "world_size",
    "num_nodes",
    "mesh_shape",
    "mesh_axes",
    "num_fsdp_units",
    "model_class",
    "total_params",
    "trainable_params",
    "tokens_per_step",
)
# Facts that exist only for some runs or from some point on: left out of run.json while unset.
_OPTIONAL = (
    "active_params",
    "experts",
    "param_sharding",
    "export_start_rss_bytes_per_rank",
    "export_peak_rss_bytes_per_rank",
    "job",
    "trackers",
    "memory_before_train_bytes_per_rank",
    "state_bytes_per_rank",
    "profile",
)


@dataclass
class RunFacts:
    """run.json's facts of a run (the trackers' params take some of them too)."""

    world_size: int
    num_nodes: int
    hardware: str
    backend: str
    threads_per_rank: int
    mesh_shape: list[int]
    mesh_axes: list[str]
    fsdp_units: str
    num_fsdp_units: int
    model_class: str
    total_params: int
    trainable_params: int  # fewer than total_params with finetune=freeze or lora
    local_params_per_rank: list[int]
    tokens_per_step: int  # positions of a global batch, trained or not (metrics: trained_tokens)
    task: str
    pretrained: bool
    load_peak_rss_bytes_per_rank: list
    activation_checkpointing: list[int]
    compiled: bool
    loss_kind: str
    optimizer: str
    data: dict
    resumed_from: str | None
    start_step: int
    torch: str
    flops_per_token: int
    peak_flops: float | None
    transformers: str
    param_sharding: dict[str, str] | None = None  # XLA's sharding annotation per parameter
    export_start_rss_bytes_per_rank: list | None = None  # checkpoint.export_hf: host RSS before
    export_peak_rss_bytes_per_rank: list | None = None  # and its peak while exporting
    job: dict | None = None  # the launcher's: overrides, group choices, sweep dir and number
    trackers: dict | None = None  # each started tracker's run: ids, dirs (see logger=...)
    memory_before_train_bytes_per_rank: list | None = None
    state_bytes_per_rank: list | None = None  # measured after the first optimizer step
    profile: dict | None = None  # profile=trace|memory: the window's analysis, or its files
    # A mixture of experts: the parameters a token uses (router, top_k of E experts), which
    # flops_per_token counts, against total_params; and the experts' layout.
    active_params: int | None = None
    experts: dict | None = None  # moe_layers, num_experts, top_k, expert_params

    @classmethod
    def collect(cls, cfg: Config, ctx: RankContext, state: TrainState) -> RunFacts:
        """Every rank takes part: the per-rank numbers are gathered."""
        sharded, model, corpus = state.sharded, state.model, state.corpus
        if corpus is not None:
            data = {
                "kind": cfg.data.kind.name,
                "cache": str(corpus.path),
                "train_blocks": len(corpus.train),
                "val_blocks": len(corpus.val),
                "tokens": corpus.num_tokens,
                "documents": corpus.num_documents,
                "fingerprint": corpus.fingerprint,
                "tokenizer": type(state.tokenizer).__name__ if state.tokenizer else None,
            }
            if hasattr(corpus, "summary") and ctx.rank == 0:  # data=chat: the preview's counts
                # (rank 0's run.json only: counting reads every conversation's mask)
                data["chat"] = corpus.summary()
        else:
            data = {"kind": cfg.data.kind.name}
        return cls(
            world_size=ctx.topo.world_size,
            num_nodes=ctx.topo.num_nodes,
            hardware=hardware.device_summary(ctx.kind),
            backend=hardware.backend(ctx.kind, cfg.hardware.backend),
            threads_per_rank=ctx.threads,
            mesh_shape=sharded.mesh_shape,
            mesh_axes=sharded.mesh_axes,
            fsdp_units=sharded.units_desc,
            num_fsdp_units=sharded.num_units,
            model_class=model.model_class,
            total_params=model.total_params,
            trainable_params=model.trainable_params,
            local_params_per_rank=sharded.local_numels(),
            tokens_per_step=state.tokens_per_step,
            task=model.task.name,
            pretrained=cfg.model.pretrained,
            load_peak_rss_bytes_per_rank=model.load_rss,
            activation_checkpointing=sharded.checkpointed,
            compiled=cfg.compile,
            loss_kind=state.loss.kind.name,
            optimizer=f"AdamW ({state.optim_impl.name})",
            data=data,
            resumed_from=None if cfg.resume == "never" else cfg.resume,
            start_step=state.start_step,
            torch=torch.__version__,
            flops_per_token=model.flops_per_token,
            peak_flops=model.peak_flops,
            transformers=transformers.__version__,
            param_sharding=sharded.param_specs,
            **_expert_facts(model.experts, model.total_params),
        )

    def as_dict(self) -> dict:
        facts = dataclasses.asdict(self)
        return {k: v for k, v in facts.items() if not (k in _OPTIONAL and v is None)}


def _expert_facts(experts: ExpertCounts, total_params: int) -> dict:
    """run.json's MoE facts (none for a dense model)."""
    if not experts.num_experts:
        return {}
    return {
        "active_params": total_params - experts.inactive_params,
        "experts": {
            "moe_layers": experts.num_layers,
            "num_experts": experts.num_experts,
            "top_k": experts.top_k,
            "expert_params": experts.expert_params,
        },
    }


class Reporter:
    """Rank 0's records of a run: run.json, metrics.jsonl, the summary, the progress bar, the
    trackers."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        facts: RunFacts,
        *,
        trackers: TrackerSet,
        start_step: int,
    ) -> None:
        self.cfg, self.run_dir, self.facts, self.trackers = cfg, run_dir, facts, trackers
        self.summary = RunSummary()
        self.writer = MetricsWriter(run_dir / METRICS_FILE)
        self.progress = Progress(
            cfg.trainer.max_steps, enabled=cfg.trainer.progress_bar, initial=start_step
        )

    @classmethod
    def start(
        cls, cfg: Config, run_dir: Path, facts: RunFacts, ctx: RankContext, state: TrainState
    ) -> Reporter:
        """Log the run's shape, start (or continue) its trackers, mark run.json running."""
        _log_start(cfg, facts, ctx.kind)
        claimed = read_run_file(run_dir)  # the launcher's: the job, a resumed run's tracker ids
        facts.job = claimed.get("job")
        run = RunInfo(run_dir, tracker_params(cfg, facts), facts.job or {})
        continuing = cfg.resume != "never" and ("trackers" in claimed or "wandb" in claimed)
        # run.json before trackers had only W&B's, at the top level
        resume = claimed.get("trackers", {"wandb": claimed.get("wandb")}) if continuing else {}
        trackers = TrackerSet.start(
            cfg.logger,
            run,
            resume={name: info for name, info in resume.items() if info},
            logged_through=claimed.get("logged_through_step", -1),
            history=read_records(run_dir / METRICS_FILE) if continuing else [],
        )
        facts.trackers = trackers.info
        write_run_file(run_dir, {**facts.as_dict(), "status": "running"})
        return cls(cfg, run_dir, facts, trackers=trackers, start_step=state.start_step)

    def _emit(self, records: list[dict]) -> None:
        for record in records:
            self.writer.write(record)
            self.summary.add(record)
        self.trackers.log(records)

    def train_records(self, records: list[metrics.StepMetrics]) -> None:
        """Every step of a logging window."""
        rows = [
            {
                "split": "train",
                **m.as_record(),
                **metrics.throughput(
                    m,
                    world_size=self.facts.world_size,
                    flops_per_token=self.facts.flops_per_token,
                    peak_flops=self.facts.peak_flops,
                ),
            }
            for m in records
        ]
        self._emit(rows)
        for record in rows:
            self.progress.update(record)

    def validation(self, step: int, result) -> None:
        self._emit(
            [
                {
                    "split": "val",
                    "step": step,
                    "val_loss": result.loss,
                    "val_ppl": result.perplexity,
                    "val_tokens": result.tokens,
                    "eval_time_s": result.time_s,
                }
            ]
        )
        log.info(
            "step %d: validation loss %.4f, perplexity %.2f (%d tokens)",
            step,
            result.loss,
            result.perplexity,
            result.tokens,
        )

    def profile(self, ranks: list[RankProfile], *, analysis_s: float) -> None:
        """A profiled window: run.json's `profile` section (written now: a run that fails
        later keeps it), a metrics.jsonl record and profile/timeline.png."""
        p, out = self.cfg.profile, self.run_dir / PROFILE_DIR
        section: dict = {"mode": p.mode.name, "window": list(p.window(self.facts.start_step))}
        if p.mode is ProfileMode.memory:
            files = sorted(out.glob("rank*.memory.*"))
            section["files"] = [str(f.relative_to(self.run_dir)) for f in files]
            log.info("profile=memory: allocator snapshots in %s (pytorch.org/memory_viz)", out)
        elif ranks:
            result = ProfileResult(ranks, analysis_s=analysis_s)
            section.update(result.as_dict())
            section["timeline"] = _draw_timeline(result, out / TIMELINE_PNG, self.run_dir)
            self._emit([metrics_record(result, result.steps[-1])])
            log.info("%s (details: fsdp-lab profile %s)", summary_line(result), self.run_dir)
        self.facts.profile = section
        write_run_file(self.run_dir, {**read_run_file(self.run_dir), **self.facts.as_dict()})

    def end_of_training(self) -> None:
        """The loop is over: no more step records."""
        self.progress.close()
        self.writer.close()

    def close(self, end_step: int, *, preempted: bool, total_time_s: float) -> None:
        """run.json's final facts and status; the trackers' summary and files."""
        status = "preempted" if preempted else "completed"
        results = {**self.summary.as_dict(), "total_time_s": total_time_s}
        write_run_file(
            self.run_dir, {**self.facts.as_dict(), "status": status, "step": end_step, **results}
        )
        profiled = sorted((self.run_dir / PROFILE_DIR).glob("*.*"))  # traces, picture
        self.trackers.finish(
            status=status,
            summary={**results, "step": end_step},
            files=[self.run_dir / RUN_FILE, self.run_dir / CONFIG_FILE, *profiled],
        )
        if not preempted:
            final_loss = results["final_loss"]
            log.info(
                "done: step %d/%d, final loss %s, run dir %s",
                end_step,
                self.cfg.trainer.max_steps,
                f"{final_loss:.4f}" if final_loss is not None else "-",
                self.run_dir,
            )

    def fail(self) -> None:
        self.trackers.finish(status="failed", summary=self.summary.as_dict(), files=[])


def _draw_timeline(result: ProfileResult, path: Path, run_dir: Path) -> str | None:
    """The picture's path in the run dir; None (and a warning) if it cannot be drawn: the
    numbers are in run.json whatever becomes of the picture."""
    try:
        from fsdp_lab.observe.profile.picture import draw_timeline

        draw_timeline([r.picture for r in result.ranks if r.picture is not None], path)
    except Exception as e:  # noqa: BLE001 - a picture never fails a run
        log.warning("no profile timeline picture: %s", e)
        return None
    return str(path.relative_to(run_dir))


def tracker_params(cfg: Config, facts: RunFacts) -> dict:
    """What every tracker records as the run's params: the flattened config, the chosen
    options, an Optuna trial's study and number, and some of the system's facts."""
    params = flatten(to_container(cfg))
    job = facts.job or {}
    params.update({f"options.{g}": o for g, o in job.get("choices", {}).items()})
    if job.get("study"):
        params.update({"study.name": job["study"], "study.trial": job["num"]})
    system = facts.as_dict()
    params.update({f"system.{k}": system[k] for k in _SYSTEM_PARAMS if k in system})
    return {k: redact(v) for k, v in params.items()}


def _log_start(cfg: Config, facts: RunFacts, kind: HardwareKind) -> None:
    log.info(
        "%s | %d ranks, mesh %s %s | units: %s | %s params (%s per rank)",
        facts.hardware,
        facts.world_size,
        facts.mesh_axes,
        facts.mesh_shape,
        facts.fsdp_units,
        f"{facts.total_params:,}",
        [f"{n:,}" for n in facts.local_params_per_rank],
    )
    if facts.trainable_params != facts.total_params:
        log.info(
            "finetune=%s: %s trainable parameters (%.2f%%); the rest hold no gradient and no "
            "optimizer state",
            cfg.finetune.method.name,
            f"{facts.trainable_params:,}",
            100 * facts.trainable_params / facts.total_params,
        )
    log.info(
        "loss=%s%s | optimizer %s | numbers read from the device every %d steps",
        facts.loss_kind,
        " (loss=auto)" if cfg.loss.kind is LossKind.auto else "",
        facts.optimizer,
        cfg.trainer.log_every,
    )
    if facts.world_size == 1 and kind is not HardwareKind.tpu:
        log.info(
            "world size 1: FSDP2 on a 1-rank mesh, nothing sharded; its all-gathers and "
            "reduce-scatters are local copies, kept so that precision (param_dtype "
            "copies, fp32 master weights) and checkpoints are those of a sharded run"
        )
