"""Trackers without a training run: the logger group's composition and checks, how a run is
named, W&B's mode, and that no tracker can end a run."""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
from conftest import assert_only_named_in
from hydra import compose, initialize_config_dir

from fsdp_lab.config import ConfigError
from fsdp_lab.config.load import register_schema, to_typed
from fsdp_lab.observe import trackers
from fsdp_lab.observe.trackers import RunInfo, Tracker, TrackerSet
from fsdp_lab.observe.trackers.base import flatten, redact
from fsdp_lab.observe.trackers.wandb import WandbMode, resolve_mode

CONF = Path(__file__).resolve().parents[3] / "conf"


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc from `wandb login`
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))


def test_auto_mode_is_offline_without_credentials_and_says_why(no_credentials, monkeypatch):
    assert resolve_mode(WandbMode.auto) == (
        "offline",
        "no W&B credentials (WANDB_API_KEY or `wandb login`)",
    )
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve_mode(WandbMode.auto) == ("online", "W&B credentials are configured")
    monkeypatch.setenv("WANDB_MODE", "disabled")  # W&B's own switch is honoured by auto
    assert resolve_mode(WandbMode.auto) == ("disabled", "WANDB_MODE=disabled")
    assert resolve_mode(WandbMode.offline) == ("offline", "logger.wandb.mode=offline")


def test_auto_mode_finds_a_wandb_login_netrc(no_credentials, tmp_path):
    (tmp_path / ".netrc").write_text(
        "machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n"
    )
    (tmp_path / ".netrc").chmod(0o600)
    assert resolve_mode(WandbMode.auto)[0] == "online"


def test_config_is_flattened_and_a_sweep_job_is_named_grouped_and_tagged(tmp_path):
    assert flatten({"sharding": {"strategy": "full"}, "seed": 0}) == {
        "sharding.strategy": "full",
        "seed": 0,
    }
    job = {
        "overrides": ["hydra.sweep.dir=/x", "sharding=hybrid", "precision=bf16"],
        "choices": {"sharding": "hybrid", "precision": "bf16"},
        "sweep_dir": "/home/u/multirun/2026-11-22/06-00-00",
        "num": 3,
    }
    ident = RunInfo(tmp_path / "3", {}, job).identity(group=None, name=None, tags=[])
    assert ident == {
        "name": "sharding=hybrid,precision=bf16",
        "group": "2026-11-22/06-00-00",
        "job_type": "sweep",
        "tags": ["precision=bf16", "sharding=hybrid"],
    }
    single = RunInfo(tmp_path / "run", {}, {"overrides": [], "choices": {}})
    assert single.identity(group="mine", name=None, tags=["x"]) == {
        "name": "run",
        "group": "mine",
        "job_type": "train",
        "tags": ["x"],
    }


def _logger(*overrides: str) -> dict:
    register_schema()
    with initialize_config_dir(str(CONF), version_base=None):
        return to_typed(compose("config", overrides=list(overrides))).logger


def test_the_logger_group_takes_one_tracker_several_or_none():
    assert [c.name for c in trackers.chosen(_logger())] == ["wandb"]  # the default
    both = trackers.chosen(
        _logger("logger=[wandb,tensorboard,mlflow]", "logger.wandb.mode=offline")
    )
    assert [c.name for c in both] == ["wandb", "tensorboard", "mlflow"]
    assert both[0].settings.mode is WandbMode.offline
    assert both[2].settings.tracking_uri is None and both[2].settings.nested is True
    assert trackers.chosen(_logger("logger=none")) == []


@pytest.mark.parametrize("option", sorted(p.stem for p in (CONF / "logger").glob("*.yaml")))
def test_a_trackers_yaml_states_its_settings_defaults(option):
    """One source of truth: each YAML lists its tracker's settings (so that the command line can
    set them) with the Settings dataclass's defaults."""
    for c in trackers.chosen(_logger(f"logger={option}")):
        defaults = dataclasses.asdict(c.cls.Settings())
        assert dataclasses.asdict(c.settings) == defaults, option
        yaml_keys = set(_logger(f"logger={option}")[c.name]) - {"tracker"}
        assert yaml_keys == set(defaults), option


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("+logger.wandb.modee=x",), "logger.wandb: modee: Key 'modee' not in 'WandbSettings'"),
        (("logger.wandb.mode=loud",), "logger.wandb: mode: Invalid value 'loud'"),
        (("logger.wandb.init_timeout_s=0",), "logger.wandb: init_timeout_s=0: must be positive"),
        (("logger=mlflow", "logger.mlflow.max_retries=-1"), "max_retries=-1: must be 0 or more"),
        (("logger.wandb.tracker=nowhere.Tracker",), "logger.wandb.tracker=nowhere.Tracker: cannot"),
        (("logger.wandb.tracker=pathlib.Path",), "is not a fsdp_lab Tracker subclass"),
        (("~logger.wandb.tracker",), "logger.wandb: no `tracker` naming its class"),
    ],
)
def test_a_bad_tracker_setting_is_one_line_naming_it(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        trackers.check(_logger(*overrides))
    assert "\n" not in str(e.value)


@dataclass
class _Nothing:
    pass


class _Flaky(Tracker):
    """A tracker that fails where it is told to, and records what reached it."""

    Settings = _Nothing
    calls: ClassVar[list] = []
    fail_at = ""

    @classmethod
    def start(cls, settings, run, *, resume):
        if cls.fail_at == "start":
            raise ConnectionError("no server\nat all")
        return cls()

    @property
    def info(self):
        return {"resumed": False}

    def log_metrics(self, metrics, step):
        if self.fail_at == "log":
            raise ConnectionError("gone")
        self.calls.append((step, metrics))

    def finish(self, *, status, summary):
        self.calls.append(status)


class _Recorder(_Flaky):
    """Records the steps it is sent, and whether it was started to continue."""

    @classmethod
    def start(cls, settings, run, *, resume):
        cls.calls.append(("resumed", resume))
        tracker = cls()
        tracker.continues = resume is not None
        return tracker

    def log_metrics(self, metrics, step):
        self.calls.append(step)


def test_on_resume_a_continued_tracker_skips_what_it_has_and_a_new_one_gets_the_history(
    monkeypatch, tmp_path
):
    monkeypatch.setattr(_Recorder, "calls", [])
    logger = {"old": {"tracker": f"{__name__}._Recorder"}}
    logger["new"] = dict(logger["old"])
    val = {"split": "val", "val_loss": 1.0, "val_ppl": 2.7, "val_tokens": 8}
    history = [{**val, "step": s} for s in (2, 4)]  # metrics.jsonl, cut at the checkpoint (4)
    tracker_set = TrackerSet.start(
        logger,
        RunInfo(tmp_path, {}),
        resume={"old": {"id": "x"}},
        logged_through=6,  # the attempt before sent steps up to 6, then died
        history=history,
    )
    assert _Recorder.calls == [("resumed", {"id": "x"}), ("resumed", None), 2, 4]
    _Recorder.calls.clear()
    tracker_set.log([{**val, "step": s} for s in (6, 8)])
    assert _Recorder.calls == [8, 6, 8]  # "old" has 6 already


class _NeedsAPackage(_Flaky):
    requires = (("no_such_module_here", "no-such-package"),)


def test_a_tracker_without_its_package_is_refused_before_launch_naming_the_fix():
    with pytest.raises(ConfigError) as e:
        trackers.check({"mine": {"tracker": f"{__name__}._NeedsAPackage"}})
    assert str(e.value) == (
        "logger=mine needs the no-such-package package: pip install no-such-package, or choose "
        "another logger"
    )


@pytest.mark.parametrize("fail_at", ["start", "log"])
def test_a_failing_tracker_warns_once_and_the_others_go_on(fail_at, caplog, tmp_path, monkeypatch):
    monkeypatch.setattr(_Flaky, "fail_at", fail_at)
    monkeypatch.setattr(_Flaky, "calls", [])
    logger = {
        "flaky": {"tracker": f"{__name__}._Flaky"},
        "tensorboard": {"tracker": "fsdp_lab.observe.trackers.tensorboard.TensorBoardTracker"},
    }
    record = {"split": "val", "step": 2, "val_loss": 1.0, "val_ppl": 2.7, "val_tokens": 8}
    with caplog.at_level(logging.WARNING, logger="fsdp_lab"):
        tracker_set = TrackerSet.start(
            logger, RunInfo(tmp_path, {"seed": 0}), resume={}, logged_through=-1, history=[]
        )
        for _ in range(3):
            tracker_set.log([record])
        tracker_set.finish(status="completed", summary={"final_loss": None}, files=[])
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    verb = "failed to start (no server)" if fail_at == "start" else "stopped (gone)"
    assert len(warnings) == 1 and warnings[0].startswith(f"logger=flaky {verb}")
    assert _Flaky.calls == []
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))  # it went on


TRACKER_NAMES = re.compile(
    r"\b(WandbTracker|TensorBoardTracker|MlflowTracker|trackers\.(wandb|tensorboard|mlflow))\b"
)


def test_nothing_outside_the_trackers_package_names_a_tracker():
    assert_only_named_in(
        {"observe/trackers/"},
        TRACKER_NAMES,
        ["from fsdp_lab.observe.trackers.wandb import WandbTracker"],
        "a tracker named outside observe/trackers",
    )


def test_a_password_in_a_uri_never_reaches_params_or_run_json():
    assert redact("http://me:s3cret@mlflow.corp:5000/x") == "http://me:***@mlflow.corp:5000/x"
    assert redact("https://mlflow.corp") == "https://mlflow.corp"
    assert redact(7) == 7


def test_mlflow_continues_its_run_only_where_that_run_is(tmp_path):
    """A changed tracking_uri starts a new run, which then gets the steps from metrics.jsonl."""
    from fsdp_lab.observe.trackers.mlflow import MlflowSettings, MlflowTracker

    here = MlflowSettings(tracking_uri=(tmp_path / "a").as_uri())
    run = RunInfo(tmp_path / "run", {"seed": 0})
    first = MlflowTracker.start(here, run, resume=None)
    again = MlflowTracker.start(here, run, resume=first.info)
    assert again.continues and again.info["run_id"] == first.info["run_id"]
    elsewhere = MlflowSettings(tracking_uri=(tmp_path / "b").as_uri())
    moved = MlflowTracker.start(elsewhere, run, resume=first.info)
    assert not moved.continues and moved.info["run_id"] != first.info["run_id"]
