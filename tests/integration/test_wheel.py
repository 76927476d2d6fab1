"""The built wheel, installed as a user installs it: into a fresh virtual environment (reusing
this environment's torch, so no second torch is downloaded), run from an empty directory, with
the user's own config dir and the user's own package (a model family, a tracker) beside it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_trackers import MY_TRACKER

pytestmark = pytest.mark.slow  # builds a wheel and runs it: make test, not make test-fast

ROOT = Path(__file__).resolve().parents[2]
# This environment's setuptools builds the wheels where it has one (no download); else pip
# fetches it into an isolated build environment, as a user's pip would.
NO_ISOLATION = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []

USER_PACKAGE = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "my_lab"
        version = "0.1"

        [project.entry-points."fsdp_lab.families"]
        phi3 = "my_lab.families:PHI3"
        """,
    "my_lab/__init__.py": "",
    "my_lab/families.py": """
        from fsdp_lab.config.families import Activations, Family

        PHI3 = Family("phi3", Activations.llama, fused_loss=True)
        """,
    "my_lab/tracker.py": MY_TRACKER,
}
USER_CONF = {
    "model/two_layers.yaml": """
        defaults:
          - llama_tiny
          - _self_
        num_layers: 2
        """,
    "logger/mine.yaml": """
        mine:
          tracker: my_lab.tracker.JsonTracker
          file: mine.jsonl
        """,
    "optim/typo.yaml": """
        defaults:
          - adamw
          - _self_
        learning_rate: 0.1
        """,
}


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """fsdp_lab's wheel and a user's package, installed into a venv that sees this
    environment's packages (torch, transformers, hydra) but not this checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    user = tmp / "my_lab"
    _write(user, USER_PACKAGE)
    # Built from a copy: setuptools' build/ in the checkout would keep files deleted since.
    source = tmp / "source"
    skip = shutil.ignore_patterns(".git", "build", ".venv*", "outputs", "multirun", "*.egg-info")
    shutil.copytree(ROOT, source, symlinks=True, ignore=skip)
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *NO_ISOLATION]
    subprocess.run([*build, "-w", str(tmp / "dist"), str(source), str(user)], check=True)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    wheels = sorted(str(p) for p in (tmp / "dist").glob("*.whl"))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps"]
    subprocess.run([*pip, *wheels], check=True)
    return venv


def _run(venv: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    command = [str(venv / "bin" / argv[0]), *argv[1:]]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_wheel_trains_and_plans_from_an_empty_directory_with_the_users_configs(venv, tmp_path):
    where = _run(venv, tmp_path, "python", "-c", "import fsdp_lab; print(fsdp_lab.__file__)")
    assert where.stdout.startswith(str(venv)), where  # the wheel, not this checkout
    conf = tmp_path / "my_experiments" / "conf"
    _write(conf, USER_CONF)
    here = tmp_path / "empty"
    here.mkdir()
    run = here / "run"
    proc = _run(
        venv, here, "fsdp-lab", "train", "--config-dir", str(conf), "model=two_layers",
        "logger=[mine]", "hardware=cpu", "hardware.nproc_per_node=2", "trainer.max_steps=2",
        "trainer.eval_every=0", "checkpoint=none", f"hydra.run.dir={run}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "completed" and record["world_size"] == 2
    assert "num_layers: 2" in (run / "config.yaml").read_text()  # the user's group option
    mine = [json.loads(line) for line in (run / "mine.jsonl").read_text().splitlines()]
    assert mine[-1]["status"] == "completed"  # the user's tracker, from the user's package
    assert sorted(p.name for p in here.iterdir()) == ["run"]  # nothing else written here

    plan = _run(venv, here, "fsdp-lab", "plan", "--config-dir", str(conf), "model=two_layers")
    assert plan.returncode == 0 and "LlamaDecoderLayer x2" in plan.stdout, plan.stderr
    family = "from fsdp_lab.config.families import family_of; print(family_of('phi3'))"
    found = _run(venv, here, "python", "-c", family)
    assert "model_type='phi3'" in found.stdout, found.stderr  # the user's entry point


def test_a_users_typo_or_missing_config_dir_is_one_line(venv, tmp_path):
    conf = tmp_path / "conf"
    _write(conf, USER_CONF)
    cases = [
        (["train", "--config-dir", str(conf), "optim=typo"], f"{conf}/optim/typo.yaml: Key "),
        (["plan", "--config-dir", str(conf), "optim=typo"], f"{conf}/optim/typo.yaml: Key "),
        (["train", "--config-dir", str(tmp_path / "nope")], "no such directory"),
        (["plan", f"hydra.searchpath=[{tmp_path / 'nope'}]"], "no such directory"),
    ]
    for argv, fragment in cases:
        proc = _run(venv, tmp_path, "fsdp-lab", *argv)
        errors = [line for line in proc.stderr.splitlines() if "error:" in line]
        assert proc.returncode == 2 and len(errors) == 1 and fragment in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "outputs").exists()  # refused before any run dir was made
