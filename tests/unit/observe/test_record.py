"""The run record: run.json and metrics.jsonl's rows round-trip through their dataclasses, old
files stay readable, and no module outside observe/ reads (or writes) them by string key."""

from __future__ import annotations

import ast
import dataclasses
import json
import textwrap
from pathlib import Path

import pytest

from fsdp_lab.config import Objective
from fsdp_lab.observe import run_logs, rundir
from fsdp_lab.observe.record import (
    EvalRecord,
    JobRecord,
    RunFacts,
    RunRecord,
    RunResults,
    StepRecord,
    objective_result,
    record_keys,
    step_of,
)

PACKAGE = Path(__file__).resolve().parents[3] / "fsdp_lab"

FACTS = {
    "world_size": 2,
    "num_nodes": 1,
    "hardware": "cpu: 2 cores",
    "backend": "gloo",
    "threads_per_rank": 1,
    "mesh_shape": [2],
    "mesh_axes": ["shard"],
    "fsdp_units": "LlamaDecoderLayer x2, root LlamaForCausalLM",
    "num_fsdp_units": 3,
    "model_class": "LlamaForCausalLM",
    "total_params": 155968,
    "trainable_params": 155968,
    "local_params_per_rank": [77984, 77984],
    "tokens_per_step": 512,
    "task": "causal_lm",
    "pretrained": False,
    "load_peak_rss_bytes_per_rank": [372305920, 372305920],
    "activation_checkpointing": [],
    "compiled": False,
    "loss_kind": "chunked",
    "optimizer": "AdamW (fused)",
    "data": {"kind": "synthetic"},
    "resumed_from": None,
    "start_step": 0,
    "torch": "2.13.0+cpu",
    "flops_per_token": 935808,
    "peak_flops": None,
    "transformers": "5.24.0",
    "trackers": {"tensorboard": {"log_dir": "/tmp/rr1/tensorboard"}},
}
JOB = {"overrides": ["trainer.max_steps=4"], "choices": {"sharding": "full"}, "sweep_dir": None}
RESULTS = {
    "final_loss": 5.54,
    "best_loss": 5.54,
    "final_val_loss": 5.53,
    "best_val_loss": 5.53,
    "final_val_ppl": 253.9,
    "median_tokens_per_s": 5273.7,
    "median_tokens_per_s_per_rank": 2636.8,
    "median_step_time_s": 0.097,
    "median_mfu": None,
    "peak_mem_bytes": 407146496,
    "total_time_s": 1.89,
}
COMPLETED = {**FACTS, "status": "completed", "job": {**JOB, "num": None}, "step": 4, **RESULTS}


@pytest.mark.parametrize(
    "written",
    [
        {},
        {"status": "starting", "job": {**JOB, "num": 0, "study": None}},
        {"status": "failed", "job": {"num": 0}, "error": "rank 1 died"},
        {**FACTS, "status": "running", "job": JOB},
        COMPLETED,
        {**COMPLETED, "profile": {"mode": "trace", "window": [3, 4]}, "logged_through_step": 4},
    ],
)
def test_run_json_written_by_this_version_reads_back_the_same(written):
    assert RunRecord.from_dict(json.loads(json.dumps(written))).to_dict() == written


def test_the_records_fields_are_what_the_writers_give():
    run = RunRecord.from_dict(COMPLETED)
    assert (run.status, run.step, run.start_step, run.error) == ("completed", 4, 0, None)
    assert run.facts.hardware == "cpu: 2 cores" and run.facts.world_size == 2
    assert run.results.median_tokens_per_s == 5273.7 and run.results.median_mfu is None
    assert run.job_record == JobRecord(["trainer.max_steps=4"], {"sharding": "full"})
    assert run.tracker_runs() == {"tensorboard": {"log_dir": "/tmp/rr1/tensorboard"}}
    assert RunFacts.from_dict(FACTS).system_params()["total_params"] == 155968


def test_facts_are_built_once_and_what_the_run_measures_is_a_result():
    run = RunRecord.from_dict({**COMPLETED, "state_bytes_per_rank": [10, 10], "profile": {}})
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.facts.world_size = 4
    assert run.results.state_bytes_per_rank == [10, 10] and run.results.profile == {}
    assert run.results.measured_fields() == {"state_bytes_per_rank": [10, 10], "profile": {}}
    # run.json keeps them at its top level as before; the trackers' summary does not take them
    assert run.to_dict()["state_bytes_per_rank"] == [10, 10]
    assert "state_bytes_per_rank" not in run.results.summary(step=4)
    assert run.results.summary(step=4)["final_loss"] == 5.54


def test_an_older_run_json_reads_with_what_it_has_and_keeps_what_it_does_not_know():
    """Before trackers=... run.json held W&B's run at the top level; before some facts existed
    it lacked them. Both read; an update keeps the unknown keys."""
    old = {"status": "preempted", "hardware": "cpu", "step": 3, "wandb": {"id": "x"}, "new": 1}
    run = RunRecord.from_dict(old)
    assert run.facts.hardware == "cpu" and run.facts.world_size is None
    assert run.results is None and run.extra == {"wandb": {"id": "x"}, "new": 1}
    assert run.tracker_runs() == {"wandb": {"id": "x"}}
    assert RunRecord.from_dict({"status": "starting"}).tracker_runs() is None
    assert run.to_dict()["new"] == 1 and run.to_dict()["wandb"] == {"id": "x"}


def test_update_run_file_keeps_the_facts_and_refuses_an_unknown_field(tmp_path):
    rundir.write_run_file(tmp_path, RunRecord.from_dict(COMPLETED))
    rundir.update_run_file(tmp_path, status="failed", error="rank 0: export failed")
    assert rundir.read_run_file(tmp_path).to_dict() == {
        **COMPLETED,
        "status": "failed",
        "error": "rank 0: export failed",
    }
    with pytest.raises(TypeError):
        rundir.update_run_file(tmp_path, final_loss=1.0)  # a result: not a top-level field


@pytest.mark.parametrize("objective", [o for o in Objective if o is not Objective.harness])
def test_every_objective_names_a_result(objective):
    """(objective=harness names one score of the result: its test is below.)"""
    field = objective_result(objective)
    assert field in RESULTS
    assert RunResults.from_dict(RESULTS).objective(objective) == RESULTS[field]
    assert RunResults().objective(objective) is None


def test_rows_round_trip_and_a_dense_step_has_no_expert_keys(tmp_path):
    step = {
        "split": "train",
        "step": 1,
        "loss": 5.5,
        "grad_norm": 0.7,
        "lr": 1e-4,
        "step_time_s": 0.3,
        "tokens_per_s": 1720.8,
        "trained_tokens": 504,
        "peak_mem_bytes": 405663744,
        "peak_mem_bytes_per_rank": [405663744, 398315520],
        "skipped": False,
        "elapsed_s": 0.31,
        "trained_tokens_per_s": 1693.9,
        "tokens_per_s_per_rank": 860.4,
        "tflops_per_s_per_rank": 0.0008,
        "mfu": None,
    }
    val = {"split": "val", "step": 0, "val_loss": 5.5, "val_ppl": 259.7, "val_tokens": 2016}
    val["eval_time_s"] = 0.1
    assert StepRecord.from_dict(step).to_dict() == step
    assert EvalRecord.from_dict(val).to_dict() == val
    moe = {**step, "aux_loss": 0.01, "expert_load_imbalance": 1.5, "expert_load_per_layer": [1.5]}
    assert (
        list(StepRecord.from_dict(moe).to_dict())
        == list(step)[:12] + list(moe)[16:] + list(step)[12:]
    )
    assert step_of(val) == 0 and step_of({"split": "profile", "step": 7}) == 7
    path = tmp_path / rundir.METRICS_FILE
    old = {"step": 2, "loss": 5.0}  # before rows had splits: a train row
    lines = [json.dumps(r) for r in (val, step, old)] + ['{"split": "train", "st']
    path.write_text("\n".join(lines))
    rows = run_logs.read_rows(path, whole_lines_only=True)  # the cut last line skipped
    assert [r.step for r in rows.train] == [1, 2] and [r.val_loss for r in rows.val] == [5.5]
    with pytest.raises(ValueError):
        run_logs.read_rows(path)


def test_the_step_metrics_make_a_step_record():
    """Every field StepMetrics records and every throughput figure is a StepRecord field (a new
    one fails here, not in a run)."""
    from fsdp_lab.observe.metrics import StepMetrics, throughput

    m = StepMetrics(1, 5.0, 1.0, 1e-3, 0.1, 100.0, 10, 0, [0], aux_loss=0.1)
    row = StepRecord(
        **m.as_record(), **throughput(m, world_size=1, flops_per_token=6, peak_flops=1)
    )
    assert row.to_dict() == {"split": "train", **m.as_record(), **throughput(m, **_ONE_RANK)}


_ONE_RANK = {"world_size": 1, "flops_per_token": 6, "peak_flops": 1}


# --- No string keys outside observe/ ------------------------------------------------------------

# Words that are record keys and also keys of other dicts in fsdp_lab (a checkpoint's marker, a
# data cache's metadata, config group names, Optuna's trial attributes): not a sign of a record
# read. Reads of run.json and metrics.jsonl by these words are caught by the raw-read check
# below (the readers return dataclasses; a dict of either file is read only in observe/).
SHARED_WORDS = {
    "activation_checkpointing",  # a config group
    "backend",
    "choices",
    "compiled",
    "data",  # a checkpoint's trainer state
    "error",  # a data worker's message, a rank's error file, Optuna's user attribute
    "experts",
    "hardware",  # a config group
    "job",
    "loss",  # a config group
    "lr",
    "mesh_axes",  # fsdp-lab plan's JSON
    "num",
    "optimizer",  # a checkpoint's state
    "overrides",
    "profile",  # a config group, a CLI command
    "skipped",
    "split",  # a data cache's metadata
    "status",
    "step",  # a checkpoint's marker and trainer state
    "study",
    "sweep_dir",  # fsdp-lab report's argument
    "task",
    "torch",
    "trackers",
    "transformers",
    "wandb",  # a logger option
    "world_size",  # a checkpoint's marker
}
# Functions that give a metrics.jsonl's rows as dicts (for tests, benchmarks and users).
RAW_ROW_READERS = {"read_records", "read_metrics"}
RUN_DIR_FILES = {"RUN_FILE", "METRICS_FILE", "run.json", "metrics.jsonl"}


def string_key_uses(source: str, keys: frozenset[str]) -> list[str]:
    """Where source spells one of keys as a string (a subscript, a .get, an ``in``, a dict's key
    or value, any other constant but a docstring), builds a key with an f-string whose literal
    head begins several keys (``f"median_{key}"``), reads rows as dicts, or json-loads a run dir
    file."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    heads = [k[: i + 1] for k in keys for i, ch in enumerate(k) if ch == "_"]
    prefixes = {h for h in heads if heads.count(h) > 1}  # median_, final_, val_...
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if node.value in keys and id(node) not in docstrings:
                found.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and str(head.value) in prefixes:
                found.append(f"line {node.lineno}: f{str(head.value)!r}...")
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
            if name in RAW_ROW_READERS:
                found.append(f"line {node.lineno}: {name}(), rows as dicts")
            if name in ("load", "loads") and getattr(node.func, "value", None) is not None:
                inside = {
                    getattr(n, "id", None) or getattr(n, "attr", None) for n in ast.walk(node)
                }
                inside |= {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}
                if getattr(node.func.value, "id", None) == "json" and inside & RUN_DIR_FILES:
                    found.append(f"line {node.lineno}: json of a run dir file")
    return found + keyed_run_file_reads(tree)


def keyed_run_file_reads(tree: ast.AST) -> list[str]:
    """``read_run_file(d)["k"]``, ``.get("k")`` or ``"k" in``, directly or through a name bound
    to it in the same function: any key, shared words too (the file's own reader gives fields)."""

    def reads_run_file(node) -> bool:
        return any(
            isinstance(n, ast.Call)
            and (getattr(n.func, "id", None) or getattr(n.func, "attr", None)) == "read_run_file"
            for n in ast.walk(node)
        )

    found = []
    for scope in [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.Module)]:
        bound = {
            t.id
            for n in ast.walk(scope)
            if isinstance(n, ast.Assign) and reads_run_file(n.value)
            for t in n.targets
            if isinstance(t, ast.Name)
        }

        def is_record(node, bound=bound) -> bool:
            return (isinstance(node, ast.Name) and node.id in bound) or (
                isinstance(node, ast.Call) and reads_run_file(node)
            )

        for n in ast.walk(scope):
            keyed = (
                (isinstance(n, ast.Subscript) and is_record(n.value))
                or (
                    isinstance(n, ast.Call)
                    and isinstance(n.func, ast.Attribute)
                    and n.func.attr in ("get", "pop", "setdefault", "keys", "items")
                    and is_record(n.func.value)
                )
                or (
                    isinstance(n, ast.Compare)
                    and any(isinstance(op, ast.In | ast.NotIn) for op in n.ops)
                    and any(is_record(c) for c in n.comparators)
                )
            )
            if keyed:
                found.append(f"line {n.lineno}: run.json read as a dict")
    return sorted(set(found))


def outside_the_owner() -> dict[str, Path]:
    """fsdp_lab's modules but observe/ (the record's owner: it defines the keys, writes the
    files and turns rows into the trackers' names) and config/ (it names options, some alike
    objective=val_loss, and imports nothing of ours)."""
    skip = {PACKAGE / "observe", PACKAGE / "config"}
    return {
        str(p.relative_to(PACKAGE.parent)): p
        for p in sorted(PACKAGE.rglob("*.py"))
        if not any(p.is_relative_to(d) for d in skip)
    }


def test_no_module_outside_observe_reads_the_record_by_string_key():
    keys = record_keys() - SHARED_WORDS
    found = [
        f"{name}: {hit}"
        for name, path in outside_the_owner().items()
        for hit in string_key_uses(path.read_text(), keys)
    ]
    assert not found, "run.json or metrics.jsonl keys by string (use observe.record):\n" + (
        "\n".join(found)
    )


OLD_SHAPES = {
    "tune's probe": """
        def probe(run_dir):
            facts = rundir.read_run_file(run_dir)
            return facts.get("peak_mem_bytes"), facts.get("median_tokens_per_s")
    """,
    "sweep's objective keys": """
        OBJECTIVE_KEYS = {Objective.val_loss: "final_val_loss"}
    """,
    "the summary's medians": """
        def as_dict(self):
            for key in KEYS:
                summary[f"median_{key}"] = statistics.median(values)
    """,
    "report's figures": """
        def summarize(job):
            return _median(steady, "tokens_per_s"), job.facts.get("start_step")
    """,
    "a run.json read as JSON": """
        def status(job_dir):
            return json.loads((job_dir / RUN_FILE).read_text())["status"]
    """,
    "study's trial": """
        def tell(job_dir):
            run = rundir.read_run_file(job_dir) if job_dir else {}
            return run.get("error") or f"run status {run.get('status', 'unknown')}"
    """,
    "sweep's failure": """
        def _record_failure(run_dir, code):
            return rundir.read_run_file(run_dir).get("error") or f"exit {code}"
    """,
    "rows read as dicts": """
        def _truncate(path):
            return [r["step"] for r in read_records(path)]
    """,
}


@pytest.mark.parametrize("shape", OLD_SHAPES)
def test_the_scan_finds_the_old_string_keyed_reads(shape):
    assert string_key_uses(textwrap.dedent(OLD_SHAPES[shape]), record_keys() - SHARED_WORDS)


def test_shared_words_are_record_keys():
    assert record_keys() >= SHARED_WORDS


def test_harness_results_and_rows_round_trip_and_name_the_objective():
    from fsdp_lab.config import Objective
    from fsdp_lab.observe.record import HarnessRecord, RunResults, SampleRecord
    from fsdp_lab.observe.trackers.base import metrics_of

    results = RunResults(harness={"arc_easy/acc": 0.5, "lab/exact_match": 0.25}, harness_step=8)
    again = RunResults.from_dict(results.to_dict())
    assert again.objective(Objective.harness) == 0.5  # the first score, unnamed
    assert again.objective(Objective.harness, "lab/exact_match") == 0.25
    assert RunResults().objective(Objective.harness) is None
    row = HarnessRecord(8, scores={"arc_easy/acc": 0.5}, harness_time_s=1.0, source="sharded")
    assert metrics_of(row.to_dict()) == {"harness/arc_easy/acc": 0.5}
    sample = SampleRecord(step=0, index=1, prompt="p", output="o", tokens=3)
    assert SampleRecord.from_dict(sample.to_dict()) == sample
