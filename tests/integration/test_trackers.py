"""TensorBoard and MLflow, read back from what they wrote: a real MLflow server on localhost
(SQLite), TensorBoard's event files through its own EventAccumulator; resume after SIGTERM; an
unreachable server; and a tracker of one's own, added with one module and one YAML file."""

from __future__ import annotations

import json
import signal
import textwrap
from pathlib import Path

import pytest
from conftest import check_ok, run_python, start_train, train, wait_for_steps
from mlflow_server import mlflow_server
from wandb_files import offline_runs

from fsdp_lab.observe.run_logs import read_metrics

pytestmark = pytest.mark.slow  # runs of train.py: make test, not make test-fast

BASE = ("hardware=cpu", "trainer.eval_every=0")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        yield uri


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _check_tensorboard(log_dir: Path, key: str, want: list[tuple[int, float]]) -> None:
    """TensorBoard's scalars of ``key``: every step once, metrics.jsonl's values (as float32)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    got = sorted((e.step, e.value) for e in acc.Scalars(key))
    assert [s for s, _ in got] == [s for s, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-6)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir / "metrics.jsonl")]


@pytest.mark.slow
def test_every_tracker_continues_its_run_after_sigterm(server, tmp_path):
    run_dir = tmp_path / "run"
    run = (
        *BASE,
        "logger=[wandb,tensorboard,mlflow]",
        "logger.wandb.mode=offline",
        f"logger.mlflow.tracking_uri={server}",
        "trainer.max_steps=60",
        "trainer.log_every=1",
    )
    proc = start_train(run_dir, *run)
    wait_for_steps(run_dir, 3, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 75, stderr
    first = json.loads((run_dir / "run.json").read_text())["trackers"]
    assert first["mlflow"]["tracking_uri"] == server
    assert _client(server).get_run(first["mlflow"]["run_id"]).info.status == "KILLED"
    check_ok(train(run_dir, *run))
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["status"] == "completed" and facts["start_step"] > 0
    assert facts["trackers"] == first  # the same W&B run, TensorBoard dir and MLflow run
    want = _losses(run_dir)
    assert [s for s, _ in want] == list(range(1, 61))
    # Every step once in each tracker, with metrics.jsonl's values.
    client = _client(server)
    mlflow_run = client.get_run(first["mlflow"]["run_id"])
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.tags["fsdp_lab.status"] == "completed"
    assert _history(client, mlflow_run.info.run_id, "train/loss") == want
    assert mlflow_run.data.params["trainer.max_steps"] == "60"
    assert mlflow_run.data.params["system.world_size"] == "2"
    assert {a.path for a in client.list_artifacts(mlflow_run.info.run_id)} == {
        "run.json",
        "config.yaml",
    }
    _check_tensorboard(run_dir / "tensorboard", "train/loss", want)
    wandb_runs = offline_runs(run_dir)
    assert {r.run_id for r in wandb_runs} == {first["wandb"]["id"]}
    assert [h["_step"] for r in wandb_runs for h in r.history if "train/loss" in h] == list(
        range(1, 61)
    )


@pytest.mark.slow
def test_a_sweep_is_one_mlflow_parent_run_and_one_tensorboard_dir_per_job(server, tmp_path):
    sweep = tmp_path / "sweep"
    proc = run_python(
        [
            "train.py",
            "-m",
            f"hydra.sweep.dir={sweep}",
            "trainer.progress_bar=false",
            *BASE,
            "sharding=full,grad_op",
            "trainer.max_steps=3",
            "checkpoint=none",
            "logger=[tensorboard,mlflow]",
            f"logger.mlflow.tracking_uri={server}",
            "logger.mlflow.experiment=sweeps",
        ]
    )
    check_ok(proc)
    client = _client(server)
    parent_id = json.loads((sweep / "mlflow.json").read_text())["run_id"]
    parent = client.get_run(parent_id)
    assert parent.info.run_name == f"sweep {'/'.join(sweep.parts[-2:])}"
    assert parent.info.status == "FINISHED"  # ended with the sweep, its report attached
    assert {"report.md", "loss_curves.png"} <= {a.path for a in client.list_artifacts(parent_id)}
    for num, strategy in enumerate(("full", "grad_op")):
        job_dir = sweep / str(num)
        info = json.loads((job_dir / "run.json").read_text())["trackers"]
        child = client.get_run(info["mlflow"]["run_id"])
        assert child.data.tags["mlflow.parentRunId"] == parent_id
        assert child.data.params["sharding.strategy"] == strategy
        assert child.data.params["options.sharding"] == strategy
        assert child.data.tags["sharding"] == strategy
        assert _history(client, child.info.run_id, "train/loss") == _losses(job_dir)
        assert info["tensorboard"]["log_dir"] == str(job_dir / "tensorboard")
        _check_tensorboard(job_dir / "tensorboard", "train/loss", _losses(job_dir))


@pytest.mark.slow
def test_an_unreachable_mlflow_server_warns_once_and_the_run_completes(tmp_path):
    run_dir = tmp_path / "run"
    proc = train(
        run_dir,
        *BASE,
        "trainer.max_steps=4",
        "checkpoint=none",
        "logger=mlflow",
        "logger.mlflow.tracking_uri=http://127.0.0.1:9",
        "logger.mlflow.request_timeout_s=2",
        "logger.mlflow.max_retries=0",
    )
    check_ok(proc)
    assert proc.stderr.count("logger=mlflow failed to start") == 1, proc.stderr
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["status"] == "completed" and facts["trackers"] == {}
    assert [s for s, _ in _losses(run_dir)] == [1, 2, 3, 4]


MY_TRACKER = """
import json
from dataclasses import dataclass

from fsdp_lab.observe.trackers import RunInfo, Tracker


@dataclass
class Settings:
    file: str = "mine.jsonl"


class JsonTracker(Tracker):
    Settings = Settings

    def __init__(self, path):
        self.path = path

    @classmethod
    def start(cls, settings, run: RunInfo, *, resume):
        tracker = cls(run.run_dir / settings.file)
        tracker._write({"params": run.params["sharding.strategy"]})
        return tracker

    @property
    def info(self):
        return {"file": str(self.path)}

    def log_metrics(self, metrics, step):
        self._write({"step": step, **metrics})

    def finish(self, *, status, summary):
        self._write({"status": status, "final_loss": summary["final_loss"]})

    def _write(self, record):
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\\n")
"""


@pytest.mark.slow
def test_a_tracker_of_ones_own_is_one_module_and_one_yaml(tmp_path):
    """Nothing in fsdp_lab names it: the module and the YAML live outside the project."""
    (tmp_path / "my_tracker.py").write_text(MY_TRACKER)
    (tmp_path / "conf" / "logger").mkdir(parents=True)
    (tmp_path / "conf" / "logger" / "mine.yaml").write_text(
        textwrap.dedent(
            """\
            mine:
              tracker: my_tracker.JsonTracker
              file: mine.jsonl
            """
        )
    )
    run_dir = tmp_path / "run"
    proc = train(
        run_dir,
        *BASE,
        "trainer.max_steps=3",
        "checkpoint=none",
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        "logger=[mine]",
        env={"PYTHONPATH": str(tmp_path)},
    )
    check_ok(proc)
    records = [json.loads(line) for line in (run_dir / "mine.jsonl").read_text().splitlines()]
    assert records[0] == {"params": "full"}
    assert [(r["step"], r["train/loss"]) for r in records[1:-1]] == _losses(run_dir)
    assert records[-1] == {"status": "completed", "final_loss": _losses(run_dir)[-1][1]}
    facts = json.loads((run_dir / "run.json").read_text())
    assert facts["trackers"] == {"mine": {"file": str(run_dir / "mine.jsonl")}}
