"""Shared helpers: run train.py as a user does, and an unsharded reference of the same run."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from zygote import MALLOPT

ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

# fsdp_lab's cache (measured profiles, tokenized corpora) is the session's own: a test sees
# what its session made, never what earlier runs on this machine left. SmolLM2's converted
# weights stay in the user's cache (USER_CACHE): converting them takes ~40 s.
USER_CACHE = Path(os.environ.get("FSDP_LAB_CACHE") or "~/.cache/fsdp_lab").expanduser()
_SESSION_CACHE = tempfile.mkdtemp(prefix="fsdp_lab_cache_")
atexit.register(shutil.rmtree, _SESSION_CACHE, ignore_errors=True)
os.environ["FSDP_LAB_CACHE"] = _SESSION_CACHE


def _train_args(run_dir: Path, overrides: tuple[str, ...]) -> list[str]:
    """``train.py``'s arguments (after the interpreter): the run dir pinned, no progress bar."""
    return [
        str(ROOT / "train.py"),
        f"hydra.run.dir={run_dir}",
        "trainer.progress_bar=false",
        *overrides,
    ]


class _Zygote:
    """The client of tests/zygote.py: a warm interpreter that runs scripts in forks of itself."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "zygote.py")],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._buffer = b""
        if self._read(time.monotonic() + 120) != {"ready": True}:
            raise RuntimeError("tests/zygote.py did not start within 120 s")

    def _read(self, deadline: float) -> dict | None:
        """The next reply, or None at the deadline."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError("tests/zygote.py exited")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], cwd: Path, env: dict, timeout: float):
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {
                "argv": argv,
                "cwd": str(cwd),
                "env": env,
                "stdout": str(out),
                "stderr": str(err),
            }
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            pid = self._read(time.monotonic() + 60)["pid"]
            reply = self._read(time.monotonic() + timeout)
            if reply is None:
                os.kill(pid, signal.SIGKILL)  # its ranks die with it (PR_SET_PDEATHSIG)
                self._read(time.monotonic() + 60)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text())
            return subprocess.CompletedProcess(
                [sys.executable, *argv], reply["code"], out.read_text(), err.read_text()
            )


_zygote: _Zygote | None = None
# Settings a run may be given that are read after the fork: XLA's, when its runtime starts, and
# W&B's, when rank 0 starts its run (the zygote does not import wandb); glibc's, which the
# zygote turns into mallopt calls in the child.
_READ_AFTER_START = {
    "PJRT_DEVICE",
    "CPU_NUM_DEVICES",
    "WANDB_API_KEY",
    "WANDB_BASE_URL",
    *MALLOPT,
}


def run_python(argv: list[str], *, env: dict | None = None, timeout: float = 300):
    """``python *argv`` in ROOT to the end, output captured, with this process's environment
    plus ``env``: in a fork of tests/zygote.py unless ``env`` sets something read at process
    start (an import-time setting): then, or with FSDP_LAB_TEST_ZYGOTE=0, in a fresh
    interpreter. Set a run's variables here, not with monkeypatch.setenv: the zygote
    started with the session's environment."""
    global _zygote
    full_env = {**os.environ, **(env or {})}
    warm = os.environ.get("FSDP_LAB_TEST_ZYGOTE", "1") != "0" and hasattr(os, "fork")
    if warm and set(env or {}) <= _READ_AFTER_START:
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = _Zygote()
        return _zygote.run(argv, ROOT, full_env, timeout)
    return subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def train(
    run_dir: Path, *overrides: str, env: dict | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """Run train.py to the end (``env``: variables to set for it)."""
    return run_python(_train_args(run_dir, overrides), env=env, timeout=timeout)


def start_train(run_dir: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    """Start train.py in a fresh interpreter in the background (to signal or kill it mid-run)."""
    return subprocess.Popen(
        [sys.executable, *_train_args(run_dir, overrides)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def wait_for_steps(run_dir: Path, n: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until ``proc`` (a started train.py) has written ``n`` records to metrics.jsonl."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = run_dir / "metrics.jsonl"
        if path.is_file() and len(path.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError("training did not start")


def named_outside(pattern: re.Pattern, allowed: set[str]) -> list[str]:
    """Where fsdp_lab's modules, but those in ``allowed`` (paths under fsdp_lab/), match
    ``pattern``: the check that one table or package is the only place naming a concept's
    members."""
    return [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in sorted((ROOT / "fsdp_lab").rglob("*.py"))
        if not any(str(path.relative_to(ROOT / "fsdp_lab")).startswith(a) for a in allowed)
        for m in pattern.finditer(path.read_text())
    ]


def fused_twin(model, kind, chunk_size: int, *, compiled: bool = False):
    """``model`` (a causal LM on the host) as a fused loss's model of the same weights: its
    class with the fused mixin (``train.loss.model_mixin``), built on the host."""
    from fsdp_lab.engine import model as model_lib
    from fsdp_lab.internals import transformers_private
    from fsdp_lab.train import loss_code

    mixin = loss_code.fused_mixin(loss_code.FusedLossSpec(kind, chunk_size, compiled))
    twin = transformers_private.from_config(model_lib.extended(mixin, type(model)), model.config)
    twin.load_state_dict(model.state_dict())
    return twin.train(model.training)


def model_with_loss(model, kind, cfg=None, task=None):
    """(``model`` or its fused twin, the loss of ``kind`` on it): a host model as the worker
    builds a meta one (``train.loss.meta_model_with_loss``)."""
    from fsdp_lab.config import LossConfig, ModelTask
    from fsdp_lab.config.losses import loss_of
    from fsdp_lab.train import loss as loss_lib

    cfg = cfg or LossConfig(kind=kind)
    if loss_of(kind).fused:
        model = fused_twin(model, kind, loss_lib.tokens_per_chunk(cfg, model.config.vocab_size))
    task = task or ModelTask.causal_lm
    return model, loss_lib.build_loss(cfg, model, kind=kind, task=task)


def assert_only_named_in(allowed: set[str], pattern: re.Pattern, seen: list[str], what: str):
    """A table's ownership: ``pattern`` matches each line of ``seen`` (the check would see a
    dispatch written so), and no module of fsdp_lab outside ``allowed`` matches it (``what``:
    the failure's heading)."""
    for line in seen:
        assert pattern.search(line), f"the check would not see: {line}"
    hits = named_outside(pattern, allowed)
    assert not hits, f"{what}:\n" + "\n".join(hits)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


# Runs that tests in several modules read, each started once per session under its name
# (torchtitan's integration tests are a list of named override sets too). A test reads a shared
# run and never writes into it: resuming goes to a run dir of its own.
STRATEGY_RUN = ("hardware=cpu", "trainer.max_steps=8", "checkpoint.every_n_steps=4")
SHARED_RUNS: dict[str, tuple[str, ...]] = {
    # every strategy: parity against the unsharded reference, then exact resume from step 4
    "full-2": (*STRATEGY_RUN, "sharding=full", "hardware.nproc_per_node=2"),
    "grad_op-2": (*STRATEGY_RUN, "sharding=grad_op", "hardware.nproc_per_node=2"),
    "no_shard-2": (*STRATEGY_RUN, "sharding=no_shard", "hardware.nproc_per_node=2"),
    "hybrid-4": (*STRATEGY_RUN, "sharding=hybrid", "hardware.nproc_per_node=4"),
    "hybrid_zero2-4": (*STRATEGY_RUN, "sharding=hybrid_zero2", "hardware.nproc_per_node=4"),
    # long enough to learn, and to be preempted in the middle of (locally, under sbatch and
    # under submitit): the uninterrupted run every preempted one must reproduce
    "long": ("hardware=cpu", "trainer.max_steps=150", "trainer.eval_every=0"),
}


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """``shared_run(name)``: the run dir of SHARED_RUNS[name], run to the end on first use."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            run_dir = tmp_path_factory.mktemp(name) / "run"
            check_ok(train(run_dir, *SHARED_RUNS[name]))
            done[name] = run_dir
        return done[name]

    return get


# One sweep, as a user runs it: its report, its W&B group and its jobs' run dirs are all read
# from these four jobs.
SHARED_SWEEP = (
    "sharding=full,grad_op",
    "precision=fp32,bf16",
    "hardware=cpu",
    "trainer.max_steps=6",
    "trainer.eval_every=3",
    "checkpoint=none",
    "logger.wandb.mode=offline",
)


@pytest.fixture(scope="session")
def shared_sweep(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """(the sweep dir of ``train.py -m *SHARED_SWEEP``, its finished process)."""
    sweep = tmp_path_factory.mktemp("sweep") / "sweep"
    argv = ["train.py", "-m", f"hydra.sweep.dir={sweep}", "trainer.progress_bar=false"]
    proc = run_python([*argv, *SHARED_SWEEP], timeout=600)
    check_ok(proc)
    return sweep, proc


def rank_pid(run_dir: Path, rank: int, timeout: float = 60) -> int:
    """The pid of a running rank of the local launcher whose run dir is ``run_dir``."""
    path = run_dir / "logs" / f"rank{rank}.pid"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):  # not yet written, or half-written
            return int(path.read_text())
        time.sleep(0.1)
    raise AssertionError(f"no worker of rank {rank} found ({path})")


@pytest.fixture
def fake_group():
    """``fake_group(rank, world)``: join a fake process group of ``world`` ranks as ``rank``
    (collectives return at once): layouts of any world size in this one process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    yield lambda rank, world: dist.init_process_group(
        "fake", store=FakeStore(), rank=rank, world_size=world
    )
    if dist.is_initialized():
        dist.destroy_process_group()


def tiny_llama(seed: int = 0, **sizes):
    """A small random Llama (2 layers, hidden 32, vocabulary 64; ``sizes``: config fields that
    differ), built the same way under the same seed: unit tests of generation and sharding."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**fields, **sizes}))


@pytest.fixture(scope="session")
def bpe_tokenizer(tmp_path_factory) -> str:
    """A byte-level BPE tokenizer (GPT-2's kind) trained here, as a tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from fsdp_lab.data.sources import shakespeare_files

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([p.read_text() for p in shakespeare_files()[:6]], trainer)
    path = tmp_path_factory.mktemp("bpe")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def smollm2() -> str:
    """SmolLM2-135M-Instruct's directory (model and tokenizer), converted offline by
    scripts/prepare_smollm2.py: cached after the first time (~40 s)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from prepare_smollm2 import MissingDependency, prepare
    finally:
        sys.path.pop(0)
    try:
        return str(prepare(USER_CACHE))
    except MissingDependency as e:  # `make test` installs them: a missing one is a failure
        pytest.fail(f"SmolLM2 tests need: {e}")
