"""A real MLflow tracking server for the tests, on localhost, with a SQLite backend.

`mlflow server` needs the full mlflow package and SQLAlchemy 2 (with SQLAlchemy 1.4 it dies at
start: "module 'sqlalchemy' has no attribute 'Engine'"), which the project's environment cannot
have: the optuna extra's optuna<3 pins SQLAlchemy below 2. So the server runs from an
environment of its own, .venv-mlflow, built here the first time (about a minute),
with the same MLflow version as the project's mlflow-skinny client.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-mlflow"


def server_env() -> Path:
    """.venv-mlflow/bin/mlflow, built if missing."""
    mlflow = VENV / "bin" / "mlflow"
    if not mlflow.is_file():
        version = importlib.metadata.version("mlflow-skinny")
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run(
            [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", f"mlflow=={version}"],
            check=True,
        )
    return mlflow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(root: Path, timeout: float = 180) -> Iterator[str]:
    """A server storing runs in root/mlflow.db and artifacts in root/artifacts; its URI."""
    port = free_port()
    log = (root / "server.log").open("w")
    proc = subprocess.Popen(
        [
            str(server_env()),
            "server",
            "--host=127.0.0.1",
            f"--port={port}",
            f"--backend-store-uri=sqlite:///{root / 'mlflow.db'}",
            f"--artifacts-destination={root / 'artifacts'}",
            "--workers=1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}"
                    ) from None
                time.sleep(0.5)
        yield uri
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
