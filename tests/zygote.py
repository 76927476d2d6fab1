"""A warm interpreter that runs ``train.py`` for the tests (``conftest.train``).

A fresh ``python train.py`` spends about 8 s of its CPU importing torch, transformers and Hydra
before it checks anything; the tests start it about a hundred times (and ``python -m
fsdp_lab.tools.cli`` a few). This process imports them once and then, for each request, forks a
child that runs the script, module or code as ``python`` would: its own argv, ``sys.path[0]``
(the script's folder, the working dir for ``-m``), working dir, environment and output files,
``__main__`` executed by runpy, atexit handlers at the end, the exit code of ``sys.exit``. Only
the imports are shared, so conftest sends here only runs that set no variable read at process
start (an import-time setting) other than glibc's MALLOC_* ones, which become mallopt calls;
those, and runs a test signals or kills, are fresh interpreters. ``FSDP_LAB_TEST_ZYGOTE=0``
starts every run fresh.

The protocol, one JSON object per line: the request on stdin, ``{"pid": ...}`` then
``{"code": ...}`` on stdout once that run has ended.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

# What a train.py run imports before it forks its ranks, whatever the model (the launcher builds
# it on meta, the ranks inherit the modules).
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.bert.modeling_bert",
    "hydra",
    "fsdp_lab.launch.run",
    "fsdp_lab.launch.sweep",
    "fsdp_lab.train.worker",
    "fsdp_lab.engine.model",
    "fsdp_lab.data.corpus",
    "fsdp_lab.planning.run_check",  # the Hydra callback that checks each run against the plan
)


# glibc reads these at process start; a forked child gets the same setting from mallopt (the
# parameter numbers of <malloc.h>), which its own forked ranks inherit.
MALLOPT = {
    "MALLOC_TRIM_THRESHOLD_": -1,
    "MALLOC_TOP_PAD_": -2,
    "MALLOC_MMAP_THRESHOLD_": -3,
    "MALLOC_MMAP_MAX_": -4,
    "MALLOC_ARENA_MAX": -8,
}


def _mallopt(env: dict[str, str]) -> None:
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    for name, param in MALLOPT.items():
        changed = name in env and env[name] != os.environ.get(name)
        if changed and not libc.mallopt(param, int(env[name])):
            raise RuntimeError(f"mallopt refused {name}={env[name]}")


def _run(request: dict) -> None:
    """In the forked child: be ``python <argv>`` in ``cwd``; never returns."""
    code = 1
    try:
        os.chdir(request["cwd"])
        _mallopt(request["env"])
        os.environ.clear()
        os.environ.update(request["env"])
        stdin = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        for fd, target in ((stdin, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        try:
            _main(request["argv"])
            code = 0
        except SystemExit as e:
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:  # sys.exit("message"), as the interpreter prints it
                print(e.code, file=sys.stderr)
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - an uncaught exception, as the interpreter reports it
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _main(argv: list[str]) -> None:
    """What ``python *argv`` runs: ``-m module``, ``-c code`` or a script, with sys.argv and
    sys.path[0] set as the interpreter sets them."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file first
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        script = str(Path(argv[0]).resolve())
        sys.argv = [script, *argv[1:]]
        sys.path[0] = str(Path(script).parent)
        runpy.run_path(script, run_name="__main__")


def serve() -> None:
    import importlib

    # As for `python train.py`: the repository first on the path, not this file's folder.
    sys.path[0] = str(Path(__file__).resolve().parents[1])
    for name in PRELOAD:
        importlib.import_module(name)
    reply = sys.stdout
    print(json.dumps({"ready": True}), file=reply, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run(request)
        print(json.dumps({"pid": pid}), file=reply, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), file=reply, flush=True)


if __name__ == "__main__":
    serve()
