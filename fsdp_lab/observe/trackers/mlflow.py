"""``logger=mlflow``: one MLflow run per job, from rank 0, through MLflow's client.

- Where: ``logger.mlflow.tracking_uri``: a server (``http://host:5000``), or by default MLflow's
  own default, a local ``mlruns/`` store in the directory train.py runs from (``mlflow ui
  --backend-store-uri mlruns`` shows it). ``MLFLOW_TRACKING_URI`` is honoured when it is set and
  the setting is not.
- What: params are the flattened config with the chosen options and the system's facts; the
  metrics are metrics.jsonl's, per optimizer step; run.json and config.yaml are artifacts; the
  summary's numbers are the run's last metrics under `summary/`.
- A sweep's jobs are child runs of one parent run named after the sweep (its id is kept in
  <multirun dir>/mlflow.json, created under a lock by the first job), which gets the sweep's
  report.md and plots when the sweep ends. ``nested=false`` tags them with the group instead.
- Resume after a preemption continues the same run (its id is in run.json); steps the earlier
  attempt logged are not logged twice. A preempted attempt is marked KILLED, a failed one FAILED.
- A server that cannot be reached fails the start after ``request_timeout_s`` and
  ``max_retries``: one warning, and the run goes on without MLflow.

Needs MLflow's client (``mlflow-skinny`` is enough); the ``trackers`` extra installs the full
``mlflow``, whose server runs in the same environment (docs/experiments-and-wandb.md).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from fsdp_lab.observe.trackers.base import RunInfo, Tracker, redact

log = logging.getLogger("fsdp_lab")

SWEEP_FILE = "mlflow.json"  # a multirun dir's parent run: uri, experiment, run id
_STATUS = {"completed": "FINISHED", "preempted": "KILLED", "failed": "FAILED"}
_MAX_PARAMS = 100  # per log_batch call (MLflow's limit)
_MAX_METRICS = 1000  # per log_batch call (MLflow's limit)
_MAX_VALUE = 6000  # characters of a param value (MLflow's limit)


@dataclass
class MlflowSettings:
    tracking_uri: Optional[str] = None
    """A server (http://host:5000), a database, or a file store; None: MLFLOW_TRACKING_URI if
    set, else ./mlruns in the directory train.py runs from."""
    experiment: str = "fsdp_lab"
    """The MLflow experiment, created when missing."""
    run_name: Optional[str] = None
    """None: the job's overrides (e.g. `sharding=hybrid,precision=bf16`), else the run dir's."""
    group: Optional[str] = None
    """None: a sweep's jobs share a parent run named after its multirun dir."""
    nested: bool = True
    """A sweep's jobs as child runs of one parent run; false: only tagged with the group."""
    tags: List[str] = field(default_factory=list)
    """Added to the automatic tags (each config group's chosen option, as group: option)."""
    request_timeout_s: int = 10
    """Seconds one request to a server may take (MLflow's own default waits 120)."""
    max_retries: int = 2
    """Retries of a failed request (MLflow's own default, 7 with backoff, takes minutes)."""

    def __post_init__(self) -> None:
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s}: must be positive")
        if self.max_retries < 0:
            raise ValueError(f"max_retries={self.max_retries}: must be 0 or more")


class MlflowTracker(Tracker):
    """Rank 0's MLflow run."""

    Settings = MlflowSettings
    requires = (("mlflow", "mlflow-skinny"),)

    def __init__(self, client, info: dict) -> None:
        self._client = client
        self._info = info
        self._run_id = info["run_id"]
        self._pending: list = []  # a logging window's metrics, sent in one request by flush

    @classmethod
    def start(cls, settings: MlflowSettings, run: RunInfo, *, resume: dict | None) -> MlflowTracker:
        client, uri = _client(settings)
        if resume is not None and resume.get("tracking_uri") == redact(uri):
            client.update_run(resume["run_id"], status="RUNNING")
            log.info("MLflow: continuing run %s at %s", resume["run_id"], redact(uri))
            tracker = cls(client, resume)
            tracker.continues = True
            return tracker
        experiment_id = _experiment(client, settings.experiment)
        ident = run.identity(group=settings.group, name=settings.run_name, tags=settings.tags)
        tags = dict(_tag(t) for t in ident["tags"])
        tags.update({"fsdp_lab.job_type": ident["job_type"], "fsdp_lab.run_dir": str(run.run_dir)})
        parent = None
        if ident["group"]:
            tags["fsdp_lab.group"] = ident["group"]
            if settings.nested and run.sweep_dir is not None:
                parent = _parent_run(
                    client,
                    uri=uri,
                    experiment_id=experiment_id,
                    sweep_dir=run.sweep_dir,
                    group=ident["group"],
                )
                tags["mlflow.parentRunId"] = parent
        created = client.create_run(experiment_id, run_name=ident["name"], tags=tags)
        run_id = created.info.run_id
        _log_params(client, run_id, run.params)
        log.info("MLflow: run %s (%s) in experiment %s at %s", run_id, ident["name"],
                 settings.experiment, redact(uri))  # fmt: skip
        info = {"run_id": run_id, "experiment_id": experiment_id, "tracking_uri": redact(uri)}
        if parent:
            info["parent_run_id"] = parent
        return cls(client, info)

    @property
    def info(self) -> dict:
        return self._info

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending.extend(Metric(k, float(v), now, step) for k, v in metrics.items())

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), _MAX_METRICS):
            self._client.log_batch(self._run_id, metrics=pending[i : i + _MAX_METRICS])

    def log_samples(self, samples: list[dict], step: int) -> None:
        """One text artifact per evaluation: samples/step_<step>.jsonl (samples.jsonl's lines)."""
        text = "".join(json.dumps(s) + "\n" for s in samples)
        self._client.log_text(self._run_id, text, f"samples/step_{step:07d}.jsonl")

    def log_files(self, paths: list[Path]) -> None:
        for path in paths:
            self._client.log_artifact(self._run_id, str(path))

    def finish(self, *, status: str, summary: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        step = int(summary.get("step", 0))
        numbers = [
            Metric(f"summary/{k}", float(v), now, step)
            for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        if numbers:
            self._client.log_batch(self._run_id, metrics=numbers)
        self._client.set_tag(self._run_id, "fsdp_lab.status", status)
        self._client.set_terminated(self._run_id, status=_STATUS[status])

    @classmethod
    def log_sweep_files(cls, settings: MlflowSettings, sweep_dir: Path, paths: list[Path]) -> None:
        """The sweep's report on its parent run, which ends with it."""
        record = sweep_dir / SWEEP_FILE
        if not record.is_file():
            return
        parent = json.loads(record.read_text())
        client, uri = _client(settings)
        if redact(uri) != parent["tracking_uri"]:
            raise ValueError(f"the sweep's parent run is at {parent['tracking_uri']}, not here")
        for path in paths:
            client.log_artifact(parent["run_id"], str(path))
        client.set_terminated(parent["run_id"], status="FINISHED")


def _client(settings: MlflowSettings) -> tuple[Any, str]:
    # MLflow reads its HTTP limits from the environment only; a user's own values win.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(settings.request_timeout_s))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(settings.max_retries))
    uri = settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    uri = uri or (Path.cwd() / "mlruns").as_uri()
    if uri.startswith("file:") or "://" not in uri:
        # MLflow 3 refuses a file store unless asked; it is the one store the client alone
        # (mlflow-skinny) can write, with no SQLAlchemy.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri), uri


def _experiment(client, name: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # noqa: BLE001 - another job created it first
        return client.get_experiment_by_name(name).experiment_id


def _parent_run(client, *, uri: str, experiment_id: str, sweep_dir: Path, group: str) -> str:
    """The sweep's parent run, created once: the first job takes the lock and writes its id."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / f".{SWEEP_FILE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = sweep_dir / SWEEP_FILE
        if record.is_file():
            known = json.loads(record.read_text())
            if known["tracking_uri"] == redact(uri) and known["experiment_id"] == experiment_id:
                return known["run_id"]
        parent = client.create_run(
            experiment_id,
            run_name=f"sweep {group}",
            tags={"fsdp_lab.group": group, "fsdp_lab.sweep_dir": str(sweep_dir)},
        )
        known = {
            "tracking_uri": redact(uri),
            "experiment_id": experiment_id,
            "run_id": parent.info.run_id,
        }
        record.write_text(json.dumps(known, indent=2) + "\n")
        return parent.info.run_id


def _log_params(client, run_id: str, params: dict) -> None:
    from mlflow.entities import Param

    items = [Param(k, _param_value(v)) for k, v in params.items()]
    for i in range(0, len(items), _MAX_PARAMS):
        client.log_batch(run_id, params=items[i : i + _MAX_PARAMS])


def _tag(tag: str) -> tuple[str, str]:
    """`sharding=hybrid` as the tag sharding: hybrid (MLflow's keys take no `=`)."""
    key, _, value = tag.partition("=")
    return key, value or "true"


def _param_value(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text[:_MAX_VALUE]
