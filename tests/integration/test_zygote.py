"""The tests' warm interpreter (tests/zygote.py) runs a script as `python script` does."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_python

pytestmark = pytest.mark.slow

SCRIPT = """\
import atexit, os, sys
atexit.register(lambda: print("atexit ran", flush=True))
print(sys.argv[1:], sys.path[0] == os.path.dirname(os.path.abspath(__file__)), os.getcwd())
print("env", os.environ.get("ZYGOTE_PROBE"), __name__)
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def warm_as_fresh(argv: list[str]) -> subprocess.CompletedProcess:
    """``python *argv`` from the zygote, checked to print and return what a fresh one does."""
    warm = run_python(argv)
    fresh = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, env=os.environ.copy()
    )
    assert (warm.returncode, warm.stdout, warm.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )
    return warm


@pytest.mark.parametrize("code", [0, 3])
def test_a_forked_run_is_what_a_fresh_interpreter_prints_and_returns(tmp_path, code):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    argv = [str(script), str(code), "a=b"]
    warm = warm_as_fresh(argv)
    assert warm.returncode == code and "atexit ran" in warm.stdout
    assert f"['{code}', 'a=b'] True {ROOT}" in warm.stdout and "env None __main__" in warm.stdout


def test_a_run_with_its_own_environment_sees_it(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    proc = run_python([str(script), "0"], env={"ZYGOTE_PROBE": "x"})
    assert "env x __main__" in proc.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "fsdp_lab.tools.cli", "--help"],  # argparse names the program from sys.argv[0]
        ["-m", "fsdp_lab.tools.cli", "export"],  # a usage error: exit 2
        ["-c", "import sys; print(sys.argv, repr(sys.path[0])); sys.exit(4)", "x"],
    ],
    ids=["module", "module-error", "code"],
)
def test_modules_and_code_run_as_python_runs_them(argv):
    warm_as_fresh(argv)


def test_only_a_start_time_setting_costs_a_fresh_interpreter(tmp_path):
    """A forked run finds transformers imported already; a fresh one does not."""
    script = tmp_path / "which.py"
    script.write_text('import sys; print("warm" if "transformers" in sys.modules else "fresh")\n')
    after_start = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "WANDB_BASE_URL": "http://x"}
    after_start["MALLOC_MMAP_THRESHOLD_"] = "131072"  # set with mallopt in the fork
    assert run_python([str(script)]).stdout == "warm\n"
    assert run_python([str(script)], env=after_start).stdout == "warm\n"
    assert run_python([str(script)], env={"HF_HUB_OFFLINE": "1"}).stdout == "fresh\n"
