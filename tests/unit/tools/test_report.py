"""`fsdp-lab report`: a sweep's table and plots, from hand-built run dirs (a real sweep:
tests/integration/test_report_sweep.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import check_ok
from report_files import assert_png, cli_report, fixed_line, read_table

from fsdp_lab.config import ConfigError
from fsdp_lab.tools.report import write_report

MIB = 2**20
CHOICES = {"sharding": "full", "precision": "fp32", "model": "llama_tiny"}


# What Hydra's basic sweeper saves of `-m sharding=full,grad_op precision=fp32,bf16 ...`.
MULTIRUN_YAML = """\
hydra:
  sweeper:
    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper
    params: null
  overrides:
    task: ['sharding=full,grad_op', 'precision=fp32,bf16', 'trainer.max_steps=2']
  runtime:
    choices: {sharding: full, precision: fp32, model: llama_tiny, hydra/launcher: basic}
"""


def write_job(
    sweep: Path,
    num: int,
    *,
    status: str = "completed",
    error: str | None = None,
    overrides: tuple[str, ...] = (),
    steps: int = 0,
    val_steps: tuple[int, ...] = (),
    peaks: tuple[int, ...] = (400 * MIB, 410 * MIB),
    extra: dict | None = None,
    **facts,
) -> Path:
    """A job dir as a sweep leaves it: run.json (with the "job" record), and metrics.jsonl
    when the job trained (loss 5 - step/10, tokens/s 1000 * step, peaks growing by 1 MiB)."""
    job_dir = sweep / str(num)
    job_dir.mkdir(parents=True)
    choices = {
        **CHOICES,
        **{o.split("=")[0]: o.split("=")[1] for o in overrides if o.split("=")[0] in CHOICES},
    }
    record = {"overrides": list(overrides), "choices": choices, "num": num}
    run = {"status": status, "job": record, **facts}
    if error is not None:
        run["error"] = error
    (job_dir / "run.json").write_text(json.dumps(run))
    lines = [
        {
            "split": "train",
            "step": s,
            "loss": 5 - s / 10,
            "tokens_per_s": 1000.0 * s,
            "step_time_s": 1 / s,
            "peak_mem_bytes_per_rank": [p + s * MIB for p in peaks],
            "peak_mem_bytes": max(peaks) + s * MIB,
            **(extra or {}),
        }
        for s in range(1, steps + 1)
    ]
    lines += [{"split": "val", "step": s, "val_loss": 6 - s / 10} for s in val_steps]
    if lines:
        (job_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return job_dir


@pytest.fixture
def small_sweep(tmp_path: Path) -> Path:
    """Three jobs over sharding: two trained, one refused before launch (only run.json)."""
    sweep = tmp_path / "sweep"
    common = ("trainer.max_steps=4",)
    write_job(
        sweep,
        0,
        overrides=("sharding=full", *common),
        steps=4,
        val_steps=(0, 4),
        hardware="cpu: 2 cores",
        world_size=2,
        final_loss=4.6,
    )
    write_job(
        sweep,
        1,
        overrides=("sharding=grad_op", *common),
        steps=4,
        val_steps=(0, 4),
        hardware="cpu: 2 cores",
        world_size=2,
        final_loss=4.6,
    )
    write_job(
        sweep,
        2,
        overrides=("sharding=hybrid", *common),
        status="failed",
        error="sharding=hybrid on 2 ranks leaves shard groups of 1 | set replicate_size",
    )
    return sweep


def test_the_table_has_a_row_per_job_and_a_column_per_varying_option(small_sweep):
    paths = write_report(small_sweep)
    assert [p.name for p in paths] == ["report.md", "throughput_vs_memory.png", "loss_curves.png"]
    header, rows = read_table(paths[0])
    assert header[:3] == ["job", "sharding", "status"]
    assert [r["job"] for r in rows] == ["0", "1", "2"]
    assert [r["sharding"] for r in rows] == ["full", "grad_op", "hybrid"]
    fixed = fixed_line(paths[0])
    assert "trainer.max_steps=4" in fixed and "model=llama_tiny" in fixed
    assert "sharding" not in fixed
    # Steps 2..4 are steady state: median tokens/s 3000, step time 1/3 s; peaks at step 4.
    assert rows[0]["tokens/s"] == "3,000" and rows[0]["step time (ms)"] == "333.3"
    assert rows[0]["peak MiB (max rank)"] == "414" and rows[0]["peak MiB per rank"] == "404 / 414"
    assert rows[0]["final loss"] == "4.6000" and rows[0]["val loss"] == "5.6000"
    assert "MFU" not in header  # no job recorded one


def test_a_failed_job_shows_its_error_and_no_figures(small_sweep):
    _, rows = read_table(write_report(small_sweep)[0])
    failed = rows[2]
    assert failed["status"].startswith("failed: sharding=hybrid on 2 ranks")
    assert "\\| set replicate_size" in failed["status"]  # a | in an error cannot split the row
    assert failed["tokens/s"] == failed["final loss"] == failed["peak MiB per rank"] == "-"
    assert "hardware: cpu: 2 cores, 2 ranks" in (small_sweep / "report.md").read_text()


def test_a_sweep_whose_every_job_was_refused_still_gets_a_report(tmp_path):
    for num in range(2):
        write_job(
            tmp_path,
            num,
            overrides=(f"sharding=hybrid_{num}",),
            status="failed",
            error="sharding=hybrid on 2 ranks",
        )
    paths = write_report(tmp_path)
    _, rows = read_table(paths[0])
    assert [r["status"] for r in rows] == ["failed: sharding=hybrid on 2 ranks"] * 2
    for png in paths[1:]:
        assert_png(png)  # axes saying no job has metrics


def test_a_long_error_is_shortened(tmp_path):
    write_job(tmp_path, 0, status="failed", error="RuntimeError: " + "x" * 500)
    _, rows = read_table(write_report(tmp_path)[0])
    assert rows[0]["status"].endswith("…") and len(rows[0]["status"]) < 110


def test_preempted_running_and_diverged_jobs(tmp_path):
    write_job(tmp_path, 0, overrides=("optim.lr=1",), status="preempted", steps=3, step=3)
    write_job(tmp_path, 1, overrides=("optim.lr=2",), status="running", steps=2)
    diverged = write_job(
        tmp_path,
        2,
        overrides=("optim.lr=1e30",),
        status="failed",
        error="FloatingPointError: loss is nan",
        steps=2,
    )
    with (diverged / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"split": "train", "step": 3, "loss": float("nan")}) + "\n")
        f.write('{"split": "train", "step": 4, "lo')  # a line cut by a killed run
    _, rows = read_table(write_report(tmp_path)[0])
    assert [r["status"] for r in rows] == [
        "preempted at step 3",
        "running",
        "failed: FloatingPointError: loss is nan",
    ]
    assert [r["optim.lr"] for r in rows] == ["1", "2", "1e30"]
    assert rows[2]["final loss"] == "nan" and rows[2]["steps"] == "3"


def test_mfu_gets_a_column_when_recorded(tmp_path):
    write_job(tmp_path, 0, steps=3, extra={"mfu": 0.25})
    write_job(tmp_path, 1, steps=3, extra={"mfu": None})  # a device without peak FLOPs
    _, rows = read_table(write_report(tmp_path)[0])
    assert [r["MFU"] for r in rows] == ["25.0%", "-"]


def test_harness_scores_and_the_first_sample_get_columns(tmp_path):
    write_job(tmp_path, 0, steps=3, harness={"arc_easy/acc": 0.5, "lab_gen/exact_match": 0.25})
    write_job(tmp_path, 1, steps=3, harness={"arc_easy/acc": 0.75})  # scored on one task
    write_job(tmp_path, 2, steps=3)  # no eval.harness_tasks
    long = "To be, or not to be:\nthat is the question. " * 4
    for step, text in ((0, "before"), (3, long)):
        with (tmp_path / "0" / "samples.jsonl").open("a") as f:
            sample = {"step": step, "index": 0, "prompt": "Hamlet:", "output": text, "tokens": 9}
            f.write(json.dumps(sample) + "\n")
    header, rows = read_table(write_report(tmp_path)[0])
    assert header[-3:] == ["arc_easy/acc", "lab_gen/exact_match", "first sample"]
    assert [r["arc_easy/acc"] for r in rows] == ["0.5000", "0.7500", "-"]
    assert [r["lab_gen/exact_match"] for r in rows] == ["0.2500", "-", "-"]
    first = rows[0]["first sample"]  # the last evaluation's, on one line, cut short
    assert first.startswith("To be, or not to be: that is") and first.endswith("…")
    assert len(first) <= 60 and rows[1]["first sample"] == "-"


def test_an_old_sweep_without_job_records_reads_multirun_yaml(tmp_path):
    for num in range(4):
        job_dir = write_job(tmp_path, num, steps=2)
        run = json.loads((job_dir / "run.json").read_text())
        del run["job"]
        (job_dir / "run.json").write_text(json.dumps(run))
    (tmp_path / "multirun.yaml").write_text(MULTIRUN_YAML)
    report = write_report(tmp_path)[0]
    header, rows = read_table(report)
    assert header[1:3] == ["sharding", "precision"]
    # Hydra's basic sweeper runs the product with the last override varying fastest.
    assert [(r["sharding"], r["precision"]) for r in rows] == [
        ("full", "fp32"),
        ("full", "bf16"),
        ("grad_op", "fp32"),
        ("grad_op", "bf16"),
    ]
    assert fixed_line(report) == "fixed: trainer.max_steps=2, model=llama_tiny"


def test_a_sweep_still_running_lists_the_jobs_to_come(tmp_path):
    write_job(tmp_path, 0, overrides=("sharding=full", "precision=fp32"), steps=2)
    write_job(tmp_path, 1, overrides=("sharding=full", "precision=bf16"), status="running")
    (tmp_path / "multirun.yaml").write_text(MULTIRUN_YAML)
    header, rows = read_table(write_report(tmp_path)[0])
    assert header[1:3] == ["sharding", "precision"]  # not "fixed: sharding=full"
    assert [(r["job"], r["sharding"], r["status"]) for r in rows] == [
        ("0", "full", "completed"),
        ("1", "full", "running"),
        ("2", "grad_op", "not started"),
        ("3", "grad_op", "not started"),
    ]


def test_options_unknown_without_job_record_or_multirun_yaml(tmp_path):
    job_dir = write_job(tmp_path, 0, steps=2)
    (job_dir / "run.json").write_text(json.dumps({"status": "completed"}))
    header, rows = read_table(write_report(tmp_path)[0])
    assert header[:2] == ["job", "status"] and rows[0]["status"] == "completed"


def test_rerunning_replaces_the_report(small_sweep):
    paths = write_report(small_sweep)
    first = paths[0].read_text()
    for path in paths:
        path.write_bytes(b"stale")
    assert write_report(small_sweep) == paths
    assert paths[0].read_text() == first
    for png in paths[1:]:
        assert_png(png)
    assert not list(small_sweep.glob(".*.tmp"))


@pytest.mark.parametrize(
    "make,fragment",
    [
        (lambda d: None, "is not a directory"),
        (lambda d: d.mkdir(), "holds no job dir with a run.json"),
        (lambda d: (d / "0").mkdir(parents=True), "holds no job dir with a run.json"),
        (lambda d: d.mkdir() or (d / "run.json").write_text("{}"), "is a single run's dir"),
    ],
)
def test_a_dir_that_is_not_a_sweep_is_a_config_error(tmp_path, make, fragment):
    target = tmp_path / "target"
    make(target)
    with pytest.raises(ConfigError, match=fragment) as info:
        write_report(target)
    assert "multirun/" in str(info.value) and "\n" not in str(info.value)


def test_cli_prints_the_paths_or_one_error_line(small_sweep, tmp_path):
    proc = cli_report(small_sweep)
    check_ok(proc)
    assert proc.stdout.split() == [
        str(small_sweep / name)
        for name in ("report.md", "throughput_vs_memory.png", "loss_curves.png")
    ]
    proc = cli_report(tmp_path / "nowhere")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("fsdp-lab: error:") and len(proc.stderr.splitlines()) == 1


def test_a_studys_report_has_its_best_trial_and_an_objective_column(tmp_path):
    """hydra/sweeper=study's study.json: the study line, the best trial's parameters, each job's
    objective (job dir = trial number), and an interrupted trial said as such."""
    for num, lr in enumerate(("optim.lr=0.001", "optim.lr=0.01", "optim.lr=0.01")):
        write_job(tmp_path, num, overrides=(lr,), steps=2, status="completed")
    (tmp_path / "1" / "run.json").write_text(json.dumps({"status": "starting"}))
    trial = lambda n, state, value, error=None: {
        "number": n,
        "state": state,
        "value": value,
        "params": {"optim.lr": [0.001, 0.01, 0.01][n]},
        "error": error,
    }
    study = {
        "study_name": "fsdp_lab",
        "objective": "val_loss",
        "direction": "minimize",
        "best": {"trial": 2, "value": 4.25, "params": {"optim.lr": 0.01}},
        "trials": [
            trial(0, "COMPLETE", 4.5),
            trial(1, "FAIL", None, "interrupted: the study stopped while this trial ran"),
            trial(2, "COMPLETE", 4.25),
        ],
    }
    (tmp_path / "study.json").write_text(json.dumps(study))
    text = write_report(tmp_path)[0].read_text()
    assert (
        "Optuna study `fsdp_lab`: objective val_loss (minimize), 3 trials (2 complete, 1 fail)"
        in text
    )
    assert "best: trial 2, 4.25: `optim.lr=0.01`" in text
    _, rows = read_table(write_report(tmp_path)[0])
    assert [r["objective (val_loss)"] for r in rows] == ["4.5", "-", "4.25"]
    assert rows[1]["status"] == "interrupted"


def test_a_studys_searched_parameter_is_a_column_even_with_one_value_so_far(tmp_path):
    write_job(tmp_path, 0, overrides=("optim.lr=0.003", "sharding=full"), steps=2)
    trial = {"number": 0, "state": "COMPLETE", "value": 4.5, "params": {"optim.lr": 0.003}}
    study = {"study_name": "s", "objective": "val_loss", "direction": "minimize"}
    (tmp_path / "study.json").write_text(json.dumps({**study, "best": None, "trials": [trial]}))
    text = write_report(tmp_path)[0].read_text()
    fixed = next(line for line in text.splitlines() if line.startswith("fixed:"))
    assert "sharding=full" in fixed and "optim.lr" not in fixed
    _, rows = read_table(tmp_path / "report.md")
    assert rows[0]["optim.lr"] == "0.003"
