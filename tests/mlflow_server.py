"""A real MLflow tracking server for the tests, on localhost, with a SQLite backend, run from
the tests' own environment: since the Optuna sweeper no longer pins SQLAlchemy below 2, MLflow's
server (which needs SQLAlchemy 2) and fsdp_lab share one environment (the trackers extra
installs the full ``mlflow``)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


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
            sys.executable,
            "-m",
            "mlflow",
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
