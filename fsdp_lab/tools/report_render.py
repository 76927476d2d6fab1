"""What `fsdp-lab report` writes from the figures it read: report.md's text (its plots are
``report_plots``'s), and the records both read: a ``Job`` and its ``Figures``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from fsdp_lab.observe.profile.result import StepBreakdown
from fsdp_lab.observe.record import EvalRecord, RunRecord, SampleRecord, StepRecord

THROUGHPUT_PNG, LOSS_PNG = "throughput_vs_memory.png", "loss_curves.png"
STEP_BREAKDOWN_PNG = "step_breakdown.png"  # only where a job ran with profile=trace
# The profile's columns: (header, the time whose share of the step they give).
PROFILE_COLUMNS = (
    ("compute", "compute_s"),
    ("comm", "comm_s"),
    ("exposed comm", "exposed_comm_s"),
    ("idle", "idle_s"),
)
ERROR_CHARS = 90  # enough of an error to recognise it in the table; run.json holds all of it
MAX_RANKS_LISTED = 8  # beyond this the per-rank cell gives the range


@dataclass
class Job:
    """One job dir as the report sees it."""

    name: str  # the dir's name: Hydra's job number
    run: RunRecord  # its run.json
    options: dict[str, str]  # its group choices and overrides, key -> value; {} if unknown
    train: list[StepRecord]  # metrics.jsonl records, one per optimizer step
    val: list[EvalRecord]  # one per evaluation
    samples: list[SampleRecord] = field(default_factory=list)  # samples.jsonl (eval.prompts)

    @property
    def status(self) -> str:
        return str(self.run.status or "unknown")


@dataclass
class Figures:
    """The table's numbers for one job; None where its run dir has no record of them."""

    steps: int | None
    tokens_per_s: float | None  # all ranks; median over the steps after the first
    step_time_s: float | None  # median over the steps after the first
    peak_mib_per_rank: list[float]  # each rank's highest peak over the run
    final_loss: float | None  # the last step's train loss
    val_loss: float | None  # the last evaluation's
    mfu: float | None  # median after the first step; None where the device has no peak FLOPs
    # profile=trace's mean step over its window and ranks; None for a job not profiled
    profile: StepBreakdown | None = None
    harness: dict[str, float] = field(default_factory=dict)  # the last lm-eval scores
    sample: str | None = None  # the last evaluation's first generation (eval.prompts)
    predicted: dict | None = None  # run.json's predicted step (planning.run_check)


def render_markdown(
    sweep_dir: Path,
    jobs: list[Job],
    figures: list[Figures],
    varying: list[str],
    fixed: dict[str, str],
    study: dict | None = None,
) -> str:
    """report.md: a header of what all jobs share (and an Optuna study's best trial), one table
    row per job (``_columns``), how to read it."""
    counts = Counter(job.status for job in jobs)
    facts = [j.run.facts for j in jobs if j.run.facts and j.run.facts.hardware is not None]
    hardware = dict.fromkeys(
        f"{f.hardware}, {'?' if f.world_size is None else f.world_size} ranks" for f in facts
    )
    lines = [
        "# Sweep report",
        "",
        f"`{sweep_dir.resolve()}`: {len(jobs)} jobs "
        f"({', '.join(f'{n} {status}' for status, n in counts.items())}).",
        "",
    ]
    if hardware:
        lines += [f"hardware: {'; '.join(hardware)}", ""]
    if fixed:
        lines += ["fixed: " + ", ".join(f"{k}={v}" for k, v in fixed.items()), ""]
    lines += _study_lines(study) if study else []
    columns = _columns(figures, varying, study)
    lines += [_row([h for heads, _ in columns for h in heads])]
    lines += [_row(["---"] * sum(len(heads) for heads, _ in columns))]
    for job, f in zip(jobs, figures, strict=True):
        lines.append(_row([c for _, cells in columns for c in cells(job, f)]))
    has_profile = any(f.profile is not None for f in figures)
    notes = [*NOTES, *[PROFILE_NOTE] * has_profile]
    notes += [HARNESS_NOTE] * any(f.harness for f in figures)
    notes += [PREDICTED_NOTE] * any(f.predicted is not None for f in figures)
    notes += [SAMPLE_NOTE] * any(f.sample is not None for f in figures)
    lines += ["", *notes, ""]
    lines += [f"![throughput vs peak memory]({THROUGHPUT_PNG})", ""]
    lines += [f"![loss curves]({LOSS_PNG})", ""]
    lines += [f"![step breakdown]({STEP_BREAKDOWN_PNG})", ""] * has_profile
    return "\n".join(lines)


def _columns(figures: list[Figures], varying: list[str], study: dict | None) -> list:
    """The table's columns, in groups of (headers, the cells of a job): those every report has,
    then each one some job has a figure for (validation, MFU, profile, prediction, lm-eval
    scores, a sample), then a study's objective."""
    trials = (study or {}).get("trials", [])
    values = {str(t["number"]): t.get("value") for t in trials}
    interrupted = {
        str(t["number"]) for t in trials if str(t.get("error") or "").startswith("interrupted")
    }
    scores = list(dict.fromkeys(name for f in figures for name in f.harness))
    columns = [
        (
            [
                "job",
                *varying,
                "status",
                "steps",
                "tokens/s",
                "step time (ms)",
                "peak MiB (max rank)",
                "peak MiB per rank",
                "final loss",
            ],
            lambda job, f: [
                job.name,
                *(job.options.get(k, "?") for k in varying),
                # a study's trial cut off by a stop: its run.json still says how far it got
                "interrupted" if job.name in interrupted else _status_cell(job),
                _fmt(f.steps, "{}"),
                _fmt(f.tokens_per_s, "{:,.0f}"),
                _fmt(f.step_time_s and f.step_time_s * 1000, "{:.1f}"),
                _fmt(max(f.peak_mib_per_rank, default=None), "{:.0f}"),
                _per_rank_cell(f.peak_mib_per_rank),
                _fmt(f.final_loss, "{:.4f}"),
            ],
        ),
        (["val loss"], lambda job, f: [_fmt(f.val_loss, "{:.4f}")], lambda f: f.val_loss),
        (["MFU"], lambda job, f: [_fmt(f.mfu, "{:.1%}")], lambda f: f.mfu),
        (
            [n for n, _ in PROFILE_COLUMNS],
            lambda job, f: _profile_cells(f.profile),
            lambda f: f.profile,
        ),
        (
            list(PREDICTED_COLUMNS),
            lambda job, f: _predicted_cells(f.predicted),
            lambda f: f.predicted,
        ),
        (scores, lambda job, f: [_fmt(f.harness.get(name), "{:.4f}") for name in scores]),
        (["first sample"], lambda job, f: [_sample_cell(f.sample)], lambda f: f.sample),
    ]
    if study:
        objective = f"objective ({study.get('objective')})"
        columns.append(([objective], lambda job, f: [_fmt(values.get(job.name), "{:.6g}")]))
    return [
        (heads, cells)
        for heads, cells, *figure in columns
        if heads and (not figure or any(figure[0](f) is not None for f in figures))
    ]


def _study_lines(study: dict) -> list[str]:
    """The study's objective, its trials' outcome and its best trial (job dir = trial number)."""
    trials = study.get("trials", [])
    states = Counter(str(t.get("state", "?")).lower() for t in trials)
    lines = [
        f"Optuna study `{study.get('study_name')}`: objective {study.get('objective')} "
        f"({study.get('direction')}), {len(trials)} trials "
        f"({', '.join(f'{n} {state}' for state, n in states.items())}).",
        "",
    ]
    best = study.get("best")
    if best:
        params = " ".join(f"{k}={v}" for k, v in best["params"].items())
        lines += [f"best: trial {best['trial']}, {best['value']:.6g}: `{params}`", ""]
    return lines


NOTES = [
    "- **tokens/s** (all ranks together) and **step time**: the median over the optimizer steps "
    "after the first (and after the first of a resumed run): those include warm-up "
    "(allocation, first collectives, compilation).",
    "- **peak MiB**: each rank's highest peak memory over the run (1 MiB = 2^20 bytes); on GPU "
    "the allocator's peak, on CPU the process's resident-set high-water mark (which includes "
    "the interpreter and libraries).",
    "- **final loss**: the train loss of the last step recorded; **val loss**: the last "
    "evaluation's. A failed job's full error is in its run.json.",
]


PROFILE_NOTE = (
    "- **compute**, **comm**, **exposed comm**, **idle** (profile=trace): shares of the "
    "profiled step, the mean over the profiled window's steps and ranks. compute, exposed comm "
    "(comm that no compute covered) and idle (neither) add up to the step; comm overlapped by "
    "compute counts in compute. On CPU, comm is gloo's threads and compute the main thread's "
    "ops; on GPU, NCCL kernels and the other kernels. `step_breakdown.png` draws them in ms "
    "(the profiled steps, which carry the profiler's own cost: a few % above step time). "
    "Per FSDP unit: `fsdp-lab profile JOB_DIR`."
)


HARNESS_NOTE = (
    "- **task/metric** (eval.harness_tasks, or `fsdp-lab eval`): lm-evaluation-harness's "
    "score of the job's model, the last one its run.json holds (lm-eval's `acc,none` is "
    "`acc`; a filter's score is `metric/filter`)."
)
SAMPLE_NOTE = (
    "- **first sample**: the first prompt's completion at the job's last evaluation "
    "(eval.prompts; every one is in the job's samples.jsonl)."
)
SAMPLE_CHARS = 60  # of a generation, in the table


def _sample_cell(text: str | None) -> str:
    """A generation on one line, cut short; "-" for none."""
    if text is None:
        return "-"
    flat = " ".join(text.split())
    return flat[: SAMPLE_CHARS - 1] + "…" if len(flat) > SAMPLE_CHARS else flat


def _profile_cells(profile: StepBreakdown | None) -> list[str]:
    """The profile's columns as shares of the step ("41%"); "-" for a job not profiled."""
    if profile is None:
        return ["-"] * len(PROFILE_COLUMNS)
    return [f"{profile.share(time):.0%}" for _, time in PROFILE_COLUMNS]


PREDICTED_COLUMNS = ("predicted (ms)", "measured / predicted", "predicted split", "departs")
PREDICTED_NOTE = (
    "predicted: the time model's step on the run's hardware profile (`hardware.profile`; "
    "`fsdp-lab plan` prints the same), split into compute / exposed comm / optimizer / other "
    "as shares of it; departs: where the run is furthest from it (with profile=trace, its "
    "measured compute and exposed comm against the predicted)."
)


def _predicted_cells(p: dict | None) -> list[str]:
    """The predicted step, the ratio, the predicted split and the departure; "-" without."""
    if not p or not p.get("step_s"):
        return ["-"] * len(PREDICTED_COLUMNS)
    split = " / ".join(
        f"{p.get(k, 0.0) / p['step_s']:.0%}"
        for k in ("compute_s", "exposed_comm_s", "optimizer_s", "other_s")
    )
    return [
        f"{p['step_s'] * 1000:.1f}",
        f"{p.get('measured_over_predicted', 0.0):.2f}x",
        split,
        str(p.get("departs", "-")),
    ]


def _status_cell(job: Job) -> str:
    """The status, with a failure's one-line error (shortened: the table stays readable)."""
    if job.status == "preempted" and job.run.step is not None:
        return f"preempted at step {job.run.step}"
    error = " ".join(str(job.run.error or "").split())
    if len(error) > ERROR_CHARS:
        error = error[: ERROR_CHARS - 1] + "…"
    return f"{job.status}: {error}" if error else job.status


def _per_rank_cell(peaks: list[float]) -> str:
    """Each rank's peak, or their range where a list would swamp the table."""
    if not peaks:
        return "-"
    if len(peaks) > MAX_RANKS_LISTED:
        return f"{min(peaks):.0f} to {max(peaks):.0f} ({len(peaks)} ranks)"
    return " / ".join(f"{p:.0f}" for p in peaks)


def _fmt(value, spec: str) -> str:
    """A number in spec, "-" for none (a diverged step's nan or inf shows as such)."""
    return "-" if value is None else spec.format(value)


def _row(cells: list[str]) -> str:
    """A Markdown table row; a | inside a cell (an error message) would split it."""
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
