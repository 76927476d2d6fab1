"""W&B settings without a run: the mode auto picks, and how a config and a sweep job are named."""

from __future__ import annotations

import pytest

from fsdp_lab.config import Config, LoggerConfig, WandbMode
from fsdp_lab.observe.wandb_logger import flatten, resolve_mode, run_identity


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
    assert resolve_mode(WandbMode.offline) == ("offline", "logger.mode=offline")


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
    ident = run_identity(Config(), tmp_path / "3", job)
    assert ident == {
        "name": "sharding=hybrid,precision=bf16",
        "group": "2026-11-22/06-00-00",
        "job_type": "sweep",
        "tags": ["precision=bf16", "sharding=hybrid"],
    }
    single = run_identity(
        Config(logger=LoggerConfig(group="mine", tags=["x"])),
        tmp_path / "run",
        {"overrides": [], "choices": {}},
    )
    assert single == {"name": "run", "group": "mine", "job_type": "train", "tags": ["x"]}
