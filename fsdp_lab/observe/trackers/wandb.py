"""``logger=wandb``: Weights & Biases on rank 0, never the reason a run dies or hangs.

The W&B run's files live in <run dir>/wandb; its id is kept in run.json, so a resumed or
requeued run continues the same W&B run. A sweep's jobs share one group. An online start that
fails (no network, a bad key) becomes a warning and offline logging; metrics.jsonl has every
record either way.
"""

from __future__ import annotations

import enum
import logging
import netrc
import os
import secrets
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional
from urllib.parse import urlparse

from fsdp_lab.observe.rundir import SAMPLES_FILE
from fsdp_lab.observe.trackers.base import RunInfo, Tracker

log = logging.getLogger("fsdp_lab")

# What WANDB_MODE may say, as the mode it means (wandb also accepts the old names).
_ENV_MODES = {
    "online": "online",
    "run": "online",
    "offline": "offline",
    "dryrun": "offline",
    "disabled": "disabled",
}


class WandbMode(enum.Enum):
    auto = "auto"  # WANDB_MODE if set, else online with W&B credentials, else offline
    online = "online"
    offline = "offline"  # run files in <run dir>/wandb, `wandb sync` them later
    disabled = "disabled"


def credentials_configured() -> bool:
    """WANDB_API_KEY, or a `wandb login` entry in ~/.netrc for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        entry = netrc.netrc().authenticators(host or "api.wandb.ai")
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(entry and entry[2])


def resolve_mode(mode: WandbMode) -> tuple[str, str]:
    """(online|offline|disabled, why) for ``logger.wandb.mode``."""
    if mode is not WandbMode.auto:
        return mode.value, f"logger.wandb.mode={mode.value}"
    env = os.environ.get("WANDB_MODE")
    if env:
        return _ENV_MODES.get(env, "offline"), f"WANDB_MODE={env}"
    if credentials_configured():
        return "online", "W&B credentials are configured"
    return "offline", "no W&B credentials (WANDB_API_KEY or `wandb login`)"


def new_run_id() -> str:
    """Eight lowercase letters and digits, the form of W&B's own run ids."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


@dataclass
class WandbSettings:
    mode: WandbMode = WandbMode.auto
    """auto: WANDB_MODE when set, else online when W&B credentials are configured (WANDB_API_KEY
    or `wandb login`), else offline; the run's log says which. An online run that cannot reach
    W&B goes on offline with a warning."""
    project: str = "fsdp_lab"
    entity: Optional[str] = None
    """W&B team or user; None: the account's default."""
    group: Optional[str] = None
    """None: a sweep's jobs share one group named after its multirun dir; single runs none."""
    name: Optional[str] = None
    """None: the job's overrides (e.g. `sharding=hybrid,precision=bf16`), else the run dir's
    name."""
    tags: List[str] = field(default_factory=list)
    """Added to the automatic tags (the chosen option of every config group)."""
    init_timeout_s: int = 60
    """How long an online start may take before the run logs offline instead."""

    def __post_init__(self) -> None:
        if self.init_timeout_s <= 0:
            raise ValueError(f"init_timeout_s={self.init_timeout_s}: must be positive")


SAMPLE_COLUMNS = ("step", "index", "prompt", "output", "tokens")  # samples.jsonl's keys


def _kept_samples(run_dir: Path) -> list[list]:
    """samples.jsonl's rows as the `samples` table's (a resumed run's table goes on)."""
    from fsdp_lab.observe.run_logs import read_samples

    return [[getattr(x, c) for c in SAMPLE_COLUMNS] for x in read_samples(run_dir / SAMPLES_FILE)]


class WandbTracker(Tracker):
    """Rank 0's W&B run."""

    Settings = WandbSettings
    requires = (("wandb", "wandb"),)

    def __init__(self, run, info: dict, run_dir: Path) -> None:
        self._run, self._run_dir = run, run_dir
        self._samples: list[list] = []  # every evaluation's so far: each table logs them all
        self._info = info  # kept in run.json: id, mode, project, group, name

    @property
    def info(self) -> dict:
        return self._info

    @classmethod
    def start(
        cls, settings: WandbSettings, run: RunInfo, *, resume: dict | None
    ) -> WandbTracker | None:
        mode, why = resolve_mode(settings.mode)
        if mode == "disabled":
            log.info("W&B disabled (%s); metrics in metrics.jsonl", why)
            return None
        import wandb

        ident = run.identity(group=settings.group, name=settings.name, tags=settings.tags)
        # A W&B sweep agent starts train.py with the id of the run it created for the trial.
        run_id = (resume or {}).get("id") or os.environ.get("WANDB_RUN_ID") or new_run_id()
        (run.run_dir / "wandb").mkdir(exist_ok=True)
        kwargs = dict(
            project=settings.project,
            entity=settings.entity,
            dir=str(run.run_dir),
            id=run_id,
            resume="allow",
            config=run.params,
            **ident,
        )
        wandb_settings = wandb.Settings(init_timeout=settings.init_timeout_s)
        try:
            wb_run = wandb.init(mode=mode, settings=wandb_settings, **kwargs)
        except Exception as e:
            if mode != "online":
                raise
            log.warning(
                "W&B online start failed (%s); logging offline instead: `wandb sync "
                "%s/wandb/offline-run-*` later",
                str(e).splitlines()[0],
                run.run_dir,
            )
            mode, why = "offline", "online start failed"
            wandb.teardown()  # else the failed start keeps the run id "in use"
            wb_run = wandb.init(mode="offline", settings=wandb_settings, **kwargs)
        wb_run.define_metric("train/loss", summary="min,last")
        wb_run.define_metric("val/loss", summary="min,last")
        log.info(
            "W&B %s (%s): run %s, name %s%s",
            mode,
            why,
            run_id,
            ident["name"],
            f", group {ident['group']}" if ident["group"] else "",
        )
        info = {
            "id": run_id,
            "mode": mode,
            "project": settings.project,
            "group": ident["group"],
            "name": ident["name"],
        }
        tracker = cls(wb_run, info, run.run_dir)
        tracker.continues = resume is not None  # resume="allow" with the earlier run's id
        if tracker.continues:  # the table goes on from the samples the attempt before kept
            tracker._samples = _kept_samples(run.run_dir)
        return tracker

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_samples(self, samples: list[dict], step: int) -> None:
        """A `samples` table of every evaluation's generations so far (W&B keeps each logged
        table as a version; the last holds the whole run's, as TRL's completions table)."""
        import wandb

        self._samples += [[s[c] for c in SAMPLE_COLUMNS] for s in samples]
        self._run.log(
            {"samples": wandb.Table(columns=list(SAMPLE_COLUMNS), data=self._samples)}, step=step
        )

    def log_files(self, paths: list[Path]) -> None:
        """The run's files (run.json, config.yaml, profile=trace's traces and timeline) as one
        artifact of the run, named after it; kept under their path in the run dir."""
        import wandb

        artifact = wandb.Artifact(f"run-{self._info['id']}-files", type="run-files")
        for path in paths:
            inside = path.parent.name if path.parent != self._run_dir else ""
            artifact.add_file(str(path), name=f"{inside}/{path.name}" if inside else path.name)
        self._run.log_artifact(artifact)

    def finish(self, *, status: str, summary: dict) -> None:
        """The summary, and the run closed; a failed or preempted run is marked so."""
        self._run.summary.update(summary)
        self._run.summary["status"] = status
        if status == "preempted":
            self._run.mark_preempting()
        self._run.finish(exit_code=0 if status == "completed" else 1)
