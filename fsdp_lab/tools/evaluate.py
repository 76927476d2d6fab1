"""`fsdp-lab eval RUN_DIR_OR_HF_DIR --tasks ...`: lm-evaluation-harness scores of a run's export
(its hf/ directory) or of any Hugging Face directory, in this one process.

    fsdp-lab eval outputs/2026-11-27/10-00-00 --tasks lab_facts_mc \
        --include-path tests/harness_tasks
    fsdp-lab eval ~/models/SmolLM2-135M --tasks hellaswag,arc_easy --limit 200   # hub reachable

The model runs through the same lm-eval ``LM`` as a run's in-training scores
(``train.harness_lm.ShardedLM``), here on one device. For a run dir the scores also go into its
run.json (``harness``), its metrics.jsonl (a ``harness`` row at the run's last step, source
``export``) and its trackers (the run's own W&B / MLflow / TensorBoard runs, continued).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time
from pathlib import Path

from fsdp_lab.config import ConfigError, HardwareConfig
from fsdp_lab.engine.hardware import devices
from fsdp_lab.observe import rundir
from fsdp_lab.observe.record import HarnessRecord, RunResults
from fsdp_lab.observe.run_logs import MetricsWriter
from fsdp_lab.observe.trackers import RunInfo, TrackerSet
from fsdp_lab.train.evaluation import Decoding, HarnessScores
from fsdp_lab.train.generate import Lockstep
from fsdp_lab.train.harness import HarnessTasks, include_dir

log = logging.getLogger("fsdp_lab")

MODEL_FILES = ("config.json", "adapter_config.json")  # a whole model, or PEFT's adapter


def add_parser(sub, name: str) -> None:
    p = sub.add_parser(
        name, help="lm-evaluation-harness scores of a run's export or a Hugging Face directory"
    )
    p.add_argument("path", type=Path, help="a run dir (its hf/ export) or a Hugging Face dir")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--limit", type=int, help="at most this many documents per task")
    p.add_argument(
        "--include-path",
        help="a folder of lm-eval task YAMLs (lm-eval's --include_path; fsdp_lab ships "
        "tests/harness_tasks)",
    )
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's)")
    p.add_argument("--batch-size", type=int, default=8, help="requests per forward (8)")
    p.add_argument("--json", action="store_true", help="print the scores as JSON")


def run(args: argparse.Namespace) -> int:

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks names no task; give e.g. --tasks hellaswag,arc_easy")
    for flag, value in (("--batch-size", args.batch_size), ("--limit", args.limit)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag}={value} must be >= 1")
    run_dir, model_dir = _source(Path(args.path))
    harness = HarnessTasks(tasks, include_dir(args.include_path), args.limit, args.num_fewshot)
    harness.task_manager()  # an unknown task fails before the model is read
    started = time.perf_counter()
    results = harness.evaluate(_lm(model_dir, args.batch_size))
    scores = HarnessScores(results, time.perf_counter() - started)
    if args.json:
        print(json.dumps(scores.flat(), indent=1))
    else:
        for name, value in scores.flat().items():
            print(f"{name:<48} {value:.4f}")
    if run_dir is not None:
        record_scores(run_dir, scores)
        print(f"recorded in {run_dir / rundir.RUN_FILE} and the run's trackers")
    return 0


def _source(path: Path) -> tuple[Path | None, Path]:
    """(the run dir, or None; the model's directory)."""
    if (path / rundir.RUN_FILE).is_file():
        model_dir = path / rundir.HF_EXPORT_DIR
        if not any((model_dir / f).is_file() for f in MODEL_FILES):
            raise ConfigError(
                f"{path} is a run dir without a Hugging Face export ({rundir.HF_EXPORT_DIR}/): "
                f"write one with `fsdp-lab export {path} {model_dir}` (or train with "
                "checkpoint.export_hf=true)"
            )
        status = rundir.read_run_file(path).status
        if status in ("starting", "running"):
            raise ConfigError(
                f"{path} is still {status} (run.json): its run.json and trackers are the run's "
                f"to write; score its export once it ended, or a copy: `fsdp-lab eval "
                f"{model_dir} ...`"
            )
        return path, model_dir
    if not any((path / f).is_file() for f in MODEL_FILES):
        raise ConfigError(
            f"{path} is neither a run dir (no {rundir.RUN_FILE}) nor a Hugging Face directory "
            f"(no {' or '.join(MODEL_FILES)}); pass one of them"
        )
    return None, path


def _lm(model_dir: Path, batch_size: int):
    """The directory's model (a PEFT adapter: merged into its base) on this machine's device,
    behind the same lm-eval ``LM`` as a run's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fsdp_lab.train.harness_lm import ShardedLM

    kind = devices.resolve_kind(HardwareConfig())
    device = devices.rank_device(kind, 0)
    try:
        if (model_dir / "adapter_config.json").is_file():
            from peft import AutoPeftModelForCausalLM

            model = AutoPeftModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
            model = model.merge_and_unload()
        else:
            model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{model_dir}: cannot load the model or its tokenizer ({e})") from None
    model.to(device).eval()
    return ShardedLM(
        model,
        Decoding.of(tokenizer, model.config),
        lock=Lockstep(device=device),
        batch_size=batch_size,
    )


def record_scores(run_dir: Path, scores: HarnessScores) -> None:
    """The scores into the run's run.json, metrics.jsonl and trackers, at its last step."""
    from fsdp_lab.train.reporter import tracker_params

    run = rundir.read_run_file(run_dir)
    step = run.step if run.step is not None else (run.start_step or 0)
    record = HarnessRecord(
        step, scores=scores.flat(), harness_time_s=scores.time_s, source="export"
    )
    writer = MetricsWriter(run_dir / rundir.METRICS_FILE)
    writer.write(record.to_dict())
    writer.close()
    results = dataclasses.replace(
        run.results or RunResults(),
        harness=record.scores,
        harness_step=step,
        harness_source=record.source,
    )
    rundir.write_run_file(run_dir, dataclasses.replace(run, results=results))
    earlier = run.tracker_runs()
    if not earlier or run.facts is None:
        return
    cfg = rundir.load_run_config(run_dir)
    info = RunInfo(run_dir, tracker_params(cfg, run.facts, run.job_record), run.job or {})
    trackers = TrackerSet.start(
        cfg.logger,
        info,
        resume={name: v for name, v in earlier.items() if v},
        logged_through=step - 1,  # the trackers have the run's steps; this row is new
        history=[],
    )
    trackers.log([record.to_dict()])
    trackers.finish(
        status=run.status or "completed",
        summary=results.summary(step=run.step),
        files=[run_dir / rundir.RUN_FILE],
    )
