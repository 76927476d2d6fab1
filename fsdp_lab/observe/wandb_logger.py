"""Weights & Biases for a run: rank 0 only, and never the reason a run dies or hangs.

The W&B run's files live in <run dir>/wandb; its id is kept in run.json, so a resumed or
requeued run continues the same W&B run. A sweep's jobs share one group. An online start that
fails (no network, a bad key) becomes a warning and offline logging; metrics.jsonl has every
record either way.
"""

from __future__ import annotations

import logging
import netrc
import os
import secrets
import string
from pathlib import Path
from urllib.parse import urlparse

from fsdp_lab.config import Config, LoggerKind, WandbMode, to_container

log = logging.getLogger("fsdp_lab")

# What WANDB_MODE may say, as the mode it means (wandb also accepts the old names).
_ENV_MODES = {
    "online": "online",
    "run": "online",
    "offline": "offline",
    "dryrun": "offline",
    "disabled": "disabled",
}
_PER_RANK_SERIES = 8  # per-rank memory series are logged up to this many ranks


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
    """(online|offline|disabled, why) for ``logger.mode``."""
    if mode is not WandbMode.auto:
        return mode.value, f"logger.mode={mode.value}"
    env = os.environ.get("WANDB_MODE")
    if env:
        return _ENV_MODES.get(env, "offline"), f"WANDB_MODE={env}"
    if credentials_configured():
        return "online", "W&B credentials are configured"
    return "offline", "no W&B credentials (WANDB_API_KEY or `wandb login`)"


def new_run_id() -> str:
    """Eight lowercase letters and digits, the form of W&B's own run ids."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"sharding": {"strategy": "full"}} -> {"sharding.strategy": "full"}: filterable in W&B."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def run_identity(cfg: Config, run_dir: Path, job: dict | None) -> dict:
    """Name, group, job type and tags of a run's W&B run, from its job (see sweep.job_info)."""
    job = job or {}
    overrides = [o for o in job.get("overrides", []) if not o.startswith("hydra.")]
    sweep_dir = job.get("sweep_dir")
    group = cfg.logger.group
    if group is None and sweep_dir:
        group = "/".join(Path(sweep_dir).parts[-2:])
    choices = job.get("choices", {})
    tags = [f"{g}={o}" for g, o in sorted(choices.items())] + list(cfg.logger.tags)
    name = ",".join(overrides) or run_dir.name
    if job.get("study"):  # an Optuna study's trial: its number first, as the study reports it
        tags.append(f"trial={job['num']}")
        name = f"trial {job['num']}: {name}"
    return {
        "name": cfg.logger.name or name,
        "group": group,
        "job_type": "sweep" if sweep_dir else "train",
        "tags": [t[:64] for t in tags],
    }


class WandbLogger:
    """Rank 0's W&B run. Every method swallows W&B's errors after one warning."""

    def __init__(self, run, info: dict) -> None:
        self._run = run
        self.info = info  # kept in run.json: id, mode, project, group, name

    @classmethod
    def start(
        cls, cfg: Config, run_dir: Path, *, facts: dict, job: dict | None, resume_id: str | None
    ) -> WandbLogger | None:
        """Start (or, with ``resume_id``, continue) the W&B run; None when disabled or when
        W&B cannot start at all (a warning: the run goes on, metrics.jsonl has everything)."""
        try:
            return cls._start(cfg, run_dir, facts=facts, job=job, resume_id=resume_id)
        except Exception as e:  # noqa: BLE001 - W&B must not end the run
            log.warning("W&B failed to start (%s); metrics in metrics.jsonl only", e)
            return None

    # Long: W&B's start and its fallbacks (offline, then none) must run in this order.
    @classmethod
    def _start(
        cls, cfg: Config, run_dir: Path, *, facts: dict, job: dict | None, resume_id: str | None
    ) -> WandbLogger | None:
        if cfg.logger.kind is LoggerKind.none:
            return None
        mode, why = resolve_mode(cfg.logger.mode)
        if mode == "disabled":
            log.info("W&B disabled (%s); metrics in metrics.jsonl", why)
            return None
        import wandb

        ident = run_identity(cfg, run_dir, job)
        # A W&B sweep agent starts train.py with the id of the run it created for the trial.
        run_id = resume_id or os.environ.get("WANDB_RUN_ID") or new_run_id()
        config = flatten(to_container(cfg))
        config.update({f"options.{g}": o for g, o in (job or {}).get("choices", {}).items()})
        if (job or {}).get("study"):
            config.update({"study.name": job["study"], "study.trial": job["num"]})
        config.update(
            {
                f"system.{k}": facts[k]
                for k in (
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
                if k in facts
            }
        )
        (run_dir / "wandb").mkdir(exist_ok=True)
        kwargs = dict(
            project=cfg.logger.project,
            entity=cfg.logger.entity,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
            **ident,
        )
        settings = wandb.Settings(init_timeout=cfg.logger.init_timeout_s)
        try:
            run = wandb.init(mode=mode, settings=settings, **kwargs)
        except Exception as e:  # noqa: BLE001 - W&B must not end the run
            if mode != "online":
                log.warning("W&B failed to start (%s); metrics in metrics.jsonl only", e)
                return None
            log.warning(
                "W&B online start failed (%s); logging offline instead: `wandb sync "
                "%s/wandb/offline-run-*` later",
                str(e).splitlines()[0],
                run_dir,
            )
            mode, why = "offline", "online start failed"
            try:
                wandb.teardown()  # else the failed start keeps the run id "in use"
                run = wandb.init(mode="offline", settings=settings, **kwargs)
            except Exception as e2:  # noqa: BLE001
                log.warning("W&B offline start failed too (%s); metrics.jsonl only", e2)
                return None
        run.define_metric("train/loss", summary="min,last")
        run.define_metric("val/loss", summary="min,last")
        log.info(
            "W&B %s (%s): run %s, name %s%s",
            mode,
            why,
            run_id,
            ident["name"],
            f", group {ident['group']}" if ident["group"] else "",
        )
        return cls(
            run,
            {
                "id": run_id,
                "mode": mode,
                "project": cfg.logger.project,
                "group": ident["group"],
                "name": ident["name"],
            },
        )

    def log(self, record: dict) -> None:
        """One metrics.jsonl record (its "split" says train or val), at its step."""
        self._log(
            self._train_data(record)
            if record["split"] == "train"
            else {
                "val/loss": record["val_loss"],
                "val/ppl": record["val_ppl"],
                "val/tokens": record["val_tokens"],
            },
            record["step"],
        )

    @staticmethod
    def _train_data(record: dict) -> dict:
        data = {
            f"train/{k}": v
            for k, v in record.items()
            if k not in ("split", "step", "peak_mem_bytes_per_rank") and v is not None
        }
        peaks = record["peak_mem_bytes_per_rank"]
        data["train/peak_mem_gib"] = max(peaks) / 2**30
        if len(peaks) <= _PER_RANK_SERIES:
            data.update({f"memory/peak_gib_rank{r}": b / 2**30 for r, b in enumerate(peaks)})
        return data

    def _log(self, data: dict, step: int) -> None:
        if self._run is None:
            return
        try:
            self._run.log(data, step=step)
        except Exception as e:  # noqa: BLE001
            self._give_up(e)

    def finish(self, *, status: str, summary: dict) -> None:
        """Write the summary and close the run; a failed or preempted run is marked so."""
        if self._run is None:
            return
        try:
            self._run.summary.update({k: v for k, v in summary.items() if v is not None})
            self._run.summary["status"] = status
            if status == "preempted":
                self._run.mark_preempting()
            self._run.finish(exit_code=0 if status == "completed" else 1)
        except Exception as e:  # noqa: BLE001
            self._give_up(e)
        self._run = None

    def _give_up(self, error: Exception) -> None:
        log.warning("W&B logging stopped (%s); metrics.jsonl has every record", error)
        self._run = None
