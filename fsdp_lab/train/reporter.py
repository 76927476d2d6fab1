"""What a run says of itself: its facts (run.json's, the trackers' params) and rank 0's records.

``collect_facts`` gathers the run's ``RunFacts`` once on every rank (some facts take a
collective); rank 0's ``Reporter`` writes them to run.json, streams the step records to
metrics.jsonl, the summary, the progress bar and the trackers (``logger=...``), and closes it all
with the run's status. The records are ``observe.record``'s dataclasses.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
import transformers

from fsdp_lab.config import Config, HardwareKind, LossKind, ProfileMode, to_container
from fsdp_lab.config.hardware_kinds import hardware_row
from fsdp_lab.config.low_precision import NF4_BITS
from fsdp_lab.engine.hardware import devices, process_group
from fsdp_lab.engine.moe import ExpertCounts
from fsdp_lab.observe import metrics
from fsdp_lab.observe.profile.recorder import PROFILE_DIR
from fsdp_lab.observe.profile.result import ProfileResult, RankProfile
from fsdp_lab.observe.profile.summary import TIMELINE_PNG, metrics_record, summary_line
from fsdp_lab.observe.record import (
    EvalRecord,
    HarnessRecord,
    JobRecord,
    RunFacts,
    RunRecord,
    RunResults,
    SampleRecord,
    SamplesRecord,
    StepRecord,
)
from fsdp_lab.observe.run_logs import MetricsWriter, Progress, RunSummary, tracker_history
from fsdp_lab.observe.rundir import (
    CONFIG_FILE,
    METRICS_FILE,
    RUN_FILE,
    SAMPLES_FILE,
    read_run_file,
    write_run_file,
)
from fsdp_lab.observe.trackers import RunInfo, TrackerSet
from fsdp_lab.observe.trackers.base import flatten, redact
from fsdp_lab.train.build import RankContext, TrainState
from fsdp_lab.train.evaluation import HarnessScores

log = logging.getLogger("fsdp_lab")
SAMPLE_LOG_CHARS = 120  # of the first sample's output, in the log line of an evaluation


def collect_facts(cfg: Config, ctx: RankContext, state: TrainState) -> RunFacts:
    """run.json's facts of the built run. Every rank takes part: the per-rank numbers are
    gathered."""
    sharded, model, corpus = state.sharded, state.facts, state.corpus
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
    active_params, experts = _expert_facts(model.experts, model.total_params)
    return RunFacts(
        world_size=ctx.topo.world_size,
        num_nodes=ctx.topo.num_nodes,
        hardware=devices.device_summary(ctx.kind),
        backend=process_group.backend(ctx.kind, cfg.hardware.backend),
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
        activation_checkpointing=sharded.recomputed_units,
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
        low_precision=sharded.low_precision,
        active_params=active_params,
        experts=experts,
    )


def _expert_facts(experts: ExpertCounts, total_params: int) -> tuple[int | None, dict | None]:
    """run.json's MoE facts: the parameters a token uses, the experts' layout (None, None for
    a dense model)."""
    if not experts.num_experts:
        return None, None
    return total_params - experts.inactive_params, {
        "moe_layers": experts.num_layers,
        "num_experts": experts.num_experts,
        "top_k": experts.top_k,
        "expert_params": experts.expert_params,
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
        job: dict | None = None,
    ) -> None:
        self.cfg, self.run_dir, self.facts, self.trackers = cfg, run_dir, facts, trackers
        self.measured: dict = {}  # RunResults' MEASURED fields, as record() got them
        self.job = job  # the launcher's record of the job (launch.sweep.job_info)
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
        run = RunInfo(run_dir, tracker_params(cfg, facts, claimed.job_record), claimed.job or {})
        earlier = claimed.tracker_runs() if cfg.resume != "never" else None
        continuing = earlier is not None
        logged_through = claimed.logged_through_step
        trackers = TrackerSet.start(
            cfg.logger,
            run,
            resume={name: info for name, info in (earlier or {}).items() if info},
            logged_through=-1 if logged_through is None else logged_through,
            history=tracker_history(run_dir / METRICS_FILE) if continuing else [],
        )
        facts = dataclasses.replace(facts, trackers=trackers.info)
        write_run_file(run_dir, RunRecord(status="running", job=claimed.job, facts=facts))
        return cls(
            cfg, run_dir, facts, trackers=trackers, start_step=state.start_step, job=claimed.job
        )

    def _emit(self, records: list[StepRecord] | list[EvalRecord] | list[HarnessRecord]) -> None:
        self._write_rows([r.to_dict() for r in records])
        for record in records:
            self.summary.add(record)

    def _write_rows(self, rows: list[dict]) -> None:
        for row in rows:
            self.writer.write(row)
        self.trackers.log(rows)

    def train_records(self, records: list[metrics.StepMetrics]) -> None:
        """Every step of a logging window."""
        rows = [
            StepRecord(
                **m.as_record(),
                **metrics.throughput(
                    m,
                    world_size=self.facts.world_size,
                    flops_per_token=self.facts.flops_per_token,
                    peak_flops=self.facts.peak_flops,
                ),
            )
            for m in records
        ]
        self._emit(rows)
        for record in rows:
            self.progress.update(record)

    def validation(self, step: int, result) -> None:
        self._emit(
            [
                EvalRecord(
                    step=step,
                    val_loss=result.loss,
                    val_ppl=result.perplexity,
                    val_tokens=result.tokens,
                    eval_time_s=result.time_s,
                )
            ]
        )
        log.info(
            "step %d: validation loss %.4f, perplexity %.2f (%d tokens)",
            step,
            result.loss,
            result.perplexity,
            result.tokens,
        )

    def samples(self, step: int, samples: list[SampleRecord], time_s: float) -> None:
        """One evaluation's generations: appended to samples.jsonl (a resumed run continues
        it), sent to every tracker, their count and time a metrics.jsonl row, the first one in
        the log."""
        rows = [s.to_dict() for s in samples]
        with (self.run_dir / SAMPLES_FILE).open("a", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        tokens = sum(s.tokens for s in samples)
        self._write_rows(
            [SamplesRecord(step, len(samples), tokens, samples_time_s=time_s).to_dict()]
        )
        self.trackers.log_samples(rows, step)
        first = " ".join(samples[0].output.split()) if samples else ""
        log.info(
            "step %d: %d samples, %d new tokens in %.1f s (%s); the first: %s",
            step,
            len(samples),
            tokens,
            time_s,
            SAMPLES_FILE,
            first[:SAMPLE_LOG_CHARS] + ("…" if len(first) > SAMPLE_LOG_CHARS else ""),
        )

    def harness(self, step: int, result: HarnessScores) -> None:
        """lm-eval's scores of the model being trained: a metrics.jsonl row, the trackers,
        run.json's results at the end."""
        scores = result.flat()
        self._emit(
            [
                HarnessRecord(
                    step=step, scores=scores, harness_time_s=result.time_s, source="sharded"
                )
            ]
        )
        log.info(
            "step %d: harness %s (%.1f s)",
            step,
            ", ".join(f"{k} {v:.4f}" for k, v in scores.items()),
            result.time_s,
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
            self._write_rows([metrics_record(result, result.steps[-1])])
            log.info("%s (details: fsdp-lab profile %s)", summary_line(result), self.run_dir)
        self.record(profile=section)

    def end_of_training(self) -> None:
        """The loop is over: no more step records."""
        self.progress.close()
        self.writer.close()

    def record(self, **measured) -> None:
        """Results measured on the way (``RunResults``' ``MEASURED`` fields: memory before
        training, state bytes, the profile, the export's RSS), into run.json as each is known
        and kept for its final results."""
        self.measured.update(measured)
        written = read_run_file(self.run_dir)
        results = dataclasses.replace(written.results or RunResults(), **measured)
        write_run_file(self.run_dir, dataclasses.replace(written, results=results))

    def close(self, end_step: int, *, preempted: bool, total_time_s: float) -> None:
        """run.json's final results and status; the trackers' summary and files."""
        status = "preempted" if preempted else "completed"
        results = dataclasses.replace(
            self.summary.results(), total_time_s=total_time_s, **self.measured
        )
        write_run_file(
            self.run_dir,
            RunRecord(
                status=status, job=self.job, step=end_step, facts=self.facts, results=results
            ),
        )
        profiled = sorted((self.run_dir / PROFILE_DIR).glob("*.*"))  # traces, picture
        self.trackers.finish(
            status=status,
            summary=results.summary(step=end_step),
            files=[self.run_dir / RUN_FILE, self.run_dir / CONFIG_FILE, *profiled],
        )
        if not preempted:
            log.info(
                "done: step %d/%d, final loss %s, run dir %s",
                end_step,
                self.cfg.trainer.max_steps,
                f"{results.final_loss:.4f}" if results.final_loss is not None else "-",
                self.run_dir,
            )

    def fail(self) -> None:
        self.trackers.finish(status="failed", summary=self.summary.results().summary(), files=[])


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


def tracker_params(cfg: Config, facts: RunFacts, job: JobRecord | None) -> dict:
    """What every tracker records as the run's params: the flattened config, the chosen
    options, an Optuna trial's study and number, and some of the system's facts."""
    params = flatten(to_container(cfg))
    job = job or JobRecord()
    params.update({f"options.{g}": o for g, o in job.choices.items()})
    if job.study:
        params.update({"study.name": job.study, "study.trial": job.num})
    params.update({f"system.{k}": v for k, v in facts.system_params().items()})
    return {k: redact(v) for k, v in params.items()}


def _nf4_base(facts: RunFacts) -> str:
    """An NF4 base's bytes on the rank that holds most (``low_precision.measured``)."""
    held = (facts.low_precision or {}).get("bytes_per_rank")
    if not held:
        return ""
    mib = max(held) / 2**20
    return f"; the frozen base in NF4 ({NF4_BITS:.2f} bits a weight): {mib:,.1f} MiB per rank"


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
            "optimizer state%s",
            cfg.finetune.chosen(),
            f"{facts.trainable_params:,}",
            100 * facts.trainable_params / facts.total_params,
            _nf4_base(facts),
        )
    log.info(
        "loss=%s%s | optimizer %s | numbers read from the device every %d steps",
        facts.loss_kind,
        " (loss=auto)" if cfg.loss.kind is LossKind.auto else "",
        facts.optimizer,
        cfg.trainer.log_every,
    )
    if facts.world_size == 1 and not hardware_row(kind).one_process_per_host:
        log.info(
            "world size 1: FSDP2 on a 1-rank mesh, nothing sharded; its all-gathers and "
            "reduce-scatters are local copies, kept so that precision (param_dtype "
            "copies, fp32 master weights) and checkpoints are those of a sharded run"
        )
